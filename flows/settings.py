"""A deployed run's settings from Prefect's own places, read when the run starts: roots from Prefect Variables, object
store credentials from a Prefect Secret block.

Variables (``prefect variable set NAME VALUE``; JSON values for the standing inputs), each with its default:

==========================  =====================================================================================
``lexiflow_data_root``      where the downloads are: the profile's ``data_dir`` (unset: the profile's own, ``/data``
                            in ``configs/full.yaml``); the label deployments' inputs default under it
``lexiflow_store``          the artifact store (unset: the profile's ``store_uri``; for the label deployments
                            ``<data root>/lexiflow/store``, as ``configs/full.yaml`` puts it)
``lexiflow_incoming``       what ``label-nightly`` labels (default ``<data root>/incoming/*.csv``)
``lexiflow_output_root``    where label runs write, one directory per label version (default
                            ``<data root>/labelled``; ``label-nightly`` writes under ``<output root>/nightly``)
``lexiflow_standing_inputs`` what ``relabel-on-promotion`` relabels: a JSON list of ``{input_uri, output_root,
                            options}`` (default: ``<data root>/standing/reviews.csv`` into
                            ``<output root>/standing/reviews``)
``lexiflow_demo_root``      the demo deployments' directory: sample inputs, store, labelled output (default
                            ``~/.lexiflow/demo`` on the worker)
``lexiflow_storage_secret`` the name of a Secret block whose value is the storage options, e.g.
                            ``{"s3": {"key": "…", "secret": "…"}}`` (unset: none)
==========================  =====================================================================================

Templating ``{{ prefect.variables.NAME }}`` into a deployment's fields would be resolved once, at ``prefect deploy``
(and a missing variable silently becomes an empty string there); these are read by each run when it starts, so a
``prefect variable set`` reaches the next run with no redeploy. The credentials never pass through a flow parameter,
an override or an artifact: they are installed as the process's storage defaults (:func:`storage.options.configure`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from prefect.blocks.system import Secret
from prefect.context import FlowRunContext
from prefect.variables import Variable

from storage.options import configure

log = logging.getLogger("lexiflow")

DATA_ROOT = "lexiflow_data_root"
STORE = "lexiflow_store"
INCOMING = "lexiflow_incoming"
OUTPUT_ROOT = "lexiflow_output_root"
STANDING_INPUTS = "lexiflow_standing_inputs"
DEMO_ROOT = "lexiflow_demo_root"
STORAGE_SECRET = "lexiflow_storage_secret"

DEFAULT_DATA_ROOT = "/data"  # configs/full.yaml's data_dir
DEFAULT_DEMO_ROOT = "~/.lexiflow/demo"


def variable(name: str, default: Any = None) -> Any:
    """The Prefect Variable ``name`` (``default`` when unset, or outside a run with a Prefect API)."""
    if FlowRunContext.get() is None:
        return default
    value = Variable.get(name, default=default)
    return default if value in (None, "") else value


def data_root() -> str:
    """``lexiflow_data_root``, or ``/data``."""
    return str(variable(DATA_ROOT, DEFAULT_DATA_ROOT)).rstrip("/")


def store_root() -> str:
    """``lexiflow_store``, or ``<data root>/lexiflow/store``."""
    return str(variable(STORE, f"{data_root()}/lexiflow/store")).rstrip("/")


def output_root() -> str:
    """``lexiflow_output_root``, or ``<data root>/labelled``."""
    return str(variable(OUTPUT_ROOT, f"{data_root()}/labelled")).rstrip("/")


def demo_root() -> str:
    """``lexiflow_demo_root``, or ``~/.lexiflow/demo``, with ``~`` expanded on this machine."""
    return os.path.expanduser(str(variable(DEMO_ROOT, DEFAULT_DEMO_ROOT))).rstrip("/")


def profile_overrides(profile: str | None, overrides: list[str] | None) -> list[str] | None:
    """A profile run's overrides with the roots that Variables set put first (``data_dir=``, ``store_uri=``), so
    the run is ``lexiflow run <flow> --config PROFILE --set data_dir=… --set store_uri=… --set <overrides>`` and
    the deployment's own overrides still win. A run given a whole config (no profile) is left as it is."""
    if profile is None:
        return overrides
    roots = [f"data_dir={v}" for v in [variable(DATA_ROOT)] if v] + [f"store_uri={v}" for v in [variable(STORE)] if v]
    return [*roots, *(overrides or [])] if roots else overrides


def label_roots(bundle_uri: str | None, input_uri: str | None, output_uri: str | None,
                output_root_: str | None) -> tuple[str, str, str | None]:
    """``label``'s unset locations from Variables: the bundle ``<store>/bundle@production``, the input
    ``lexiflow_incoming`` (``<data root>/incoming/*.csv``) and, without an output directory, the output root
    ``<output root>/nightly``."""
    bundle_uri = bundle_uri or f"{store_root()}/bundle@production"
    input_uri = input_uri or str(variable(INCOMING, f"{data_root()}/incoming/*.csv"))
    if output_uri is None and output_root_ is None:
        output_root_ = f"{output_root()}/nightly"
    return bundle_uri, input_uri, output_root_


def standing_inputs() -> list[dict[str, Any]]:
    """``lexiflow_standing_inputs`` (a list, or its JSON text), or the one default standing input."""
    value = variable(STANDING_INPUTS)
    if value is None:
        return [{"input_uri": f"{data_root()}/standing/reviews.csv",
                 "output_root": f"{output_root()}/standing/reviews", "options": {"text_column": "review"}}]
    inputs = json.loads(value) if isinstance(value, str) else value
    if not isinstance(inputs, list):
        raise ValueError(f"Prefect Variable {STANDING_INPUTS}: expected a JSON list of standing inputs, got "
                         f"{type(inputs).__name__}")
    return inputs


def storage_secret_options(name: str | None = None) -> dict[str, dict[str, Any]]:
    """The storage options held by the Secret block ``name`` (default: the one ``lexiflow_storage_secret`` names;
    none: ``{}``). The value is JSON, ``{protocol: {fsspec option: value}}``, as the Secret holds it or as its
    text."""
    name = name or variable(STORAGE_SECRET)
    if not name:
        return {}
    value = Secret.load(str(name)).get()
    try:
        options = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        raise ValueError(f"Secret block {name!r}: expected JSON storage options ({{protocol: {{option: value}}}}), "
                         "got text that is not JSON") from None  # never the value itself
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ValueError(f"Secret block {name!r}: expected JSON storage options ({{protocol: {{option: value}}}})")
    return options


def apply_storage_secret() -> list[str]:
    """Install the storage options of the Secret block that ``lexiflow_storage_secret`` names as this run's storage
    defaults (every filesystem it opens, its Dask workers, processes it starts; a profile's own ``storage_options``
    merged over them per key). Returns the protocols configured; logs their names, never their values."""
    options = storage_secret_options()
    if options:
        configure(options)
        log.info("storage credentials from the Secret block %r for: %s", variable(STORAGE_SECRET),
                 ", ".join(sorted(options)))
    return sorted(options)
