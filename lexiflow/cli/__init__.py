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

from lexiflow.cli import reaper, run, store  # noqa: F401  (run, store: register the commands on app, in this order)
from lexiflow.cli.base import app, defer_final_line, stop_on_signals

importlib.import_module("lexiflow.cli.monitor")  # then monitor's (an import sorted above would register it first)

__all__ = ["app", "main"]


def environment_defaults(env=os.environ) -> None:
    """What every ``lexiflow`` process runs with unless the user set it: ``PYTHONHASHSEED=0`` and no Prefect
    telemetry. A temporary Prefect server would try to send usage telemetry (and log an ERROR on a machine without
    internet), and Prefect's client would look for a server that has it on: lexiflow runs offline batches, so both
    stay off unless the user turns them on (``PREFECT_SERVER_ANALYTICS_ENABLED=true``; ``DO_NOT_TRACK`` is then
    left alone)."""
    env.setdefault("PYTHONHASHSEED", "0")
    if "PREFECT_SERVER_ANALYTICS_ENABLED" not in env:
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        env.setdefault("DO_NOT_TRACK", "1")


def main() -> None:  # pragma: no cover
    """The ``lexiflow`` console script and ``python -m lexiflow``: the app, whose commands all map user mistakes to
    one ``error:`` line and exit 2 (:class:`lexiflow.cli.base._Commands`), printed after anything Prefect prints at
    exit; SIGTERM stops a command with one line that says how to go on.

    Hash randomisation is fixed before the interpreter starts (a seed set later has no effect on ``hash``):
    without ``PYTHONHASHSEED`` the process re-executes itself once with ``PYTHONHASHSEED=0``, so set and dict
    orders (and gensim's vectors in ``lexiflow sample``) are the same in every run. The other defaults:
    :func:`environment_defaults`."""
    if os.environ.get("PYTHONHASHSEED") is None:
        environment_defaults()
        os.execv(sys.executable, [sys.executable, "-m", "lexiflow", *sys.argv[1:]])
    environment_defaults()
    defer_final_line()  # before Prefect loads: our atexit handler then runs after every one of Prefect's
    stop_on_signals()
    reaper.enable()  # run, label and ner-label start a watchdog: nothing they start outlives this process
    app(prog_name="lexiflow")
