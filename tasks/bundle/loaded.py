"""A committed bundle opened on this machine's device, and one text explained with it (the CLI's and the API's way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.numerics import numerics_record
from tasks.bundle.bundle import Bundle, load_bundle
from tasks.bundle.explain import Explanation, bundle_words, explain_text


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``: where ``lexiflow label`` and ``lexiflow explain`` run."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def open_bundle(uri: str, device: str | None = None) -> Bundle:
    """Open a committed bundle (every file checksum-verified) on ``device``, by default :func:`default_device`."""
    return load_bundle(uri, device or default_device())


def explain(bundle: Bundle, text: str, words: Sequence[str] | None = None) -> Explanation:
    """What ``bundle`` looks at for ``text`` (``words``: the bundle's word list, read from it when not given).

    Refuses a process whose torch computed before the CPU kernels were pinned, as scoring does."""
    numerics_record()
    return explain_text(bundle, text, bundle_words(bundle.uri) if words is None else words)
