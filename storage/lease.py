"""Owner records for staging directories: who is writing a version, and whether that writer is still alive.

A run that builds ``{store}/{stage}/{version}/`` first takes a *lease*: it creates ``_owner.json`` in that
directory (exclusively where the filesystem can: ``O_EXCL`` on local disks; elsewhere write, wait, read back)
and keeps its ``heartbeat`` fresh from a background thread until it commits or fails. Another run that wants
the same version waits while the owner is live and then adopts the committed artifact; clean-up removes only
staging whose owner is gone (same host: the process is dead) or stale (no heartbeat for ``stale_after_s``).
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


def run_identity() -> str:
    """The Prefect flow run id when inside one, else ``pid-<pid>``."""
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx is not None and ctx.flow_run is not None:
            return f"flow-run-{ctx.flow_run.id}"
    except ImportError:  # prefect is a dependency; this only guards import-light tools
        pass
    return f"pid-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


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
        return read_json(fs, posixpath.join(directory, OWNER))
    except json.JSONDecodeError:  # a torn write by a dead writer: treat as no owner
        return None


def owner_live(owner: dict[str, Any] | None, settings: LeaseSettings, now: float | None = None) -> bool:
    """Live: the heartbeat is fresh and, on this host, the owning process still exists."""
    if not owner:
        return False
    age = (time.time() if now is None else now) - float(owner.get("heartbeat", 0))
    if age > settings.stale_after_s:
        return False
    if owner.get("host") == socket.gethostname():
        return pid_alive(int(owner.get("pid", -1)))
    return True


def describe(owner: dict[str, Any]) -> str:
    return f"{owner.get('run')} (pid {owner.get('pid')} on {owner.get('host')})"


class Lease:
    """This run's ownership of one staging directory; a context manager that releases it."""

    def __init__(self, fs: fsspec.AbstractFileSystem, directory: str, settings: LeaseSettings):
        self.fs, self.directory, self.settings = fs, directory.rstrip("/"), settings
        self.path = posixpath.join(self.directory, OWNER)
        self.token = uuid.uuid4().hex
        self.record = {
            "run": run_identity(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
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
        if "memory" not in _protocols(self.fs):  # one process, one dict: nothing to settle
            time.sleep(self.settings.settle_s)  # last writer wins; read back to see who that was
        return self.holds()

    def holds(self) -> bool:
        owner = read_owner(self.fs, self.directory)
        return bool(owner) and owner.get("token") == self.token

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

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.holds():
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    p = fs.protocol
    return set((p,) if isinstance(p, str) else p)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return bool({"file", "local"} & _protocols(fs))
