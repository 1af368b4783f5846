"""A committed bundle opened for scoring and explaining: its featurizer, classifier, threshold or classes, the
baseline and blend it may stack, and its monitoring reference, every file checksum-verified; on this machine's device
by default."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq
import torch
from safetensors.torch import load as st_load

from models import LebertClassifier
from models.config import model_config
from storage.artifacts import open_artifact
from tasks.inference.blend import BaselineModel, blend_from_dict
from tasks.inference.reference import REFERENCE_FILE, Reference
from tasks.inference.runtime import default_device
from tasks.text.featurize import Featurizer


@dataclass
class Bundle:
    """An opened bundle: what scoring and explaining a text need, every file checksum-verified."""

    version: str
    uri: str
    featurizer: Any  # tasks.text.featurize.Featurizer
    model: Any  # models.LebertClassifier (eval mode)
    threshold: float | None  # None: K > 2 classes (the label is the arg-max)
    info: dict[str, Any]
    baseline: Any = None  # tasks.inference.blend.BaselineModel when the shipped classifier stacks it

    @property
    def classes(self) -> list[str] | None:
        """The class names in label order (``finetune.classes: any``), None for a binary-mode bundle."""
        return self.info.get("classes")
    blend: Any = None  # tasks.inference.blend.Blend | KBlend: how the encoder's and the baseline's logits combine
    reference: Any = None  # tasks.inference.reference.Reference (bundle-7 and later): dev distributions, calibration

    def heldout_texts(self, limit: int = 2000) -> list[str]:
        """The first ``limit`` fine-tuning test texts this bundle carries (checksum-verified), for agreement
        checks of approximate scoring paths; [] for a bundle built before bundle-4."""
        art = open_artifact(self.uri)
        if "heldout.parquet" not in art.files():
            return []
        table = pq.read_table(io.BytesIO(art.read_verified("heldout.parquet")))
        return [t for t in table.column("review").to_pylist()[:limit] if isinstance(t, str)]


def load_bundle(uri: str, device: str = "cpu") -> Bundle:
    """Open a committed bundle; every file is checked against its manifest sha256 before use."""
    art = open_artifact(uri)
    if art.manifest.stage != "bundle":
        raise ValueError(f"{uri} is a {art.manifest.stage!r} artifact, not a bundle")
    info = art.read_json("bundle.json", ("max_word_num", "max_len", "threshold"))
    mc = art.read_json("model_config.json", ("model", "use_layers", "dropout"))
    feat = Featurizer.load(art, "bundle.json")  # its settings in bundle.json (bundle-5 and older: no truncation)
    model_cfg = model_config(art, mc)
    k = len(mc.get("classes") or ())
    model = LebertClassifier(model_cfg, use_layers=mc["use_layers"], dropout=mc["dropout"],
                             num_labels=k if k > 2 else 1)
    model.load_state_dict(st_load(art.read_verified("model.safetensors")))
    model.to(torch.device(device)).eval()
    baseline = blend = None
    if "blend.json" in art.files():
        blend = blend_from_dict(json.loads(art.read_verified("blend.json")))
        baseline = BaselineModel.from_table(pq.read_table(io.BytesIO(art.read_verified("baseline.parquet"))))
    threshold = None if info["threshold"] is None else float(info["threshold"])
    reference = Reference.from_bytes(art.read_verified(REFERENCE_FILE)) if REFERENCE_FILE in art.files() else None
    return Bundle(art.manifest.version, art.uri, feat, model, threshold, info, baseline, blend, reference)


def open_bundle(uri: str, device: str | None = None) -> Bundle:
    """Open a committed bundle (every file checksum-verified) on ``device``, by default
    :func:`tasks.inference.runtime.default_device`."""
    return load_bundle(uri, device or default_device())
