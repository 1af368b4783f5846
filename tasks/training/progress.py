"""What a training loop shows while it runs, without reading the device on a step that does not log.

:class:`Window` keeps the running sums between two log rows on the device (float64, added in step order, so the
row's figures are the bits the per-step ``float()`` reads gave) and reads them once, at the log row.
:class:`ProgressLog` turns each log row into one INFO line of the ``lexiflow.progress`` logger, logs what the stage
does before its first step (with times), and a heartbeat line whenever ``heartbeat_s`` pass without a line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import torch

log = logging.getLogger("lexiflow.progress")
HEARTBEAT_S = 30.0


class Window:
    """Running sums between two log rows. The model's outputs stay on the device: one 0-dim float64 tensor per
    sum, read once by :meth:`flush` (one device read, and on CUDA the window's one synchronisation)."""

    KEYS = ("mlm", "nsp", "correct", "nsp_correct", "gnorm")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.n = 0
        self.masked = self.pairs = self.tokens = 0
        self.time = self.wait = 0.0
        self.sums: torch.Tensor | None = None  # float64 [5] on the device

    def add(self, out, masked: int, pairs: int, tokens: int, dt: float, gnorm: torch.Tensor | None,
            wait: float = 0.0) -> None:
        """One step: its outputs (device tensors), the host counts of its batch (real masked positions, pairs,
        real tokens), its host time and its wait for data."""
        loss = out.mlm_loss.detach()
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        parts = (loss, out.nsp_loss.detach() if out.nsp_loss is not None else zero, out.mlm_correct,
                 out.nsp_correct if out.nsp_correct is not None else zero,  # None: NSP off (an imported checkpoint)
                 gnorm.detach() if gnorm is not None else zero)
        step = torch.stack([p.to(torch.float64) for p in parts])
        self.sums = step if self.sums is None else self.sums + step  # left to right: the order the floats had
        self.n += 1
        self.masked += masked
        self.pairs += pairs
        self.tokens += tokens
        self.time += dt  # host time of the step; the device's backlog is added at the flush
        self.wait += wait

    def snapshot(self) -> dict[str, Any]:
        """The window as it is (no device read): :meth:`load` puts it back, e.g. after a row that was not kept."""
        return dict(self.__dict__)

    def load(self, snapshot: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot`."""
        self.__dict__.update(snapshot)

    def state(self) -> dict[str, Any]:
        """The window so far as plain numbers (a checkpoint between two log rows carries it, so the resumed run's
        next row is the uninterrupted run's)."""
        return {"n": self.n, "masked": self.masked, "pairs": self.pairs, "tokens": self.tokens,
                "time": self.time, "wait": self.wait, "sums": self.sums.tolist() if self.sums is not None else None}

    def restore(self, saved: dict[str, Any] | None, device: torch.device) -> None:
        """Continue the window a checkpoint saved (:meth:`state`), on ``device``."""
        if not saved:
            return
        self.n, self.masked, self.pairs, self.tokens = saved["n"], saved["masked"], saved["pairs"], saved["tokens"]
        self.time, self.wait = saved.get("time", 0.0), saved.get("wait", 0.0)  # measured: the tokens/s figure only
        if saved["sums"] is not None:
            self.sums = torch.tensor(saved["sums"], dtype=torch.float64, device=device)

    def read(self) -> dict[str, float]:
        """The device sums as Python floats: the one device read of a window (it waits for the device, and that
        wait is counted as compute time)."""
        t = time.perf_counter()
        values = self.sums.tolist() if self.sums is not None else [0.0] * len(self.KEYS)
        self.time += time.perf_counter() - t
        return dict(zip(self.KEYS, values))

    def flush(self, step: int, epoch: int, lr: float, flops_tok: float | None, peak: float | None
              ) -> dict[str, Any]:
        """The log row of this window (one device read), then a new window."""
        s = self.read()
        n = max(self.n, 1)
        tps = self.tokens / self.time if self.time else 0.0
        row = {
            "step": step,
            "epoch": epoch,
            "loss": (s["mlm"] + s["nsp"]) / n,
            "mlm_loss": s["mlm"] / n,
            "nsp_loss": s["nsp"] / n,
            "mlm_acc": s["correct"] / max(self.masked, 1),
            "nsp_acc": s["nsp_correct"] / max(self.pairs, 1),
            "lr": lr,
            "grad_norm": s["gnorm"] / n,
            "tokens_per_s": tps,
            "mfu": (tps * flops_tok / peak) if (peak and flops_tok) else None,
            "data_wait": self.wait / (self.wait + self.time) if (self.wait + self.time) else 0.0,
        }
        self.reset()
        return row


def to_stderr() -> None:
    """Progress lines on stderr in a process that nothing else configured (a torchrun rank)."""
    log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


def _duration(s: float) -> str:
    s = max(int(round(s)), 0)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def progress_line(name: str, row: dict[str, Any], total: int, eta_s: float | None,
                  gpu_mem_gib: float | None = None) -> str:
    """One log row as one line: step/total, losses, held-out accuracy when measured, tokens/s, MFU, data wait,
    GPU memory (CUDA), ETA."""
    parts = [f"{name} step {row['step']}/{total}",
             f"loss {row['loss']:.4f} (mlm {row['mlm_loss']:.4f}, nsp {row['nsp_loss']:.4f})",
             f"mlm acc {row['mlm_acc']:.3f}"]
    if row.get("heldout_mlm_acc") is not None:
        parts.append(f"held-out acc {row['heldout_mlm_acc']:.3f}")
    parts.append(f"{row.get('tokens_per_s') or 0:,.0f} tok/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}")
    parts.append(f"data wait {row.get('data_wait') or 0:.0%}")
    if gpu_mem_gib is not None:
        parts.append(f"GPU mem {gpu_mem_gib:.1f} GiB")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return " | ".join(parts)


class ProgressLog:
    """INFO lines of a training stage: its phases before the first step (:meth:`phase`, :meth:`done`), one line
    per log row (:meth:`row`), and a heartbeat from a daemon thread when ``heartbeat_s`` pass without a line.
    ``enabled`` False (other DDP ranks) logs nothing. Use as a context manager (starts and stops the heartbeat)."""

    def __init__(self, name: str, total: int, start_step: int = 0, device: torch.device | None = None,
                 heartbeat_s: float = HEARTBEAT_S, enabled: bool = True):
        self.name, self.total, self.step, self.device = name, total, start_step, device
        self.heartbeat_s, self.enabled = heartbeat_s, enabled
        self.what = "starting"
        self._t_phase = self._t_row = self._last_line = time.monotonic()
        self._row_step = start_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ProgressLog":
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="lexiflow-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def info(self, msg: str, *args) -> None:
        """An INFO line on rank 0."""
        if self.enabled:
            self._last_line = time.monotonic()
            log.info(msg, *args)

    def phase(self, what: str) -> None:
        """A phase starts (e.g. "packing 1,234 rows"): logged now; :meth:`done` logs its time."""
        self.what, self._t_phase = what, time.monotonic()
        self.info("%s: %s ...", self.name, what)

    def done(self, result: str = "") -> float:
        """The current phase ended: one line with its time; returns the seconds it took."""
        took = time.monotonic() - self._t_phase
        self.info("%s: %s done in %.1f s%s", self.name, self.what, took, f" ({result})" if result else "")
        self.what = "training"
        return took

    def advance(self, step: int) -> None:
        """The step just finished (host counter only; read by the heartbeat)."""
        self.step = step

    def row(self, row: dict[str, Any]) -> None:
        """A log row as one INFO line, with the time per step since the last row."""
        now = time.monotonic()
        per_step = (now - self._t_row) / max(row["step"] - self._row_step, 1)
        self._t_row, self._row_step = now, row["step"]
        mem = None
        if self.device is not None and self.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.info("%s", progress_line(self.name, row, self.total, per_step * (self.total - row["step"]), mem))

    def _beat(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s, 1.0)):
            quiet = time.monotonic() - self._last_line
            if quiet >= self.heartbeat_s:
                self.info("%s: still %s at step %d/%d (%.1f s since the last line)", self.name, self.what, self.step,
                          self.total, quiet)
