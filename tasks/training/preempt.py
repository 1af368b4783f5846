"""Stopping a training stage on SIGTERM or SIGINT (a spot machine's notice, ``timeout``, Ctrl-C) at a step boundary.

:class:`StopSignal` catches the signals while training runs and only sets a flag; the loop looks at it after each
step (:meth:`StopSignal.agreed`: under DDP every rank stops after the same step), saves what it can and raises
:class:`Preempted` with one line that says how to go on. A second signal while stopping takes its default action.
Outside the main thread (where handlers cannot be installed) the flag never rises and the default actions apply.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("lexiflow")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """A training stage stopped on a signal: exits the process with 128 + the signal's number. ``line`` says
    where it stopped and how to resume (already logged)."""

    def __init__(self, line: str, signum: int):
        super().__init__(128 + signum)
        self.line, self.signum = line, signum


class StopSignal:
    """Context manager: SIGTERM/SIGINT set :attr:`signum` instead of ending the process (handlers restored on exit)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._group = None

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # asked twice: stop waiting for the step
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning("%s received: stopping after the current step", signal.Signals(signum).name)

    @property
    def name(self) -> str:
        """The signal's name (``SIGTERM``), empty before one arrived."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def agreed(self, world: int) -> bool:
        """Whether to stop now. Under DDP, the ranks' flags are OR-ed (a CPU all-reduce over gloo, no device
        read), so every rank stops after the same step even when the signal reached them at different times."""
        if world == 1:
            return self.signum is not None
        if self._group is None:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        got = int(flag[0])
        if got and self.signum is None:
            self.signum = got
        return bool(got)


def stopped(stage: str, signum: int, where: str, resume: bool, say: bool = True) -> Preempted:
    """Log the one line (``say``: on one process of a run) and return the exception to raise."""
    name = signal.Signals(signum).name
    how = ("run the same command again to resume from this checkpoint" if resume
           else "run the same command again to run the stage again")
    line = f"{stage} stopped by {name} {where}; {how}"
    if say:
        log.warning("%s", line)
    return Preempted(line, signum)


@contextlib.contextmanager
def forward_signals(proc) -> Iterator[tuple[Any, list[int]]]:
    """While the block runs, SIGTERM/SIGINT to this process are passed on once to the child ``proc`` (torchrun,
    which passes them to its ranks) instead of ending this one; yields ``(proc, signals received)``."""
    got: list[int] = []

    def handle(signum: int, frame) -> None:
        if not got:
            proc.send_signal(signum)
        got.append(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield proc, got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
