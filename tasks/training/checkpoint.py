"""Exact-resume training checkpoints: weights, optimizer, scheduler, torch RNG and the data position.

A checkpoint directory (any fsspec filesystem) holds ``model.safetensors``, ``trainer.pt``
(optimizer, scheduler, RNG states and :class:`TrainState`, loaded ``weights_only``) and
``state.json``, written last: a directory without it is incomplete and ignored.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken, data epoch, batches consumed in that epoch, and the log
    rows written so far (so a resumed run's log is whole, not only the steps after the checkpoint)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    window: dict[str, Any] | None = None  # the running sums since the last log row, when saved between two rows


def rng_state() -> dict[str, Any]:
    """This process's torch RNG state (CPU, and the CUDA devices when there are any)."""
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def save_checkpoint(fs, dir_path: str, model, opt, sched, state: TrainState,
                    rng_by_rank: list[dict[str, Any]] | None = None) -> None:
    """Weights as safetensors; optimizer/scheduler/RNG via torch.save (loaded weights_only). Under DDP,
    ``rng_by_rank`` holds every rank's :func:`rng_state` (their dropout draws differ), each restored to its rank."""
    blob = io.BytesIO()
    torch.save(
        {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            **rng_state(),
            "rng_by_rank": rng_by_rank or [],
            "state": state.__dict__,
        },
        blob,
    )
    fs.makedirs(dir_path, exist_ok=True)
    for name, data in (("model.safetensors", st_save(weights(model))), ("trainer.pt", blob.getvalue())):
        tmp = f"{dir_path}/{name}.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, f"{dir_path}/{name}")
    with fs.open(f"{dir_path}/state.json", "w") as f:  # written last: marks a complete checkpoint
        json.dump(state.__dict__, f)


def load_checkpoint(fs, dir_path: str, model, opt, sched, rank: int = 0) -> TrainState | None:
    """The state of a complete checkpoint under ``dir_path`` (None when there is none), loaded into the model,
    optimizer and scheduler, with this rank's RNG state."""
    if not fs.exists(f"{dir_path}/state.json"):
        return None
    with fs.open(f"{dir_path}/model.safetensors", "rb") as f:
        sd = st_load(f.read())
    unwrap(model).load_state_dict(sd, strict=False)
    with fs.open(f"{dir_path}/trainer.pt", "rb") as f:
        ck = torch.load(io.BytesIO(f.read()), weights_only=True)
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    rng = ck["rng_by_rank"][rank] if ck.get("rng_by_rank") else ck
    torch.set_rng_state(rng["torch_rng"])
    if rng["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda_rng"])
    return TrainState(**ck["state"])


def unwrap(model):
    """The plain module under a DDP and/or torch.compile wrapper."""
    return getattr(model, "module", getattr(model, "_orig_mod", model))


def weights(model) -> dict[str, torch.Tensor]:
    """Contiguous tensors; tied weights stored once (safetensors refuses shared storage)."""
    sd = unwrap(model).state_dict()
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out
