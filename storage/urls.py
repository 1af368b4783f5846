"""URLs as lexiflow stores and shows them: without a credential.

A presigned URL carries its signature in the query string (``X-Amz-Signature=…``, ``token=…``) and a URL may carry
``user:password@``; anyone who can read an output, a manifest or a log could use them. What lexiflow writes
(manifests, ``_run.json``, row ids, Prefect artifacts, log and error lines) holds :func:`public_url` of a URL, and,
where which URL it was matters (two query strings may select two objects), :func:`url_digest` of the full one.
Local paths (no ``scheme://``, or ``file://``) are names, not URLs, and are never changed.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_LOCAL = ("file", "local")
_CHAIN = re.compile(r"::(?=[A-Za-z][A-Za-z0-9+.-]*://)")  # fsspec's link separator, not an IPv6 host's "::"


def _public_link(link: str) -> str:
    scheme, sep, _ = link.partition("://")
    if not sep or scheme.lower() in _LOCAL or not scheme.replace("+", "").replace("-", "").isalnum():
        return link
    try:
        parts = urlsplit(link)
    except ValueError:  # not a URL after all (e.g. an unbalanced "[" in the host): cut at the first "?"/"#"
        return link.split("?", 1)[0].split("#", 1)[0]
    netloc = parts.netloc.rpartition("@")[2]
    if netloc == parts.netloc and not parts.query and not parts.fragment and "?" not in link and "#" not in link:
        return link  # nothing to remove: the exact text as given
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def public_url(url: str) -> str:
    """``url`` without userinfo (``user:password@``), query string and fragment, in each link of an fsspec
    chain (``tar://member::https://host/a.tar?sig=…``); a local path, or a URL without any of these, unchanged."""
    if not isinstance(url, str):
        return url
    return "::".join(_public_link(link) for link in _CHAIN.split(url))


def has_secret_parts(url: str) -> bool:
    """Whether :func:`public_url` would change ``url`` (it holds userinfo, a query string or a fragment)."""
    return public_url(url) != url


def url_digest(url: str, n: int = 12) -> str:
    """The first ``n`` hex digits of the sha256 of the full ``url``: which URL it was, without its secret."""
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:n]


def scrub(obj: Any) -> Any:
    """``obj`` (JSON-like: dicts, lists, strings) with :func:`public_url` applied to every string that holds a
    ``://`` URL; keys and everything else unchanged."""
    if isinstance(obj, str):
        return public_url(obj) if "://" in obj else obj
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return obj
