"""The names a store is laid out by: a plain stage or version name, and the manifest that commits a version."""

from __future__ import annotations

import re
from typing import Any

MANIFEST = "_manifest.json"
# a stage or version name: one path segment, never '.', '..', hidden, absolute or with a separator
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def plain_name(name: Any) -> bool:
    """Whether ``name`` may name a stage or a version: letters, digits, ``_.-``, not starting with ``.``/``_``/``-``,
    no ``..``; so ``{store}/{stage}/{version}`` is always a direct child of ``{store}/{stage}``."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and ".." not in name


def check_name(what: str, name: Any) -> str:
    """``name`` if :func:`plain_name`, else a ValueError that says so."""
    if not plain_name(name):
        raise ValueError(f"{what} {name!r}: not a plain name (letters, digits, '_', '.', '-'; no '/', no '..')")
    return name
