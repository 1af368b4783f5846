"""Prefect flows (order and wiring only) and the typer CLI."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)
