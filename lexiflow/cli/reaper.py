"""Nothing a command starts outlives it, however it ends (``kill -9`` included): a watchdog process.

A command that starts processes (``run``, ``label``, ``ner-label``) marks its environment with
``LEXIFLOW_RUN_MARK`` before it starts any, so everything it starts, and everything those start, inherits the mark:
Prefect's temporary server, a local Dask cluster's nannies and workers, torchrun and its ranks, DataLoader workers.
It also starts this file as a small watchdog process in a session of its own (a Ctrl-C or a hang-up of the
terminal does not reach it): the watchdog polls the command's process (its pid and start time, a zombie counts as
gone) and, once it has ended, sends SIGTERM to every process that still carries the mark, SIGKILL to any left after
a grace period, and exits. A command that ends normally has stopped its children already; the watchdog then finds
none and exits.

Linux only (``/proc``); elsewhere nothing is started. The watchdog imports nothing but the standard library's
``os``, ``signal``, ``sys`` and ``time`` (it runs as ``python -I -S reaper.py``), so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MARK_ENV = "LEXIFLOW_RUN_MARK"
POLL_S = 0.2  # how often the watchdog looks at the command's process
GRACE_S = 5.0  # how long a marked process has after SIGTERM before SIGKILL

_watchdog = None  # the watchdog's Popen (kept: its __del__ must not run while the command runs)
_enabled = False  # only the console script (lexiflow.cli.main) enables it: an in-process call starts no watchdog


def enable() -> None:
    """Let :func:`start` start the watchdog: called by ``lexiflow.cli.main``, the process that is the command. A
    command invoked inside another program (a test's CliRunner, a notebook) starts none: that process is not the
    command, and its other children are not the command's."""
    global _enabled
    _enabled = True


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from ``/proc/<pid>/stat``; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return fields[0], fields[19]


def alive(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie, or a reused pid, is gone)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in ("Z", "X")


def marked(mark: str, skip: tuple[int, ...] = ()) -> list[int]:
    """The pids whose environment carries ``mark`` in ``LEXIFLOW_RUN_MARK`` (a comma-separated list)."""
    want = mark.encode()
    prefix = MARK_ENV.encode() + b"="
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        for item in env.split(b"\0"):
            if item.startswith(prefix) and want in item[len(prefix):].split(b","):
                out.append(int(name))
                break
    return out


def reap(mark: str, grace_s: float = GRACE_S, skip: tuple[int, ...] = ()) -> list[int]:
    """SIGTERM to every process marked ``mark``, SIGKILL to those still there after ``grace_s``; the pids signalled."""
    pids = marked(mark, skip)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while (left := marked(mark, skip)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def start() -> None:
    """Mark this process's environment and start its watchdog (Linux; once per process; after :func:`enable`)."""
    global _watchdog
    if not _enabled or _watchdog is not None or not sys.platform.startswith("linux"):
        return
    import subprocess  # noqa: PLC0415  (the command's side only; the watchdog imports nothing it does not need)

    pid = os.getpid()
    st = _stat(pid)
    if st is None:
        return
    mark = f"{pid}-{st[1]}"
    inherited = os.environ.get(MARK_ENV)
    os.environ[MARK_ENV] = f"{inherited},{mark}" if inherited else mark
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}  # the watchdog itself carries no mark
    _watchdog = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(pid), st[1], mark],
                                 env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)


def watch(pid: int, start_time: str, mark: str) -> None:
    """The watchdog: wait for the command ``pid`` to end, then end what it left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while alive(pid, start_time):
        time.sleep(POLL_S)
    reap(mark, skip=(os.getpid(),))


if __name__ == "__main__":  # pragma: no cover  (the watchdog process: python -I -S reaper.py PID START MARK)
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])
