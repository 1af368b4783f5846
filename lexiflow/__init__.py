"""lexiflow's public interfaces: the Python API (bundles, labelling, label outputs, store versions and flow runs, as
pandas frames) and the ``lexiflow`` command line (:mod:`lexiflow.cli`).

>>> import lexiflow
>>> model = lexiflow.load_bundle(".demo/store/bundle/<version>")
>>> model.predict(["房间干净", ""])  # text_index, prob, label, threshold, bundle_version, no_cjk, truncated_at, reason
>>> lexiflow.label_dataframe(df, model, text_column="review")
>>> lexiflow.read_labelled(".demo/store/labelled/<version>")
>>> lexiflow.versions(".demo/store", "finetune")
>>> lexiflow.run("prepare", "configs/demo.yaml", store_uri="/tmp/store", **{"prepare.clean.min_chars": 8})
"""

from __future__ import annotations

import tomllib
from importlib import import_module
from importlib import metadata as _metadata
from pathlib import Path
from typing import TYPE_CHECKING

import models.numerics  # noqa: F401  (pins torch's CPU kernels before any torch op)

# the API's names load on first use (pandas, pyarrow), so `lexiflow --help` and `import lexiflow` stay quick
_WHERE = {"label_dataframe": "frames", "read_labelled": "outputs", "run": "runs", "Model": "scoring",
          "load_bundle": "scoring", "versions": "store"}
if TYPE_CHECKING:  # what the names are, for type checkers and the API reference (mkdocstrings)
    from lexiflow.frames import label_dataframe
    from lexiflow.outputs import read_labelled
    from lexiflow.runs import run
    from lexiflow.scoring import Model, load_bundle
    from lexiflow.store import versions


def _version() -> str:
    """The installed distribution's version; pyproject.toml's when lexiflow runs from a plain checkout."""
    try:
        return _metadata.version("lexiflow")
    except _metadata.PackageNotFoundError:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]


__version__ = _version()
__all__ = ["Model", "__version__", "label_dataframe", "load_bundle", "read_labelled", "run", "versions"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lexiflow' has no attribute {name!r}")
    value = getattr(import_module(f"lexiflow.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
