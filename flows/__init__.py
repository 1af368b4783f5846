"""Prefect at the edge: flows (order and wiring only) and the Prefect-backed runtime they build at their start.

Importing this package installs nothing: a flow builds its runtime explicitly (:func:`flows.runner.start_run`).
"""

import models.numerics  # noqa: F401  (pins torch's CPU kernels before any torch op; imports no torch)
