"""What a model runs on, for inference and training alike: the device (chosen by default in one place), autocast,
the numerics record a torch stage is versioned with, and batches sorted by length for evaluation and prediction.

Training (:mod:`tasks.training.loop`) imports this runtime; it imports no trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from models import numerics  # called through the module: a test or a tool may substitute numerics_record
from models.numerics import torch_threads

# ============================================================================= device


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``: the one place the default device is chosen (``device: auto``,
    where ``lexiflow label`` and ``lexiflow explain`` run)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


CUDA_GUIDE = "https://pytorch.org/get-started/locally/"


def check_device(name: str, key: str = "device") -> None:
    """ValueError, in one line that says what to do, when ``name`` is ``cuda`` and this process cannot use CUDA: a
    torch build without CUDA (a ``+cpu`` wheel), or a CUDA build that sees no GPU. ``key`` names the setting
    (``pretrain.device``)."""
    if name != "cuda" or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        raise ValueError(f"{key} is 'cuda' but this torch build has no CUDA (torch {torch.__version__}): install a "
                         f"CUDA build of torch, see {CUDA_GUIDE}, or set {key}: cpu")
    raise ValueError(f"{key} is 'cuda' but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
                     f"check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES (install guide: {CUDA_GUIDE}), or set "
                     f"{key}: cpu")


def resolve_device(name: str, local_rank: int | None = None, key: str = "device") -> torch.device:
    """``cuda`` (index ``local_rank`` under torchrun) for ``cuda``, or ``auto`` with a GPU; else ``cpu``.
    ``cuda`` where CUDA cannot be used is refused in one line (:func:`check_device`)."""
    check_device(name, key)
    if name == "cuda" or (name == "auto" and default_device() == "cuda"):
        return torch.device("cuda") if local_rank is None else torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast(device: torch.device, precision: str = "auto", cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; a no-op on CPU (CPU runs stay fp32 and bit-identical). ``precision`` "bf16" or
    "fp32" forces it on or off on any device (the bf16 path runs on CPU too, for tests). ``cache`` False: no cache
    of cast weights (a step captured in a CUDA graph casts them inside the graph)."""
    on = device.type == "cuda" if precision == "auto" else precision == "bf16"
    if not cache:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on, cache_enabled=False)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``: on CUDA through pinned memory without waiting for the copy (the host goes on
    building the step while it lands; kernels queued after it on the stream see it); on CPU the array itself,
    shared, as ``torch.from_numpy`` gives it (nothing copied, nothing pinned)."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def numerics_config(threads: int, device_name: str) -> dict[str, Any]:
    """What a torch stage computes with, hashed into its version and kept in its manifest's config: the pinned
    CPU numerics (:func:`models.numerics.numerics_record`) under ``threads`` and the device it resolves to."""
    with torch_threads(threads):
        record = numerics.numerics_record()
    device = resolve_device(device_name)
    record["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return record


# ============================================================================= batches


def sorted_batches(lengths: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Evaluation order: indices sorted by length (stable), cut into batches (least padding)."""
    order = np.argsort(lengths, kind="stable")
    for s in range(0, len(order), batch_size):
        yield order[s : s + batch_size]
