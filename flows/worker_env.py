"""The deployments' install pull step: lexiflow's dependencies for the run's Python, installed once per worker.

prefect.yaml's pull steps clone the repository, change into the checkout, then call :func:`install` by path
(``flows/worker_env.py:install``: the step loads this file before lexiflow is importable, so it imports only the
standard library). The run's own code is the checkout (first on ``sys.path``); what the step installs is only the
dependencies named in the checkout's ``pyproject.toml`` (plus ``extras``), pinned by its ``constraints.txt``, into
``<root>/<key>`` where the key hashes those two files, the extras and the Python version. Runs of many commits share
one such directory, and a dependency change gets a new one.

Two runs on one worker never race an install: the first takes an exclusive lock on ``<root>/<key>.lock``
(``fcntl.flock``, released if its process dies), installs into a private ``<key>.tmp-<pid>`` directory and renames it
to ``<key>`` (one atomic step) before it releases the lock; a second run blocks on the lock, then finds ``<key>``
complete and installs nothing. A finished directory is never written again, so a run reading it is never disturbed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

DEFAULT_ROOT = "~/.cache/lexiflow/envs"  # LEXIFLOW_ENVS overrides it


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The dependencies ``pyproject`` names for lexiflow and its ``extras`` (lexiflow itself not included)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise ValueError(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


def env_key(checkout: Path, extras: list[str]) -> str:
    """What decides the installed packages: pyproject.toml, constraints.txt, the extras, this Python."""
    h = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        h.update((checkout / name).read_bytes() + b"\0")
    h.update(",".join(sorted(extras)).encode() + b"\0" + sys.version.encode())
    return h.hexdigest()[:16]


def install(directory: str = ".", extras: str = "", root: str | None = None) -> dict[str, str]:
    """Make lexiflow's dependencies importable in this run: install them once into ``<root>/<key>`` (``root``:
    ``$LEXIFLOW_ENVS`` or ``~/.cache/lexiflow/envs``; ``extras``: comma-separated, e.g. ``sample``) under a lock,
    then add that directory and the checkout ``directory`` to ``sys.path`` and to ``PYTHONPATH`` (for processes
    the run starts: torchrun ranks, Dask workers). Returns ``{"python_env": <the directory>}``."""
    checkout = Path(directory).resolve()
    wanted = [e.strip() for e in extras.split(",") if e.strip()]
    base = Path(os.path.expanduser(root or os.environ.get("LEXIFLOW_ENVS") or DEFAULT_ROOT))
    base.mkdir(parents=True, exist_ok=True)
    target = base / env_key(checkout, wanted)
    with open(base / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer per key; released when this process exits, however
        if not target.is_dir():
            tmp = base / f"{target.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            reqs = base / f"{target.name}.tmp-{os.getpid()}.txt"
            reqs.write_text("\n".join(requirements(checkout / "pyproject.toml", wanted)) + "\n", encoding="utf-8")
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target",
                   str(tmp), "-c", str(checkout / "constraints.txt"), "-r", str(reqs)]
            print(f"installing lexiflow's dependencies into {target}", flush=True)
            try:
                subprocess.run(cmd, check=True)
                os.rename(tmp, target)  # atomic: a reader sees no directory or the whole one
            finally:
                reqs.unlink(missing_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
    site.addsitedir(str(target))  # after the worker's own packages: its Prefect stays the one in use
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    paths = [str(checkout), str(target), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return {"python_env": str(target)}
