"""Pinned against unpinned CPU kernels, in one bench run: the bench again in a child process under
``LEXIFLOW_NUMERICS=native`` (machine-default kernels), printing its rates as JSON on its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ARGS = ("--rates-json", "--no-numerics-ab")  # what the child is given: print the rates, no grandchild


def run_unpinned(script: str, argv: list[str]) -> dict[str, float]:
    """``script``'s rates (name -> per second) run with ``argv`` in a child whose CPU kernels are not pinned."""
    from models.numerics import PIN_ENV, PINS

    env = {k: v for k, v in os.environ.items() if k not in PINS}  # the parent's pins are in its environment
    env[PIN_ENV] = "native"
    out = subprocess.run([sys.executable, os.path.abspath(script), *argv, *ARGS], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ratio_line(pinned: dict[str, float], native: dict[str, float]) -> str:
    pairs = ", ".join(f"{k} {pinned[k] / native[k]:.2f}x" for k in pinned if k in native)
    return f"pinned CPU kernels (avx2) against unpinned (native), same bench, rate ratio: {pairs}"


def git_revision() -> str | None:
    """``git rev-parse --short HEAD`` of the checkout (``+dirty`` when tracked files differ), or None without git
    (a source tarball, no git binary)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + "+dirty" if dirty else rev) or None


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_relative(arg: str) -> str:
    """An absolute path inside the repository, or beside it (``../shared``), as seen from the repository root;
    anything else unchanged. A results file then names no machine's directories."""
    if not os.path.isabs(arg):
        return arg
    rel = os.path.relpath(arg, REPO)
    return rel if not rel.startswith(os.pardir + os.sep + os.pardir) else arg


def command_line() -> str:
    """The command that ran this bench, as a person would type it from the repository root (paths inside or
    beside the repository relative to it)."""
    import shlex

    script = repo_relative(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else "?"
    return shlex.join(["python", script, *map(repo_relative, sys.argv[1:])])


def write_results(path: str | None, bench: str, figures: dict) -> None:
    """Write a bench's measured figures (with the date, host CPU and the numerics record) as JSON to ``path``
    (e.g. ``docs/results/bench_label.json``), so a figure quoted in the README comes from a file the program
    wrote. Nothing when ``path`` is None."""
    if path is None:
        return
    import datetime
    import platform

    from models.numerics import cpu_class, numerics_record

    record = {"bench": bench, "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": {"cpu": cpu_class(), "cores": os.cpu_count(), "python": platform.python_version()},
              "numerics": numerics_record(), "argv": [repo_relative(a) for a in sys.argv[1:]], "git": git_revision(),
              "command": command_line(), **figures}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
