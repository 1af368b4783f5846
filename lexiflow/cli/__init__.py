"""The ``lexiflow`` command line: the typer app with every command on it, and ``main`` (console script, ``-m``).

``app`` is made in :mod:`lexiflow.cli.base` (the one-line errors, help panels and ``--storage-options`` every
command shares); :data:`COMMANDS` is the one list of its commands, which :func:`register` puts on it in the order
``lexiflow --help`` lists them. The command modules only define functions. The CLI sits above the flows it runs and
the Python API beside it; neither imports it.
"""

from __future__ import annotations

import os
import sys

import typer

from lexiflow.cli import monitor, reaper, run, store
from lexiflow.cli.base import (
    PANEL_BUILD,
    PANEL_LABEL,
    PANEL_START,
    PANEL_STORE,
    app,
    defer_final_line,
    stop_on_signals,
)

# every command: (name, function, help panel), in the order `lexiflow --help` lists them
COMMANDS = (
    ("sample", run.sample, PANEL_START),
    ("run", run.run, PANEL_BUILD),
    ("label", run.label, PANEL_LABEL),
    ("ner-label", run.ner_label, PANEL_LABEL),
    ("lineage", run.lineage, PANEL_STORE),
    ("export-hf", run.export_hf, PANEL_BUILD),
    ("explain", run.explain, PANEL_LABEL),
    ("promote", store.promote, PANEL_STORE),
    ("ls", store.ls, PANEL_STORE),
    ("gc", store.gc, PANEL_STORE),
    ("monitor", monitor.monitor, PANEL_LABEL),
)


def register(target: typer.Typer) -> None:
    """Put every command of :data:`COMMANDS` on ``target``, in that order."""
    for name, command, panel in COMMANDS:
        target.command(name, rich_help_panel=panel)(command)


register(app)

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
