"""The ``lexiflow`` command line: the typer app with every command on it, and ``main`` (console script, ``-m``).

``app`` (made in :mod:`lexiflow.cli.base` with the one-line errors, help panels and ``--storage-options`` every
command shares) gets its commands as their modules load: :mod:`lexiflow.cli.run`'s, then
:mod:`lexiflow.cli.store`'s, then :mod:`lexiflow.cli.monitor`'s (the order ``lexiflow --help`` lists them
in). The CLI sits above the flows it runs and
the Python API beside it; neither imports it.
"""

from __future__ import annotations

import importlib
import os
import sys

from lexiflow.cli import run, store  # noqa: F401  (registers the commands on app, in this order)
from lexiflow.cli.base import app

importlib.import_module("lexiflow.cli.monitor")  # then monitor's (an import sorted above would register it first)

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover
    """The ``lexiflow`` console script and ``python -m lexiflow``: the app, whose commands all map user mistakes to
    one ``error:`` line and exit 2 (:class:`lexiflow.cli.base._Commands`).

    Hash randomisation is fixed before the interpreter starts (a seed set later has no effect on ``hash``):
    without ``PYTHONHASHSEED`` the process re-executes itself once with ``PYTHONHASHSEED=0``, so set and dict
    orders (and gensim's vectors in ``lexiflow sample``) are the same in every run."""
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "lexiflow", *sys.argv[1:]])
    # a temporary Prefect server would try to send usage telemetry and log an ERROR on a machine without internet;
    # lexiflow runs offline batches: off unless the user set it
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    app(prog_name="lexiflow")
