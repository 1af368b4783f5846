"""Storage options (endpoint, credentials) applied to every filesystem a run opens, as fsspec defaults.

``configure({"s3": {"endpoint_url": "http://minio:9000", "key": "...", "secret": "..."}})``

- installs each protocol's options in ``fsspec.config.conf`` (fsspec's documented per-protocol
  defaults), so every ``fsspec.open`` / ``url_to_fs`` / ``fsspec.filesystem`` in this process gets
  them: the artifact store, the inputs, the labeller, shard tasks on the thread runner;
- exports them as ``FSSPEC_<PROTOCOL>_<KEY>`` environment variables (JSON-encoded values, which
  fsspec decodes at import), so processes started afterwards (Dask ``LocalCluster`` workers,
  ``torchrun``) read the same defaults;
- registers a Dask worker plugin doing the same on every current and future worker of the Dask clients the
  caller names (``clients=``: the run's shard cluster, which the runtime that started it knows) and of the
  process's default Dask client: workers of a remote cluster (``runner.dask_address``) get the options too.

Options merge per key into what is already configured; explicit ``storage_options=`` arguments to
fsspec still win. The values stay in process memory, the environment and the Dask scheduler's
plugin registry: nothing here logs them (the plugin's repr names only the protocols),
and the config field that carries them is excluded from every dump (versions, manifests, Prefect
parameters). fsspec's own variables (``FSSPEC_S3_ENDPOINT_URL=...``, ``FSSPEC_S3='{"anon": true}'``)
work without calling this at all.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec.config

from storage.defaults import env_name as env_name  # re-exported: the variable name callers check
from storage.defaults import install, validate

_configured: set[str] = set()  # protocols configure() installed: their fsspec defaults go to Dask workers


def configure(options: Mapping[str, Mapping[str, Any]] | None, clients: Iterable[Any] = ()) -> None:
    """Apply ``options`` (``{protocol: {fsspec kwarg: value}}``) to every filesystem this run opens:
    this process, processes it starts later, and the workers of ``clients`` (Dask clients) and of the default Dask
    client. None/{}: no-op."""
    options = validate(options)
    if not options:
        return
    install(options)
    _configured.update(options)
    for client in _dask_clients(clients):
        share_with(client)


def share_with(client: Any) -> None:
    """Install the options configured in this process on every current and future worker of a Dask
    ``client`` (a no-op when none are configured)."""
    if not _configured:
        return
    from storage.dask_plugin import StorageOptionsPlugin  # noqa: PLC0415  (imports distributed: only with a client)

    client.register_plugin(StorageOptionsPlugin({p: fsspec.config.conf.get(p, {}) for p in sorted(_configured)}))


def _dask_clients(given: Iterable[Any]) -> list[Any]:
    """The Dask clients whose workers may run this process's tasks: those given and distributed's default client
    (none when distributed was never imported)."""
    clients = list(given)
    if "distributed" in sys.modules:
        from distributed import default_client  # noqa: PLC0415  (only once something else imported distributed)

        try:
            clients.append(default_client())
        except ValueError:  # no default client
            pass
    return list({id(c): c for c in clients}.values())
