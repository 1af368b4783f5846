"""Exact-resume training checkpoints that cannot tear: weights, optimizer, scheduler, torch RNG and the data position.

A checkpoint directory (any fsspec filesystem; the pretrain stage's is ``<store>/_checkpoints/pretrain/<version>``)::

    step-00000400/model.safetensors  the weights
    step-00000400/trainer.pt         optimizer, scheduler, RNG states and :class:`TrainState` (loaded weights_only)
    step-00000200/...                the checkpoint before it
    latest.json                      the pointer: the published checkpoints, newest first, each with its step, its
                                     directory and every file's size and sha256

A save writes a new step directory completely, then publishes it in one atomic step, the pointer: on an object store
one PUT (S3 and the others show an object whole or not at all; they have no atomic rename), elsewhere written under a
temporary name and renamed over the old one. Only then are the checkpoints the pointer no longer names removed (it
keeps the new one and the one before, :data:`KEEP`, or as many as the caller asks), and with them any step
directory of an interrupted save.
Resume takes the newest published checkpoint whose files have the recorded sizes and digests, else the one before
it. So a kill after any file operation of a save resumes from a complete checkpoint, the new one or the one before,
never new weights with an old optimizer.

A directory of the layout before this one (``model.safetensors``, ``trainer.pt`` and ``state.json`` side by side,
which a kill between its two moves could leave torn: new weights, old optimizer) is refused, with a message that
says how to go on.

Test hooks: with ``LEXIFLOW_CKPT_KILL_AFTER=<n>`` the process ends (``os._exit(137)``, as SIGKILL would) right after
the n-th file operation of its saves, counted over the process: each directory made, write, rename, pointer and
removal (fault-injection tests, like ``LEXIFLOW_PAUSE_IN``); ``LEXIFLOW_PAUSE_IN=checkpoint`` parks a save between its
two files until a stop signal comes (two with ``LEXIFLOW_PAUSE_SIGNALS=2``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from storage.digests import is_object_store
from tasks.common.context import pause_point
from tasks.training import preempt

log = logging.getLogger("lexiflow")

POINTER = "latest.json"
FORMAT = "lexiflow-checkpoints-2"
KEEP = 2  # published checkpoints kept: the newest and the one to fall back to
FILES = ("model.safetensors", "trainer.pt")
KILL_AFTER_ENV = "LEXIFLOW_CKPT_KILL_AFTER"
_ops = 0  # file operations of saves in this process (the kill hook counts them)


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken, data epoch, batches consumed in that epoch, and the log
    rows written so far (so a resumed run's log is whole, not only the steps after the checkpoint)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    window: dict[str, Any] | None = None  # the running sums since the last log row, when saved between two rows
    row_pending: bool = False  # stopped during this step's log row (its held-out evaluation): the rerun writes it


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's torch RNG state: the CPU's, and on a CUDA ``device`` that device's only (a rank draws on its
    own GPU; saving every visible GPU's would tie the checkpoint to a machine with at least as many)."""
    cuda = [torch.cuda.get_rng_state(device)] if device is not None and device.type == "cuda" else []
    return {"torch_rng": torch.get_rng_state(), "cuda_rng": cuda}


def _restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    """Put back :func:`rng_state`'s states: the CPU's, and the CUDA one on a CUDA ``device``. A checkpoint written
    before one state was kept holds one per visible GPU: this rank's device's is taken (none when that machine had
    fewer GPUs: the run resumes with this device's own draws, and says so)."""
    torch.set_rng_state(rng["torch_rng"])
    cuda = rng["cuda_rng"]
    if not cuda or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    state = cuda[0] if len(cuda) == 1 else cuda[index] if index < len(cuda) else None
    if state is None:
        log.warning("the checkpoint holds no CUDA RNG state for cuda:%d (it was written on a machine with %d GPUs): "
                    "dropout draws after the resume differ from an uninterrupted run's", index, len(cuda))
        return
    torch.cuda.set_rng_state(state, device)


def _device(model) -> torch.device:
    """The device of ``model``'s parameters (CPU for a model without any)."""
    return next((p.device for p in unwrap(model).parameters()), torch.device("cpu"))


def _op(fn, *args, **kwargs) -> Any:
    """One file operation of a save (the kill hook ends the process after the n-th)."""
    global _ops
    out = fn(*args, **kwargs)
    _ops += 1
    if os.environ.get(KILL_AFTER_ENV) == str(_ops):
        os._exit(137)
    return out


def _write(fs, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


def _digest(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def step_dir_name(step: int) -> str:
    """A checkpoint's directory under the checkpoint directory: ``step-00000200``."""
    return f"step-{step:08d}"


def save_checkpoint(fs, dir_path: str, model, opt, sched, state: TrainState,
                    rng_by_rank: list[dict[str, Any]] | None = None, rows=None, keep: int = KEEP) -> None:
    """Write ``state.step``'s checkpoint into a step directory of its own, publish it (the pointer), then remove the
    checkpoints the pointer no longer names. Weights as safetensors; optimizer/scheduler/RNG via torch.save (loaded
    weights_only). Under DDP, ``rng_by_rank`` holds every rank's :func:`rng_state` (their dropout draws differ),
    each restored to its rank. ``rows``: a word table trained sparsely (:class:`tasks.training.row_adam.SparseRows`),
    whose per-row optimizer state goes into ``trainer.pt`` too. ``keep``: published checkpoints kept, this one
    included (1: no fallback when the newest is found damaged, half the disk). A stop signal during the save waits
    for the publish (:func:`preempt.saving`)."""
    if keep < 1:
        raise ValueError(f"keep {keep}: at least the checkpoint just written is kept")
    blob = io.BytesIO()
    extra = {"word_table": rows.state_dict()} if rows is not None else {}
    torch.save(
        {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            **rng_state(_device(model)),
            "rng_by_rank": rng_by_rank or [],
            "state": state.__dict__,
            **extra,
        },
        blob,
    )
    files = {"model.safetensors": st_save(weights(model)), "trainer.pt": blob.getvalue()}
    name = step_dir_name(state.step)
    target = f"{dir_path}/{name}"
    with preempt.saving():
        before = published(fs, dir_path)
        if fs.exists(target):  # an interrupted save of this step, or one a fallback left behind
            _op(fs.rm, target, recursive=True)
        _op(fs.makedirs, target, exist_ok=True)
        for fname, data in files.items():
            _op(_write, fs, f"{target}/{fname}", data)
            if fname == FILES[0]:
                _pause_in_save()
        entry = {"step": state.step, "dir": name, "files": {k: _digest(v) for k, v in files.items()}}
        kept = [entry] + [e for e in before if e["step"] < state.step][:keep - 1]
        _publish(fs, dir_path, {"format": FORMAT, "checkpoints": kept})
        preempt.published(state.step)
    named = {e["dir"] for e in kept}
    for child in _step_dirs(fs, dir_path):
        if child not in named:
            _op(fs.rm, f"{dir_path}/{child}", recursive=True)


def _pause_in_save() -> None:
    """Test hook: ``LEXIFLOW_PAUSE_IN=checkpoint`` parks a save between its two files (``pause_point``) until
    ``LEXIFLOW_PAUSE_SIGNALS`` (default 1) stop signals have come."""
    want = int(os.environ.get("LEXIFLOW_PAUSE_SIGNALS", "1"))
    pause_point("checkpoint", until=lambda: (s := preempt.active()) is not None and s.count >= want)


def _publish(fs, dir_path: str, pointer: dict[str, Any]) -> None:
    """The one atomic step of a save: the pointer replaced whole."""
    data = json.dumps(pointer, indent=1, sort_keys=True).encode()
    path = f"{dir_path}/{POINTER}"
    if is_object_store(fs):
        _op(_write, fs, path, data)  # one PUT: the object is the new one or the old one, never a mix
    else:
        _op(_write, fs, f"{path}.tmp", data)
        _op(fs.mv, f"{path}.tmp", path)  # a rename over the old pointer: atomic on a local filesystem


def _step_dirs(fs, dir_path: str) -> list[str]:
    fs.invalidate_cache(dir_path)
    if not fs.exists(dir_path):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(dir_path, detail=False)]
    return sorted(n for n in names if n.startswith("step-"))


def published(fs, dir_path: str) -> list[dict[str, Any]]:
    """The published checkpoints under ``dir_path``, newest first (``step``, ``dir``, ``files``: size and sha256 of
    each); [] when there is none. A pointer that cannot be read counts as none (with a warning)."""
    fs.invalidate_cache(dir_path)
    path = f"{dir_path}/{POINTER}"
    if not fs.exists(path):
        return []
    try:
        pointer = json.loads(fs.cat_file(path))
        if pointer.get("format") == FORMAT:
            return list(pointer["checkpoints"])
        why = f"format {pointer.get('format')!r}"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = str(e)
    log.warning("checkpoint pointer %s is unreadable (%s): no checkpoint to resume from", path, why)
    return []


def _verified(fs, dir_path: str, entry: dict[str, Any]) -> dict[str, bytes] | None:
    """The files of a published checkpoint, when each has the recorded size and sha256; else None (logged)."""
    out = {}
    for name in FILES:
        path = f"{dir_path}/{entry['dir']}/{name}"
        want = entry["files"].get(name)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            data = None
        if want is None or data is None or _digest(data) != want:
            log.warning("checkpoint at step %d: %s is %s; falling back to the one before", entry["step"], path,
                        "missing" if data is None else "not the file that was published")
            return None
        out[name] = data
    return out


def newest_complete(fs, dir_path: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """(pointer entry, file bytes) of the newest published checkpoint whose files verify, or None.

    A checkpoint directory of the earlier layout (flat files and ``state.json``) is refused: ValueError."""
    entries = published(fs, dir_path)
    if not entries and fs.exists(f"{dir_path}/state.json"):
        raise ValueError(f"{dir_path} holds a checkpoint of lexiflow's earlier layout (model.safetensors, trainer.pt "
                         "and state.json side by side), which a kill during its save could have torn; it is not "
                         "resumed. Remove that directory to train this version from its start, or finish the run "
                         "with the lexiflow that wrote it")
    for entry in entries:
        files = _verified(fs, dir_path, entry)
        if files is not None:
            return entry, files
    if entries:
        log.warning("no published checkpoint under %s is complete: training starts from step 0", dir_path)
    return None


def load_checkpoint(fs, dir_path: str, model, opt, sched, rank: int = 0, rows=None) -> TrainState | None:
    """The state of the newest complete checkpoint under ``dir_path`` (None when there is none), loaded into the
    model, optimizer and scheduler (and ``rows``, a sparsely trained word table's per-row state), with this rank's
    RNG state."""
    found = newest_complete(fs, dir_path)
    if found is None:
        return None
    _, files = found
    unwrap(model).load_state_dict(st_load(files["model.safetensors"]), strict=False)
    # onto the host: the optimizer puts each state on its parameter's device (with no map_location, tensors saved
    # from cuda:0 would go back to cuda:0 on every rank, or fail on a machine without that GPU)
    ck = torch.load(io.BytesIO(files["trainer.pt"]), weights_only=True, map_location="cpu")
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    if rows is not None:
        if "word_table" not in ck:
            raise ValueError(f"the checkpoint under {dir_path} has no word-table optimizer state (it was not saved by "
                             "a run with pretrain.model.word_table: sparse); remove that directory to start over")
        rows.load_state_dict(ck["word_table"])
    _restore_rng(ck["rng_by_rank"][rank] if ck.get("rng_by_rank") else ck, _device(model))
    return TrainState(**ck["state"])


def latest_state(fs, dir_path: str) -> TrainState | None:
    """The :class:`TrainState` of the newest complete checkpoint under ``dir_path`` (None when there is none), read
    without a model (to see where a run would resume)."""
    found = newest_complete(fs, dir_path)
    if found is None:
        return None
    return TrainState(**torch.load(io.BytesIO(found[1]["trainer.pt"]), weights_only=True, map_location="cpu")["state"])


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
