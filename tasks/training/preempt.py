"""Stopping a training stage on SIGTERM or SIGINT (a spot machine's notice, ``timeout``, Ctrl-C) within 15 s, in any
phase, without losing or tearing a checkpoint.

:class:`StopSignal` catches the signals while a stage runs (:func:`stoppable` wraps a stage's body in one) and only
raises a flag. The stage looks at the flag where it can stop cleanly: after each optimizer step
(:meth:`StopSignal.after_step`: under DDP every rank stops after the same step, agreed every few steps, as many as
take about :data:`AGREE_S`, so an ordinary step makes no host collective), then writes a checkpoint there unless
the last saves say it could not publish in time (:meth:`StopSignal.save_fits`); between
held-out evaluation batches; between rows while reading and packing data (:func:`poll`); between the files of the
artifact. It then raises :class:`Preempted` with one line that says where it stopped and how to go on.

Where the code cannot look at the flag (compiling, one long kernel, a blocked read, a collective whose peer is gone),
a watchdog thread ends the process. It learns of each signal at once, even while the main thread is inside C code
(``signal.set_wakeup_fd``), and :data:`GRACE_S` after the first signal, or at a second one, logs the same kind of line
and exits with 128 + the signal's number. Never in the middle of a checkpoint save (:func:`saving`): the exit waits for
the save to publish, up to :data:`SAVE_WAIT_S` after the first signal; past that the save is abandoned, which is safe
(a checkpoint that is not published is never read: :mod:`tasks.training.checkpoint`). Before that exit, the hooks
registered with :func:`on_hard_exit` run, for at most :data:`HOOK_WAIT_S` together: the Prefect layer reports its
flow and task runs as crashed there (an exception would have told Prefect; a hard exit tells nobody).
Outside the main thread (where handlers cannot be installed) the flag never rises and the default actions apply.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tasks.training import collectives

log = logging.getLogger("lexiflow")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# within 15 s of the notice: the ranks, then torchrun, the launcher and Prefect's crash report take a few seconds
GRACE_S = 6.0  # after the first signal, a stage that has not stopped by itself is ended
SAVE_WAIT_S = 11.0  # ... but a checkpoint save in flight may publish until this long after the first signal
AGREE_S = 1.5  # under DDP the ranks agree on the stop flag after about this much training (whole steps)
MAX_AGREE_EVERY = 1000  # ... and at least every this many steps
SAVE_MARGIN_S = 1.0  # a save on a stop starts only when its expected time ends this long before SAVE_WAIT_S
HOOK_WAIT_S = 2.5  # the hard exit's hooks (a report to the Prefect API) get this long, then the process ends anyway
# where a stopped stage's one line also goes (the torchrun launcher reads rank 0's from there)
LINE_FILE_ENV = "LEXIFLOW_STOP_LINE_FILE"

_active: list["StopSignal"] = []
_exit_hooks: list[Callable[[str], None]] = []


class Preempted(SystemExit):
    """A training stage stopped on a signal: exits the process with 128 + the signal's number. ``line`` says
    where it stopped and how to resume (already logged)."""

    def __init__(self, line: str, signum: int):
        super().__init__(128 + signum)
        self.line, self.signum = line, signum


class StopSignal:
    """Context manager: SIGTERM/SIGINT set :attr:`signum` instead of ending the process (handlers restored on exit);
    a watchdog ends the process when the stage does not stop by itself in time.

    The stage keeps it informed: :attr:`phase` (what it does now, for the line), :attr:`checkpointing` (whether it
    writes checkpoints) and :attr:`checkpoint_step` (the step of the last published one: what a rerun resumes
    from), :attr:`say` (this process logs the line: rank 0 of a DDP run)."""

    def __init__(self, stage: str = "training"):
        self.stage = stage
        self.signum: int | None = None
        self.phase = "starting"
        self.checkpointing = False
        self.checkpoint_step: int | None = None
        self.say = collectives.rank_world()[0] == 0
        self._previous: dict[int, Any] = {}
        self._saving = 0
        self._handled = False
        self.count = 0  # signals seen (by the watchdog)
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._wakeup = -1
        self._watchdog: threading.Thread | None = None
        self.since: float | None = None  # monotonic time this process learned of the stop
        self.every = 1  # under DDP: steps between two agreements on the flag (agreed by the ranks)
        self._steps = 0  # steps since the last agreement
        self._mark: float | None = None  # monotonic time of the last agreement

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._pipe = (r, w)
            self._wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._watchdog = threading.Thread(target=self._watch, name="lexiflow-stop-watchdog", daemon=True)
            self._watchdog.start()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _active:
            _active.remove(self)
        self._done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._wakeup)
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")  # wakes the watchdog, which sees _done and returns
            self._watchdog.join(timeout=5)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = self._watchdog = None
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self._handled:
            return  # a second signal: the watchdog ends the process (once no checkpoint save is in flight)
        self._handled = True
        self.signum = self.signum or signum  # the watchdog may have seen it first
        self.since = self.since or time.monotonic()
        if self.say:
                log.warning("%s received: %s stops at the next safe point", signal.Signals(signum).name, self.stage)

    @property
    def name(self) -> str:
        """The signal's name (``SIGTERM``), empty before one arrived."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def agreed(self, world: int) -> bool:
        """Whether to stop now. Under DDP, the ranks' flags are OR-ed (over the gloo control group: no device read),
        so every rank stops at the same point even when the signal reached them at different times."""
        if world == 1:
            return self.signum is not None
        got = collectives.max_int(self.signum or 0)
        self._learn(got)
        return bool(got)

    def _learn(self, got: int) -> None:
        if got and self.signum is None:
            self.signum, self.since = got, time.monotonic()

    def after_step(self, world: int) -> bool:
        """Whether to stop after the optimizer step just taken. One process: the flag. Under DDP the ranks agree
        only every :attr:`every` steps (the other steps: False, no collective): one control-plane all-reduce carries
        the flag and each rank's proposal for the next interval, as many steps as its measured step time fits in
        :data:`AGREE_S` (the smallest proposal wins), so a stop lands within about that long of the signal while
        an ordinary step talks to no one. Every rank counts the same steps, so they agree at the same ones."""
        if world == 1:
            return self.signum is not None
        now = time.monotonic()
        self._steps += 1
        if self._mark is not None and self._steps < self.every:
            return False
        step_s = (now - self._mark) / self._steps if self._mark is not None else None
        # the first agreement comes after the first step (its time is a compilation's): the next one step later
        propose = 1 if step_s is None else max(1, min(MAX_AGREE_EVERY, int(AGREE_S / max(step_s, 1e-6))))
        got, neg = collectives.max_ints([self.signum or 0, -propose])
        self._learn(got)
        self.every, self._steps, self._mark = -neg, 0, time.monotonic()
        return bool(got)

    def save_fits(self, expected_s: float | None) -> bool:
        """Whether a checkpoint save expected to take ``expected_s`` (the last save's time; None: not measured yet,
        then it is tried) can publish before the watchdog's :data:`SAVE_WAIT_S` after the stop, with
        :data:`SAVE_MARGIN_S` to spare. Always True when no stop is under way."""
        if self.signum is None or expected_s is None or self.since is None:
            return True
        return time.monotonic() - self.since + expected_s + SAVE_MARGIN_S <= SAVE_WAIT_S

    def preempted(self, where: str, written: bool = False) -> Preempted:
        """The :class:`Preempted` to raise for a stop ``where`` (``at step 5/24``, ``while packing ...``), logged once;
        ``written``: a checkpoint of this very point was just published."""
        at = None if written else self.checkpoint_step
        return stopped(self.stage, self.signum or signal.SIGTERM, where + ("; checkpoint written" if written else ""),
                       resume=self.checkpointing and (written or at is not None), say=self.say, at_step=at)

    def check(self) -> None:
        """Raise :class:`Preempted` when a signal arrived (a point between two units of work)."""
        if self.signum is not None:
            raise self.preempted(f"while {self.phase}")

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint save that should publish before the process ends (the watchdog waits for it)."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1

    def _watch(self) -> None:
        """The watchdog: reads the signal numbers that the C-level handler writes to the wakeup pipe."""
        first_at: float | None = None
        while True:
            timeout = None if first_at is None else max(0.0, first_at + GRACE_S - time.monotonic())
            ready, _, _ = select.select([self._pipe[0]], [], [], timeout)
            if self._done.is_set():
                return
            if ready:
                for b in os.read(self._pipe[0], 512):
                    if b in SIGNALS:
                        self.count += 1
                        if first_at is None:
                            first_at = time.monotonic()
                            self.signum = self.signum or b
                            self.since = self.since or first_at
                if self.count < 2:
                    continue  # the first signal: the stage has GRACE_S to stop by itself
            self._end(first_at)
            return

    def _end(self, first_at: float) -> None:
        """Wait for a save in flight to publish (and the stage to stop on its own after it), then end the process."""
        while self._saving and time.monotonic() < first_at + SAVE_WAIT_S and not self._done.is_set():
            time.sleep(0.02)
        if self._done.wait(timeout=max(0.0, min(0.5, first_at + SAVE_WAIT_S - time.monotonic()))):
            return  # the stage stopped by itself meanwhile
        where = f"while {self.phase}" + ("; its checkpoint save was abandoned" if self._saving else "")
        line = stopped_line(self.stage, self.signum, where, self.checkpointing and self.checkpoint_step is not None,
                            self.checkpoint_step)
        _run_exit_hooks(line)
        if self.say:
            with contextlib.suppress(OSError):
                os.write(2, f"{line}\n".encode())  # not through logging: the main thread may hold its lock
            _line_file(line)
        _end_children()
        os._exit(128 + self.signum)


@contextlib.contextmanager
def on_hard_exit(hook: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, ``hook(line)`` is called when a watchdog ends this process (``line``: the stop line).
    It runs on the watchdog's thread while the main thread may be stuck anywhere: it must not need the main
    thread's locks (logging included). Hooks run in turn, :data:`HOOK_WAIT_S` for all of them."""
    _exit_hooks.append(hook)
    try:
        yield
    finally:
        _exit_hooks.remove(hook)


def _run_exit_hooks(line: str) -> None:
    """Run the :func:`on_hard_exit` hooks on a thread of their own, waiting at most :data:`HOOK_WAIT_S`; a hook that
    fails or hangs costs its report, never the exit (its error goes to stderr, not through logging)."""
    hooks = list(_exit_hooks)
    if not hooks:
        return

    def run() -> None:
        for hook in hooks:
            try:
                hook(line)
            except Exception as e:  # the process ends either way: say what the report could not do
                with contextlib.suppress(OSError):
                    os.write(2, f"lexiflow: could not report the stop ({type(e).__name__}: {e})\n".encode())

    t = threading.Thread(target=run, name="lexiflow-exit-hooks", daemon=True)
    t.start()
    t.join(HOOK_WAIT_S)


def _end_children() -> None:
    """SIGTERM to this process's children (a temporary Prefect server, loader workers): a hard exit skips the exit
    handlers that would have stopped them."""
    with contextlib.suppress(Exception):
        import psutil  # noqa: PLC0415  (only on a hard exit)

        for child in psutil.Process().children():
            child.terminate()


def active() -> StopSignal | None:
    """The innermost :class:`StopSignal` in effect in this process, or None."""
    return _active[-1] if _active else None


def poll() -> None:
    """Between two units of long work (rows read, pairs packed, batches scored): raise :class:`Preempted` when a
    stop signal arrived. A no-op where no :class:`StopSignal` is in effect (e.g. labelling)."""
    if _active and _active[-1].signum is not None:
        _active[-1].check()


def set_phase(what: str) -> None:
    """Name what the stage does now (the stop line says ``while <what>``); first a stop that came before it."""
    if _active:
        poll()
        _active[-1].phase = what


def saving() -> contextlib.AbstractContextManager:
    """:meth:`StopSignal.saving` of the active signal (a no-op context without one)."""
    return _active[-1].saving() if _active else contextlib.nullcontext()


def published(step: int) -> None:
    """A checkpoint of ``step`` was published: a stop from now on resumes from it."""
    if _active:
        _active[-1].checkpoint_step = step


@contextlib.contextmanager
def stop_scope(stage: str) -> Iterator[StopSignal]:
    """The :class:`StopSignal` in effect, or a new one for ``stage`` while the block runs."""
    if _active:
        yield _active[-1]
        return
    with StopSignal(stage) as stop:
        yield stop


def stoppable(stage: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a training stage's body: it runs under a :class:`StopSignal` (unless one is in effect), so a
    signal in any of its phases stops it; a signal that came after its last poll stops it when it returns."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _active:
                return fn(*args, **kwargs)
            with StopSignal(stage) as stop:
                out = fn(*args, **kwargs)
                if stop.signum is not None:
                    raise stop.preempted("after its last step, before the artifact was committed")
                return out
        return run
    return wrap


def stopped_line(stage: str, signum: int, where: str, resume: bool, at_step: int | None = None) -> str:
    """The one line of a stop: what stopped, on which signal, where, and how to go on."""
    name = signal.Signals(signum).name
    if resume and at_step is not None:
        how = f"run the same command again to resume from the checkpoint at step {at_step}"
    elif resume:
        how = "run the same command again to resume from this checkpoint"
    else:
        how = "run the same command again to run the stage again"
    return f"{stage} stopped by {name} {where}; {how}"


def stopped(stage: str, signum: int, where: str, resume: bool, say: bool = True, at_step: int | None = None
            ) -> Preempted:
    """Log the one line (``say``: on one process of a run) and return the exception to raise."""
    line = stopped_line(stage, signum, where, resume, at_step)
    if say:
        log.warning("%s", line)
        _line_file(line)
    return Preempted(line, signum)


def _line_file(line: str) -> None:
    path = os.environ.get(LINE_FILE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            f.write(line)


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
