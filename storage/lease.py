"""Owner records for staging directories: who is writing a version, and whether that writer is still alive.

A run that builds ``{store}/{stage}/{version}/`` first takes a *lease*: it creates ``_owner.json`` in that
directory (exclusively where the filesystem can: ``O_EXCL`` on local disks; elsewhere write, wait, read back)
and keeps its ``heartbeat`` fresh from a background thread until it commits or fails. Another run that wants
the same version waits while the owner is live and then adopts the committed artifact; clean-up removes only
staging whose owner is gone or stale.

*Gone or stale.* On the owner's own host the record names its process: the pid and that process's start time
(``/proc/<pid>/stat`` where there is one, else ``psutil`` where it is installed). The owner is live exactly while a
process with that pid and that start time exists, however late its heartbeat: a writer paused by a laptop's
suspend, a SIGSTOP or a long pause keeps its staging; a pid reused by another process does not pin it. Seen from
another host, or where the start time cannot be read, the owner is live while its process is not known to be dead
and its heartbeat is younger than ``stale_after_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import psutil

from storage.digests import protocols

OWNER = "_owner.json"
log = logging.getLogger("lexiflow")


@dataclass(frozen=True)
class LeaseSettings:
    """How often an owner proves it is alive, when silence means dead, how often a waiter looks again."""

    heartbeat_s: float = 15.0
    stale_after_s: float = 120.0
    poll_s: float = 2.0
    settle_s: float = 1.0  # object stores: how long to wait before reading back a written owner record


class LeaseLost(RuntimeError):
    """Another run took over this staging directory (our owner record is gone or replaced)."""


def run_identity(owner: str | None = None) -> str:
    """What an owner record names as its run: ``owner`` when the caller's runtime gives one (``flow-run-<id>``
    inside a flow run), else ``pid-<pid>``."""
    return owner if owner else f"pid-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    if pid <= 0:  # 0 and negatives address process groups, never one writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque string comparable on this host (None: no such process, or no way
    to tell here). Linux: ``proc:`` + field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); elsewhere
    ``psutil:`` + ``psutil.Process(pid).create_time()``."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # the command name (field 2) is in parentheses and may hold spaces or ')': split after the last one
        fields = stat[stat.rindex(")") + 2:].split()
        return f"proc:{fields[19]}"  # fields[0] is field 3 (state), so field 22 is fields[19]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):  # a /proc that lacks this pid: the process does not exist
            return None
    except (OSError, ValueError, IndexError):
        pass  # /proc unreadable or in another format here: ask psutil below
    try:
        return f"psutil:{psutil.Process(int(pid)).create_time():.6f}"
    except (psutil.Error, OSError, ValueError):
        return None


def _same_process(recorded: str, pid: int) -> bool | None:
    """Whether ``pid`` is still the process whose start time was recorded (None: cannot tell here)."""
    now = process_start(pid)
    if now is None:
        return None if pid_alive(pid) else False
    if now.split(":", 1)[0] != recorded.split(":", 1)[0]:  # recorded another way (another lexiflow, psutil)
        return None
    return now == recorded


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A small JSON record read fresh (no cached listing), or None when the file does not exist."""
    fs.invalidate_cache(path)
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def read_owner(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, Any] | None:
    """The owner record of a staging directory, or None (none written, or unreadable half-written JSON)."""
    try:
        record = read_json(fs, posixpath.join(directory, OWNER))
    except (json.JSONDecodeError, UnicodeDecodeError):  # a torn write by a dead writer: treat as no owner
        return None
    except (NotADirectoryError, IsADirectoryError):  # ``directory`` is a file (foreign), or the record is a dir
        return None
    return record if isinstance(record, dict) else None


def owner_live(owner: dict[str, Any] | None, settings: LeaseSettings, now: float | None = None) -> bool:
    """Live (see the module doc): on this host, while the recorded process (pid and start time) exists, however
    late its heartbeat; elsewhere, or where the start time cannot be told, while the heartbeat is fresh (and,
    on this host, the pid exists)."""
    if not owner or owner.get("released"):  # released: its run gave the directory up (a failure)
        return False
    try:
        pid = int(owner.get("pid", -1))
        heartbeat = float(owner.get("heartbeat", 0))
    except (TypeError, ValueError):  # not a record lexiflow wrote whole
        return False
    local = owner.get("host") == socket.gethostname()
    if local:
        if not pid_alive(pid):
            return False
        recorded = owner.get("started_proc")
        same = _same_process(recorded, pid) if isinstance(recorded, str) else None
        if same is not None:
            return same
    age = (time.time() if now is None else now) - heartbeat
    return age <= settings.stale_after_s


def describe(owner: dict[str, Any]) -> str:
    """An owner record in a few words: its run, pid and host."""
    return f"{owner.get('run')} (pid {owner.get('pid')} on {owner.get('host')})"


class Lease:
    """This run's ownership of one staging directory; a context manager that releases it."""

    def __init__(self, fs: fsspec.AbstractFileSystem, directory: str, settings: LeaseSettings,
                 owner: str | None = None):
        self.fs, self.directory, self.settings = fs, directory.rstrip("/"), settings
        self.path = posixpath.join(self.directory, OWNER)
        self.token = uuid.uuid4().hex
        self.record = {
            "run": run_identity(owner),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_proc": process_start(os.getpid()),
            "token": self.token,
            "started": time.time(),
            "heartbeat": time.time(),
        }
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- taking it
    def try_take(self) -> bool:
        """Create the owner record if there is none; True when this run now owns the directory."""
        if _is_local(self.fs):
            os.makedirs(self.directory, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
            return True
        if read_owner(self.fs, self.directory) is not None:
            return False
        self._write()
        if "memory" not in protocols(self.fs):  # one process, one dict: nothing to settle
            time.sleep(self.settings.settle_s)  # last writer wins; read back to see who that was
        return self.holds()

    def holds(self) -> bool:
        """Whether the owner record on the store is still this lease's (not replaced, not released)."""
        owner = read_owner(self.fs, self.directory)
        return bool(owner) and owner.get("token") == self.token and not owner.get("released")

    def _write(self) -> None:
        self.record["heartbeat"] = time.time()
        data = json.dumps(self.record).encode()
        if _is_local(self.fs):  # atomic replace, so a reader never sees half a record
            tmp = f"{self.path}.tmp-{self.token[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        else:
            with self.fs.open(self.path, "wb") as f:  # an object appears whole
                f.write(data)

    # ---------------------------------------------------------------- keeping it
    def start(self) -> "Lease":
        """Start the heartbeat thread that keeps the owner record fresh; returns the lease."""
        self._thread = threading.Thread(target=self._beat, name=f"lease-{posixpath.basename(self.directory)}",
                                        daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                if not self.holds():
                    self.lost = True
                    log.error("lost the lease on %s: another run took it over", self.directory)
                    return
                self._write()
            except OSError as e:  # a transient store error: the next beat tries again
                log.warning("heartbeat on %s failed: %s", self.directory, e)

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this run still owns the directory (called before committing)."""
        if self.lost or not self.holds():
            self.lost = True
            raise LeaseLost(f"{self.directory}: another run took over this staging directory; retry to adopt it")

    def release(self, committed: bool = False) -> None:
        """Stop the heartbeat and give the directory up. ``committed``: the manifest is written, so the owner
        record goes; otherwise it stays, marked ``released``, so the directory remains lexiflow's staging (a dead
        owner's: the next run or ``gc`` removes it) rather than an owner-less directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.holds():
            if committed:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.path)
            else:
                self.record["released"] = True
                with contextlib.suppress(OSError):
                    self._write()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()



def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return bool({"file", "local"} & protocols(fs))
