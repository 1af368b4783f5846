"""What a training loop shows while it runs, without reading the device on a step that does not log.

:class:`Window` keeps the running sums between two log rows on the device (float64, added in step order, so the
row's figures are the bits the per-step ``float()`` reads gave) and reads them once, at the log row.

Throughput two ways, both over real (non-padding) tokens and FLOPs counted at each batch's real length:
``tokens_per_s``/``mfu`` over the time spent in steps (compute only: on CUDA the device time between CUDA events
recorded around each step, read at the log row; on CPU the host time of the steps), and ``wall_tokens_per_s``/
``wall_mfu`` over the window's wall time (data wait, evaluation and checkpoint saves included).
:class:`ProgressLog` turns each log row into one INFO line of the ``lexiflow.progress`` logger, logs what the stage
does before its first step (with times), and a heartbeat line whenever ``heartbeat_s`` pass without a line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from tasks.common.ui import StderrUnlessRoot, stderr_handler

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
        self.flops = 0.0  # training FLOPs of the window's real tokens, each batch at its real length
        self.wall = 0.0  # wall seconds of the window before this process took it over (a resumed window)
        self.opened = time.monotonic()
        self.events: list[tuple[Any, Any]] = []  # CUDA (start, end) events of the window's steps, read at the row
        self.event_s: float | None = None  # device seconds of the events read so far (None: host time counts)
        self.carried = 0.0  # compute seconds a resumed window had before
        self.sums: torch.Tensor | None = None  # float64 [5] on the device

    def add(self, out, masked: int, pairs: int, tokens: int, dt: float, gnorm: torch.Tensor | None,
            wait: float = 0.0, flops: float = 0.0, events: tuple[Any, Any] | None = None) -> None:
        """One step: its outputs (device tensors), the host counts of its batch (real masked positions, pairs,
        real tokens), its host time, its wait for data, its FLOPs and (CUDA) the events recorded around it."""
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
        self.flops += flops
        if events is not None:
            self.events.append(events)

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
                "time": self.compute_s(), "wait": self.wait, "flops": self.flops, "wall": self.wall_s(),
                "sums": self.sums.tolist() if self.sums is not None else None}

    def restore(self, saved: dict[str, Any] | None, device: torch.device) -> None:
        """Continue the window a checkpoint saved (:meth:`state`), on ``device``."""
        if not saved:
            return
        self.n, self.masked, self.pairs, self.tokens = saved["n"], saved["masked"], saved["pairs"], saved["tokens"]
        self.time, self.wait = saved.get("time", 0.0), saved.get("wait", 0.0)  # measured: the tokens/s figure only
        self.flops, self.wall, self.carried = saved.get("flops", 0.0), saved.get("wall", 0.0), self.time
        if saved["sums"] is not None:
            self.sums = torch.tensor(saved["sums"], dtype=torch.float64, device=device)

    def read(self) -> dict[str, float]:
        """The device sums as Python floats: the one device read of a window (it waits for the device, and that
        wait is counted as compute time when no CUDA events time the steps)."""
        t = time.perf_counter()
        values = self.sums.tolist() if self.sums is not None else [0.0] * len(self.KEYS)
        self.time += time.perf_counter() - t
        return dict(zip(self.KEYS, values))

    def compute_s(self) -> float:
        """Seconds spent in the window's steps: the device time between each step's CUDA events when they were
        recorded (read here, at a log row or a checkpoint, where the device is waited for anyway), else the host
        time."""
        if self.events:
            self.events[-1][1].synchronize()
            self.event_s = (self.event_s or 0.0) + sum(a.elapsed_time(b) for a, b in self.events) / 1000
            self.events = []
        return self.time if self.event_s is None else self.carried + self.event_s

    def wall_s(self) -> float:
        """Wall seconds since the window opened (with what a resumed window had before)."""
        return self.wall + time.monotonic() - self.opened

    def flush(self, step: int, epoch: int, lr: float, flops_tok: float | None, peak: float | None
              ) -> dict[str, Any]:
        """The log row of this window (one device read), then a new window. ``flops_tok`` counts the FLOPs when
        the steps gave none (per real token, at one length)."""
        s = self.read()
        n = max(self.n, 1)
        compute, wall = self.compute_s(), self.wall_s()
        flops = self.flops or (self.tokens * flops_tok if flops_tok else 0.0)
        tps = self.tokens / compute if compute else 0.0
        wall_tps = self.tokens / wall if wall else 0.0
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
            "mfu": (flops / compute / peak) if (peak and flops and compute) else None,
            "data_wait": self.wait / (self.wait + compute) if (self.wait + compute) else 0.0,
            "wall_tokens_per_s": wall_tps,
            "wall_mfu": (flops / wall / peak) if (peak and flops and wall) else None,
        }
        done = {"tokens": self.tokens, "flops": flops, "compute_s": compute}
        self.reset()
        self.last = done  # what the row counted, for the stage's totals
        return row


def to_stderr() -> None:
    """Progress lines on stderr in a process that nothing else configured (a torchrun rank, a benchmark): once,
    and not where a root handler writes there already (:class:`tasks.common.ui.StderrUnlessRoot`, decided at each
    line: Prefect may set up its console handler later)."""
    log.setLevel(logging.INFO)
    if not any(isinstance(h, StderrUnlessRoot) for h in log.handlers):
        log.addHandler(stderr_handler())


def _duration(s: float) -> str:
    s = max(int(round(s)), 0)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def progress_line(name: str, row: dict[str, Any], total: int, eta_s: float | None,
                  gpu_mem_gib: float | None = None) -> str:
    """One log row as one line: step/total, losses, held-out accuracy when measured, tokens/s and MFU (compute only,
    then over the wall time), data wait, GPU memory (CUDA), ETA."""
    parts = [f"{name} step {row['step']}/{total}",
             f"loss {row['loss']:.4f} (mlm {row['mlm_loss']:.4f}, nsp {row['nsp_loss']:.4f})",
             f"mlm acc {row['mlm_acc']:.3f}"]
    if row.get("heldout_mlm_acc") is not None:
        parts.append(f"held-out acc {row['heldout_mlm_acc']:.3f}")
    tok_s = f"{row.get('tokens_per_s') or 0:,.0f} tok/s"
    if row.get("wall_tokens_per_s") is not None:  # compute only, then over the wall time (waits, evaluation, saves)
        tok_s += f" (wall {row['wall_tokens_per_s']:,.0f})"
    parts.append(tok_s)
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}" + (f" (wall {row['wall_mfu']:.1%})" if row.get("wall_mfu") is not None
                                                 else ""))
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
