"""``prefect deploy --all`` for a worker that holds its own checkout: prefect.yaml with its local pull step.

    LEXIFLOW_HOME=$PWD python -m flows.local_deploy

prefect.yaml's pull steps clone the repository and install its dependencies on the worker (workers anywhere); a
worker on the machine of this checkout, with lexiflow installed in its Python, needs neither. This writes
prefect.yaml with ``definitions.pull_local`` (``set_working_directory`` to ``$LEXIFLOW_HOME``, resolved in each
run's process) as its pull steps to a temporary file and deploys that, from this checkout (extra arguments go to
``prefect deploy``). Everything else is prefect.yaml's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def local_spec(spec: dict | None = None) -> dict:
    """``spec`` (default: prefect.yaml, anchors resolved) with ``definitions.pull_local`` as its pull steps."""
    spec = dict(spec or yaml.safe_load((ROOT / "prefect.yaml").read_text(encoding="utf-8")))
    spec["pull"] = spec["definitions"]["pull_local"]
    return spec


def main(argv: list[str] | None = None) -> int:
    """Deploy every deployment of prefect.yaml with the local pull step; returns ``prefect deploy``'s exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prefect.yaml"
        path.write_text(yaml.safe_dump(local_spec(), allow_unicode=True, sort_keys=False), encoding="utf-8")
        cmd = [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
               str(path), *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
