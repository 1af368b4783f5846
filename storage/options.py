"""Storage options (endpoint, credentials) applied to every filesystem a run opens, as fsspec defaults.

``configure({"s3": {"endpoint_url": "http://minio:9000", "key": "...", "secret": "..."}})``

- installs each protocol's options in ``fsspec.config.conf`` (fsspec's documented per-protocol
  defaults), so every ``fsspec.open`` / ``url_to_fs`` / ``fsspec.filesystem`` in this process gets
  them: the artifact store, the inputs, the labeller, shard tasks on the thread runner;
- exports them as ``FSSPEC_<PROTOCOL>_<KEY>`` environment variables (JSON-encoded values, which
  fsspec decodes at import), so processes started afterwards (Dask ``LocalCluster`` workers,
  ``torchrun``) read the same defaults;
- registers a Dask worker plugin doing the same on every current and future worker of the running
  flow's ``DaskTaskRunner`` (its client is started here, after the environment is set, so new
  ``LocalCluster`` workers inherit it anyway) and of the process's default Dask client: workers of a
  remote cluster (``runner.dask_address``) get the options too.

Options merge per key into what is already configured; explicit ``storage_options=`` arguments to
fsspec still win. The values stay in process memory, the environment and the Dask scheduler's
plugin registry: nothing here logs them (the plugin's repr names only the protocols),
and the config field that carries them is excluded from every dump (versions, manifests, Prefect
parameters). fsspec's own variables (``FSSPEC_S3_ENDPOINT_URL=...``, ``FSSPEC_S3='{"anon": true}'``)
work without calling this at all.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import fsspec.config

_PROTOCOL = re.compile(r"^[a-z][a-z0-9]*$")  # FSSPEC_<PROTOCOL>_<KEY> splits on the first two "_"
_KEY = re.compile(r"^[a-z][a-z0-9_]*$")  # fsspec lower-cases keys read from the environment
_configured: set[str] = set()  # protocols configure() installed: their fsspec defaults go to Dask workers


def validate(options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``options`` as plain dicts, or ValueError naming the bad protocol/key (never a value)."""
    out: dict[str, dict[str, Any]] = {}
    for protocol, opts in (options or {}).items():
        if not isinstance(protocol, str) or not _PROTOCOL.match(protocol):
            raise ValueError(f"storage_options: protocol {protocol!r} must be lowercase letters/digits, e.g. 's3'")
        if not isinstance(opts, Mapping):
            raise ValueError(f"storage_options.{protocol}: expected a mapping of fsspec keyword arguments")
        for key, value in opts.items():
            if not isinstance(key, str) or not _KEY.match(key):
                raise ValueError(f"storage_options.{protocol}: key {key!r} must be a lowercase identifier")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ValueError(f"storage_options.{protocol}.{key}: value is not JSON-serialisable") from None
        out[protocol] = dict(opts)
    return out


def env_name(protocol: str, key: str) -> str:
    """The environment variable fsspec reads ``key`` of ``protocol`` from."""
    return f"FSSPEC_{protocol.upper()}_{key.upper()}"


def install(options: Mapping[str, Mapping[str, Any]]) -> None:
    """Set ``options`` as fsspec defaults in this process and in the environment its children inherit."""
    for protocol, opts in validate(options).items():
        fsspec.config.conf.setdefault(protocol, {}).update(opts)
        for key, value in opts.items():
            os.environ[env_name(protocol, key)] = json.dumps(value)


def configure(options: Mapping[str, Mapping[str, Any]] | None) -> None:
    """Apply ``options`` (``{protocol: {fsspec kwarg: value}}``) to every filesystem this run opens:
    this process, processes it starts later, and the workers of a connected Dask client. None/{}: no-op."""
    options = validate(options)
    if not options:
        return
    install(options)
    _configured.update(options)
    for client in _dask_clients():
        share_with(client)


def share_with(client: Any) -> None:
    """Install the options configured in this process on every current and future worker of a Dask
    ``client`` (a no-op when none are configured)."""
    if not _configured:
        return
    from storage.dask_plugin import StorageOptionsPlugin

    client.register_plugin(StorageOptionsPlugin({p: fsspec.config.conf.get(p, {}) for p in sorted(_configured)}))


def _dask_clients() -> list[Any]:
    """The Dask clients whose workers may run this process's tasks: the running flow's DaskTaskRunner's
    (started now if it was not yet) and distributed's default client. Neither imported: none."""
    clients = []
    if "prefect_dask" in sys.modules:
        from prefect.context import FlowRunContext
        from prefect_dask import DaskTaskRunner

        ctx = FlowRunContext.get()
        if ctx is not None and isinstance(ctx.task_runner, DaskTaskRunner):
            clients.append(ctx.task_runner.client)
    if "distributed" in sys.modules:
        from distributed import default_client

        try:
            clients.append(default_client())
        except ValueError:  # no default client
            pass
    return list({id(c): c for c in clients}.values())
