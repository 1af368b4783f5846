"""Exact-resume training checkpoints that cannot tear: weights, optimizer, scheduler, torch RNG and the data position.

A checkpoint directory (any fsspec filesystem; the pretrain stage's is ``<store>/_checkpoints/pretrain/<version>``)::

    step-00000400/model.safetensors  the weights
    step-00000400/trainer.pt         optimizer, scheduler, RNG states and :class:`TrainState` (loaded weights_only)
    step-00000400/rows.safetensors   with a sparsely trained word table: its per-row AdamW state
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

Nothing is built whole in memory: a save streams each tensor to its file (from the device one tensor at a time),
hashing the bytes as they go; a resume verifies the files by streaming them through sha256 (under DDP once per
node, by its first rank: :func:`newest_complete` there, then :func:`load_checkpoint` with that ``entry`` on every
rank) and reads each safetensors tensor straight into the model's or the optimizer's own memory.

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
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from storage.digests import is_object_store
from tasks.common.context import pause_point
from tasks.training import preempt

log = logging.getLogger("lexiflow")

POINTER = "latest.json"
FORMAT = "lexiflow-checkpoints-2"
KEEP = 2  # published checkpoints kept: the newest and the one to fall back to
FILES = ("model.safetensors", "trainer.pt")  # in every checkpoint
ROWS_FILE = "rows.safetensors"  # in a checkpoint of a sparsely trained word table
CHUNK = 16 << 20  # bytes per write or read: what a buffered remote file copies at a time
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


class _Hashing:
    """A write-only file that passes the bytes on in :data:`CHUNK` pieces and hashes them as they go."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        for i in range(0, len(mv), CHUNK):
            piece = mv[i:i + CHUNK]
            self.sha.update(piece)
            self.f.write(piece)
        self.n += len(mv)
        return len(mv)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> dict[str, Any]:
        return {"bytes": self.n, "sha256": self.sha.hexdigest()}


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def _host_bytes(t: torch.Tensor) -> memoryview:
    """``t``'s bytes (on the host: one tensor at a time from a device), without a copy where it already is."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(f, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` to the open file ``f`` in the safetensors format, one tensor at a time (no whole-file
    buffer; names in sorted order). Any safetensors reader reads it."""
    header, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for name in sorted(tensors):
        f.write(_host_bytes(tensors[name]))


def read_safetensors_into(f, targets: dict[str, torch.Tensor]) -> set[str]:
    """Read a safetensors file from the open file ``f`` straight into ``targets``' tensors (same shapes and
    dtypes; CPU ones read in place, others through one host tensor at a time); names absent from ``targets`` are
    skipped. Returns the names read."""
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    start, done = 8 + n, set()
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dst = targets.get(name)
        if dst is None:
            continue
        dtype, shape = _ST_TORCH[info["dtype"]], tuple(info["shape"])
        if dst.dtype != dtype or tuple(dst.shape) != shape:
            raise ValueError(f"checkpoint tensor {name} is {info['dtype']} {list(shape)}, the model's is "
                             f"{dst.dtype} {list(dst.shape)}")
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        buf = dst.detach() if direct else torch.empty(shape, dtype=dtype)
        f.seek(start + info["data_offsets"][0])
        if buf.numel():
            mv = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(mv), CHUNK):
                got = f.readinto(mv[i:i + CHUNK])
                if got != len(mv[i:i + CHUNK]):
                    raise ValueError(f"checkpoint tensor {name}: the file ends early")
        if not direct:
            with torch.no_grad():
                dst.copy_(buf)
        done.add(name)
    return done


def _stream(fs, path: str, fill) -> dict[str, Any]:
    """Write ``path`` through ``fill(file)``, hashing as it goes: its size and sha256."""
    with fs.open(path, "wb") as f:
        out = _Hashing(f)
        fill(out)
    return out.digest()


def _file_digest(fs, path: str) -> dict[str, Any] | None:
    """Size and sha256 of ``path``, read in :data:`CHUNK` pieces; None when it is missing."""
    sha, n = hashlib.sha256(), 0
    try:
        with fs.open(path, "rb") as f:
            while piece := f.read(CHUNK):
                sha.update(piece)
                n += len(piece)
    except FileNotFoundError:
        return None
    return {"bytes": n, "sha256": sha.hexdigest()}


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
    trainer = {
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        **rng_state(_device(model)),
        "rng_by_rank": rng_by_rank or [],
        "state": state.__dict__,
    }
    files = {"model.safetensors": lambda f: write_safetensors(f, weights(model, host=False)),
             "trainer.pt": lambda f: torch.save(trainer, f)}
    if rows is not None:  # the per-row state (twice the table): streamed, and read back in place
        trainer["word_table"] = rows.hyper_parameters()
        files[ROWS_FILE] = lambda f: write_safetensors(f, rows.state_tensors())
    name = step_dir_name(state.step)
    target = f"{dir_path}/{name}"
    with preempt.saving():
        before = published(fs, dir_path)
        if fs.exists(target):  # an interrupted save of this step, or one a fallback left behind
            _op(fs.rm, target, recursive=True)
        _op(fs.makedirs, target, exist_ok=True)
        digests = {}
        for fname, fill in files.items():
            digests[fname] = _op(_stream, fs, f"{target}/{fname}", fill)
            if fname == FILES[0]:
                _pause_in_save()
        entry = {"step": state.step, "dir": name, "files": digests}
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


def _verified(fs, dir_path: str, entry: dict[str, Any]) -> bool:
    """Whether every file of a published checkpoint has the recorded size and sha256 (streamed, not held); a
    failure is logged."""
    for name in sorted(set(FILES) | set(entry["files"])):
        path = f"{dir_path}/{entry['dir']}/{name}"
        want = entry["files"].get(name)
        got = _file_digest(fs, path)
        if want is None or got != want:
            log.warning("checkpoint at step %d: %s is %s; falling back to the one before", entry["step"], path,
                        "missing" if got is None else "not the file that was published")
            return False
    return True


def newest_complete(fs, dir_path: str) -> dict[str, Any] | None:
    """The pointer entry of the newest published checkpoint whose files verify, or None.

    A checkpoint directory of the earlier layout (flat files and ``state.json``) is refused: ValueError."""
    entries = published(fs, dir_path)
    if not entries and fs.exists(f"{dir_path}/state.json"):
        raise ValueError(f"{dir_path} holds a checkpoint of lexiflow's earlier layout (model.safetensors, trainer.pt "
                         "and state.json side by side), which a kill during its save could have torn; it is not "
                         "resumed. Remove that directory to train this version from its start, or finish the run "
                         "with the lexiflow that wrote it")
    for entry in entries:
        if _verified(fs, dir_path, entry):
            return entry
    if entries:
        log.warning("no published checkpoint under %s is complete: training starts from step 0", dir_path)
    return None


NOT_VERIFIED = "verify"  # load_checkpoint's default entry: find and verify the newest complete checkpoint itself


def load_checkpoint(fs, dir_path: str, model, opt, sched, rank: int = 0, rows=None,
                    entry: dict[str, Any] | None | str = NOT_VERIFIED) -> TrainState | None:
    """The state of the newest complete checkpoint under ``dir_path`` (None when there is none), loaded into the
    model, optimizer and scheduler (and ``rows``, a sparsely trained word table's per-row state), with this rank's
    RNG state. ``entry``: that checkpoint's pointer entry as another process verified it (:func:`newest_complete`;
    None: there is none), so this one reads without hashing the files again."""
    found = newest_complete(fs, dir_path) if entry == NOT_VERIFIED else entry
    if found is None:
        return None
    where = f"{dir_path}/{found['dir']}"
    with fs.open(f"{where}/model.safetensors", "rb") as f:  # each tensor read into the model's own memory
        read_safetensors_into(f, dict(unwrap(model).state_dict(keep_vars=True)))
    # onto the host: the optimizer puts each state on its parameter's device (with no map_location, tensors saved
    # from cuda:0 would go back to cuda:0 on every rank, or fail on a machine without that GPU)
    with fs.open(f"{where}/trainer.pt", "rb") as f:
        ck = torch.load(f, weights_only=True, map_location="cpu")
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    if rows is not None:
        if "word_table" not in ck:
            raise ValueError(f"the checkpoint under {dir_path} has no word-table optimizer state (it was not saved by "
                             "a run with pretrain.model.word_table: sparse); remove that directory to start over")
        if ROWS_FILE in found["files"]:
            with fs.open(f"{where}/{ROWS_FILE}", "rb") as f:  # straight into the optimizer's own tensors
                read_safetensors_into(f, rows.state_tensors())
        else:  # a checkpoint written before the rows had a file of their own
            rows.load_state_dict(ck["word_table"])
    _restore_rng(ck["rng_by_rank"][rank] if ck.get("rng_by_rank") else ck, _device(model))
    return TrainState(**ck["state"])


def latest_state(fs, dir_path: str) -> TrainState | None:
    """The :class:`TrainState` of the newest complete checkpoint under ``dir_path`` (None when there is none), read
    without a model (to see where a run would resume)."""
    found = newest_complete(fs, dir_path)
    if found is None:
        return None
    with fs.open(f"{dir_path}/{found['dir']}/trainer.pt", "rb") as f:
        return TrainState(**torch.load(f, weights_only=True, map_location="cpu")["state"])


def unwrap(model):
    """The plain module under a DDP and/or torch.compile wrapper."""
    return getattr(model, "module", getattr(model, "_orig_mod", model))


def weights(model, host: bool = True) -> dict[str, torch.Tensor]:
    """Contiguous tensors (on the host; ``host`` False: where they are, for a writer that moves one at a time);
    tied weights stored once (safetensors refuses shared storage)."""
    sd = unwrap(model).state_dict()
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu() if host else v.detach()
    return out
