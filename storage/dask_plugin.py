"""A Dask worker plugin that installs storage options (:mod:`storage.defaults`) on every current and future worker."""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from storage.defaults import install


class StorageOptionsPlugin(WorkerPlugin):
    """``install(options)`` in each worker process (fsspec defaults + ``FSSPEC_*`` variables)."""

    name = "lexiflow-storage-options"  # registering again replaces it: the latest options win

    def __init__(self, options: dict[str, dict[str, Any]]):
        self.options = {p: dict(o) for p, o in options.items()}

    def setup(self, worker: Any) -> None:
        """Install the options in the worker's process (Dask calls this on every worker, now and later)."""
        install(self.options)

    def __repr__(self) -> str:  # never the values: they hold credentials
        return f"StorageOptionsPlugin(protocols={sorted(self.options)})"
