"""Prefect flows (order and wiring only) and the typer CLI."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)
from flows.logs import attach as _attach_logs  # noqa: E402

_attach_logs()  # progress lines of training stages: to the Prefect run logs and stderr
