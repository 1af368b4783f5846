"""Prefect at the edge: flows (order and wiring only), the hooks that plug Prefect into tasks and storage."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)
from flows.logs import attach as _attach_logs  # noqa: E402
from flows.prefect_ui import install as _install_prefect  # noqa: E402
from flows.storage_hooks import install as _install_storage_hooks

_attach_logs()  # progress lines of training stages: to the Prefect run logs and stderr
_install_prefect()  # the stages' UI artifacts and shard maps: through Prefect inside a run
_install_storage_hooks()  # owner records name the flow run; storage options reach its Dask workers
