"""bundle: everything ``label`` needs in one artifact, each file checksum-verified on load.

Files: the classifier (``model.safetensors``, ``model_config.json``), ``threshold.json``, the
character ``vocab.txt``, the word vocabulary ``words.txt`` with its matrix ``word_vectors.npy``,
the trie (``trie.pkl`` for reference, ``compiled.npz`` for matching), ``rank_to_word.npy``
(trie rank -> word id), ``bundle.json`` (featuriser settings, threshold, metrics) and ``README.md``, the
model card rendered from the manifests of the bundle's lineage (:mod:`tasks.bundle.model_card`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import load as st_load

from models import LebertClassifier
from models.config import model_config
from storage.artifacts import ArtifactRef, open_artifact
from tasks.bundle.model_card import lineage_manifests, model_card
from tasks.common.stage import Stage, StageResult
from tasks.finetune.baseline import BaselineModel, blend_from_dict
from tasks.text.featurize import Featurizer
from tasks.text.matcher import CompiledTrie
from tasks.text.vocab import parse_vocab

# hashed into every bundle version: a change to what a bundle holds takes a new one
CODE_VERSION = "bundle-6"
FILES = ("model.safetensors", "model_config.json", "threshold.json", "vocab.txt", "words.txt", "word_vectors.npy",
         "trie.pkl", "compiled.npz", "rank_to_word.npy", "bundle.json", "README.md", "heldout.parquet")
BLEND_FILES = ("baseline.parquet", "blend.json")  # present when the finetune stage stacked the baseline
# finetune metrics carried into the bundle: the model's test metrics, the baseline's, the contamination counts
CARRIED = ("test_", "baseline_", "contaminated_", "encoder_", "blend")


def build(writer, finetune_art, threshold_art, lexicon_art) -> StageResult:
    """Copy/derive the bundle files into ``writer``; in = out = the number of files, metrics: the
    threshold, the fine-tuning test metrics beside the baseline's, and the contamination counts."""
    parents = {p.stage: p for p in lexicon_art.manifest.parents}
    vocab_art, trie_art = open_artifact(parents["vocab"]), open_artifact(parents["trie"])
    copies = ((finetune_art, "model.safetensors"), (finetune_art, "model_config.json"),
              (threshold_art, "threshold.json"), (vocab_art, "vocab.txt"), (lexicon_art, "words.txt"),
              (lexicon_art, "word_vectors.npy"), (trie_art, "trie.pkl"), (trie_art, "compiled.npz"),
              (finetune_art, "heldout.parquet"))
    blended = all(f in finetune_art.files() for f in BLEND_FILES)
    copies += tuple((finetune_art, f) for f in BLEND_FILES if blended)
    for src, rel in copies:
        writer.write_bytes(rel, src.read_verified(rel))
    model_cfg = json.loads(finetune_art.read_verified("model_config.json"))
    feat = replace(Featurizer.from_artifacts(lexicon_art, max_len=int(model_cfg.get("max_len", 256))),
                   truncation=model_cfg.get("truncation", "head"))  # checked; older finetunes do not say: head
    buf = io.BytesIO()
    np.save(buf, feat.rank_to_word)
    writer.write_bytes("rank_to_word.npy", buf.getvalue())
    threshold = json.loads(threshold_art.read_verified("threshold.json"))["threshold"]
    carried = {k: v for k, v in finetune_art.manifest.metrics.items() if k.startswith(CARRIED)}
    # classes: any: the class names in label order (K > 2: arg-max, threshold null); absent for a binary-mode run
    classes = {"classes": model_cfg["classes"]} if "classes" in model_cfg else {}
    info = {"max_len": feat.max_len, "truncation": feat.truncation, "max_word_num": feat.k,
            "min_word_len": feat.min_len, "threshold": threshold, **classes,
            "metrics": carried,
            # parents by stage and version only: the bundle's bytes do not depend on where the store lives
            "finetune": finetune_art.ref.model_dump(exclude={"uri"}),
            "lexicon": lexicon_art.ref.model_dump(exclude={"uri"})}
    writer.write_bytes("bundle.json", json.dumps(info, indent=1, sort_keys=True, ensure_ascii=False).encode())
    card = model_card(writer.version, CODE_VERSION, lineage_manifests([finetune_art, threshold_art, lexicon_art]))
    writer.write_bytes("README.md", card.encode())
    n = len(FILES) + (len(BLEND_FILES) if blended else 0)
    return StageResult({"in": n, "out": n, "rejected": {}}, {"threshold": threshold, **carried})


@dataclass
class Bundle:
    """An opened bundle: what scoring and explaining a text need, every file checksum-verified."""

    version: str
    uri: str
    featurizer: Any  # tasks.text.featurize.Featurizer
    model: Any  # models.LebertClassifier (eval mode)
    threshold: float | None  # None: K > 2 classes (the label is the arg-max)
    info: dict[str, Any]
    baseline: Any = None  # tasks.finetune.baseline.BaselineModel when the shipped classifier stacks it

    @property
    def classes(self) -> list[str] | None:
        """The class names in label order (``finetune.classes: any``), None for a binary-mode bundle."""
        return self.info.get("classes")
    blend: Any = None  # tasks.finetune.baseline.Blend | KBlend: how the encoder's and the baseline's logits combine

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
    vocab = parse_vocab(art.read_verified("vocab.txt"))
    ct = CompiledTrie.from_bytes(art.read_verified("compiled.npz"))
    rank_to_word = np.load(io.BytesIO(art.read_verified("rank_to_word.npy")))
    index = {t: i for i, t in enumerate(vocab)}
    feat = Featurizer(index, ct, rank_to_word, int(info["max_word_num"]), int(info["max_len"]),
                      int(info.get("min_word_len", 2)), info.get("truncation", "head"))  # bundle-5 and older: head
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
    return Bundle(art.manifest.version, art.uri, feat, model, threshold, info, baseline, blend)


def _build(writer, version: str, *, cfg: None, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef,
           lexicon_ref: ArtifactRef) -> StageResult:
    return build(writer, *map(open_artifact, (finetune_ref, threshold_ref, lexicon_ref)))


# no config section: a bundle is a function of its three parents
STAGE = Stage("bundle", CODE_VERSION, None, parents=("finetune_ref", "threshold_ref", "lexicon_ref"), build=_build)
