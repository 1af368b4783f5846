"""Where the ``lexiflow`` logger's lines go in a flow run: the run's logs in the Prefect UI, and stderr.

Training stages log their progress (one INFO line per log row, a heartbeat, the phases before the first step) on
``lexiflow.progress`` (:mod:`tasks.training.progress`). Here that logger is set to INFO and the ``lexiflow`` logger
gets Prefect's API handler, active only inside a flow or task run, so the lines show in the UI's run logs. On stderr
they show through Prefect's console handler on the root logger (terminal or not: a non-TTY log file gets them
too), or through a plain handler of our own where no handler writes to stderr.
"""

from __future__ import annotations

import logging
import sys

from tasks.common.ui import StderrUnlessRoot, stderr_handler

PROGRESS = "lexiflow.progress"
MONITOR = "lexiflow.monitor"  # tasks.label.monitor.LOGGER: one line per label run


class RunLogHandler(logging.Handler):
    """Prefect's API log handler, used only while a flow or task run is active (elsewhere it would warn)."""

    def __init__(self):
        super().__init__()
        self._api = None

    def emit(self, record: logging.LogRecord) -> None:
        """Send ``record`` to the run's logs (inside a run only)."""
        if not _in_run():
            return
        if self._api is None:
            from prefect.logging.handlers import APILogHandler  # noqa: PLC0415  (a run is active: Prefect is loaded)

            self._api = APILogHandler()
        self._api.handle(record)


def _in_run() -> bool:
    """Whether a Prefect flow or task run is active here. Imports nothing: a process without ``prefect.context``
    loaded has no run, and importing Prefect inside a log call would run its logging set-up, which replaces the
    root logger's handlers while the record is on its way to them."""
    context = sys.modules.get("prefect.context")
    if context is None:
        return False
    return context.FlowRunContext.get() is not None or context.TaskRunContext.get() is not None


def attach() -> None:
    """Route the ``lexiflow`` logger to the Prefect run logs and make sure its progress lines, and a label run's
    monitoring line (``lexiflow.monitor``), reach stderr (idempotent)."""
    lexiflow = logging.getLogger("lexiflow")
    if not any(isinstance(h, RunLogHandler) for h in lexiflow.handlers):
        lexiflow.addHandler(RunLogHandler())
    for name in (PROGRESS, MONITOR):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
        if not any(isinstance(h, StderrUnlessRoot) for h in logger.handlers):
            logger.addHandler(stderr_handler())
