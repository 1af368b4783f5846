"""bundle: everything ``label`` needs in one artifact, each file checksum-verified on load
(:func:`tasks.inference.bundle.load_bundle`).

Files: the classifier (``model.safetensors``, ``model_config.json``), ``threshold.json``, the featurizer
(:meth:`tasks.text.featurize.Featurizer.save`: the character ``vocab.txt``, the compiled trie ``compiled.npz``,
``rank_to_word.npy``: trie rank -> word id), the word vocabulary ``words.txt`` with its matrix
``word_vectors.npy``, the trie ``trie.pkl`` for reference, ``bundle.json`` (the featurizer's settings, threshold,
metrics) and ``README.md``, the
model card rendered from the manifests of the bundle's lineage (:mod:`tasks.bundle.model_card`), and
``reference.json``: what the classifier saw on its held-out TEST rows (dev where too few), for monitoring label runs
(:mod:`tasks.inference.reference`: descriptor and score distributions, a cross-fitted probability calibration).
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from storage.artifacts import ArtifactRef, open_artifact
from storage.fingerprints import fingerprint_input
from tasks.bundle.model_card import lineage_manifests, model_card
from tasks.common.context import StageContext
from tasks.common.labelled import load_data
from tasks.common.stage import Stage, StageResult
from tasks.common.text import normalize_text
from tasks.finetune.baseline import fit_blend
from tasks.finetune.config import FinetuneConfig
from tasks.inference.blend import BaselineModel, Blend, blend_from_dict
from tasks.inference.reference import REFERENCE_FILE, build_reference, name_words, reference_bytes
from tasks.text.featurize import DEFAULTS, Featurizer
from tasks.text.vocab import parse_vocab

# hashed into every bundle version: a change to what a bundle holds takes a new one
# bundle-7: reference.json (dev distributions and calibration, for monitoring label runs)
# bundle-8: the reference from the test rows that repeat no training text (dev only without enough of them);
# K > 2 classes calibrated one-vs-rest
# bundle-9: the reference's content sketch adds the lexicon words (ids, strings, counts, chunk variability)
CODE_VERSION = "bundle-9"
FILES = ("model.safetensors", "model_config.json", "threshold.json", "vocab.txt", "words.txt", "word_vectors.npy",
         "trie.pkl", "compiled.npz", "rank_to_word.npy", "bundle.json", "README.md", "heldout.parquet")
BLEND_FILES = ("baseline.parquet", "blend.json")
# bundle-7 and later; an older bundle (or a test fixture without it) labels without a monitoring report
MONITOR_FILES = (REFERENCE_FILE,)  # present when the finetune stage stacked the baseline
# finetune metrics carried into the bundle: the model's test metrics, the baseline's, the contamination counts
CARRIED = ("test_", "baseline_", "contaminated_", "encoder_", "blend")


def build(writer, finetune_art, threshold_art, lexicon_art, dev_data: FinetuneConfig | None = None) -> StageResult:
    """Copy/derive the bundle files into ``writer``; in = out = the number of files, metrics: the
    threshold, the fine-tuning test metrics beside the baseline's, the contamination counts, and the calibration's
    out-of-fold check on dev. ``dev_data``: the current finetune section, where its files are now (used only for a
    file no longer at the URI the finetune manifest records; the fingerprint must match either way)."""
    trie_art = open_artifact({p.stage: p for p in lexicon_art.manifest.parents}["trie"])
    copies = ((finetune_art, "model.safetensors"), (finetune_art, "model_config.json"),
              (threshold_art, "threshold.json"), (lexicon_art, "words.txt"),
              (lexicon_art, "word_vectors.npy"), (trie_art, "trie.pkl"), (finetune_art, "heldout.parquet"))
    blended = all(f in finetune_art.files() for f in BLEND_FILES)
    copies += tuple((finetune_art, f) for f in BLEND_FILES if blended)
    for src, rel in copies:
        writer.write_bytes(rel, src.read_verified(rel))
    model_cfg = json.loads(finetune_art.read_verified("model_config.json"))
    feat = Featurizer.from_artifacts(lexicon_art, max_len=int(model_cfg.get("max_len", DEFAULTS["max_len"])))
    # truncation checked when set; older finetunes do not say (the default, head)
    feat = replace(feat, truncation=model_cfg.get("truncation", DEFAULTS["truncation"]))
    # vocab.txt, compiled.npz, rank_to_word.npy (the bytes of the vocab and trie stages' files); settings in bundle.json
    settings = feat.save(writer, settings_file=None)
    threshold = json.loads(threshold_art.read_verified("threshold.json"))["threshold"]
    carried = {k: v for k, v in finetune_art.manifest.metrics.items() if k.startswith(CARRIED)}
    # classes: any: the class names in label order (K > 2: arg-max, threshold null); absent for a binary-mode run
    classes = {"classes": model_cfg["classes"]} if "classes" in model_cfg else {}
    info = {**settings, "threshold": threshold, **classes,
            "metrics": carried,
            # parents by stage and version only: the bundle's bytes do not depend on where the store lives
            "finetune": finetune_art.ref.model_dump(exclude={"uri"}),
            "lexicon": lexicon_art.ref.model_dump(exclude={"uri"})}
    writer.write_bytes("bundle.json", json.dumps(info, indent=1, sort_keys=True, ensure_ascii=False).encode())
    card = model_card(writer.version, CODE_VERSION, lineage_manifests([finetune_art, threshold_art, lexicon_art]))
    writer.write_bytes("README.md", card.encode())
    ref = name_words(reference_of(finetune_art, feat, threshold, model_cfg.get("classes"), blended, dev_data),
                     parse_vocab(lexicon_art.read_verified("words.txt")))
    writer.write_bytes(REFERENCE_FILE, reference_bytes(ref))
    oof = ref["calibration"]["out_of_fold"]
    calib = {"calibration": ref["calibration"]["method"], **{f"dev_oof_{k}": v for k, v in oof.items()}}
    n = len(FILES) + len(MONITOR_FILES) + (len(BLEND_FILES) if blended else 0)
    return StageResult({"in": n, "out": n, "rejected": {}}, {"threshold": threshold, **carried, **calib})


MIN_TEST_ROWS = 100  # fewer test rows that repeat no training text: the reference falls back to dev


def reference_of(finetune_art, feat, threshold: float | None, classes: list[str] | None, blended: bool,
                 dev_data: FinetuneConfig | None = None) -> dict[str, Any]:
    """The bundle's ``reference.json`` (:func:`choose_reference`) from the fine-tuning TEST rows and, only where
    needed, its DEV rows (a stack's calibration then fitted on its out-of-fold dev probabilities)."""

    def dev() -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray | None]:
        texts, labels, outputs, unseen = model_split(finetune_art, dev_data, "dev")
        oof = stack_out_of_fold(finetune_art, texts, labels, outputs, unseen) if blended else None
        return texts, labels, outputs, oof

    return choose_reference(model_split(finetune_art, dev_data, "test"), dev, feat, threshold, classes)


def choose_reference(test: tuple[list[str], np.ndarray, np.ndarray, np.ndarray], dev, feat, threshold: float | None,
                     classes: list[str] | None) -> dict[str, Any]:
    """``reference.json`` from the ``test`` rows (texts, labels, outputs, whether each repeats no training text)
    that repeat no training text: rows that chose nothing (not the epoch, the learning-rate schedule, early
    stopping, the threshold nor the stack), calibration cross-fitted on them. Where fewer than
    :data:`MIN_TEST_ROWS` such rows exist (a profile without a test split), ``dev()``'s rows (texts, labels, outputs,
    out-of-fold stacked outputs or None) as before bundle-8, the reference saying so."""
    texts, labels, outputs, unseen = test
    if int(np.sum(unseen)) >= MIN_TEST_ROWS:
        keep = np.flatnonzero(unseen)
        note = (f"test rows that repeat no training text: {len(keep)} of {len(texts)} (the rest left out); "
                "no selection used them")
        return build_reference([texts[i] for i in keep], np.asarray(labels)[keep], np.asarray(outputs)[keep], feat,
                               threshold, classes, split="test", split_note=note)
    d_texts, d_labels, d_outputs, oof = dev()
    note = (f"dev rows: the test split has {int(np.sum(unseen))} rows that repeat no training text, fewer than "
            f"{MIN_TEST_ROWS}; dev chose the epoch and the threshold, so the estimate may be optimistic")
    return build_reference(d_texts, d_labels, d_outputs, feat, threshold, classes, oof,
                           None if oof is None else OOF_NOTE, split="dev", split_note=note)


def model_split(finetune_art, dev_data: FinetuneConfig | None = None, split: str = "dev"
                ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(texts, true class indices, the shipped classifier's outputs, whether each text is NOT among the training
    rows after normalisation) of the fine-tuning ``split`` rows (``dev`` or ``test``), in the order of its
    ``{split}_predictions.parquet``: the rows are re-read from the files the finetune manifest records (each
    checked against its recorded fingerprint; where a file has moved, ``dev_data``'s URI for the same role) and
    split as fine-tuning split them; ValueError when they are not the rows the classifier was scored on."""
    recorded = dict(finetune_art.manifest.config)
    inputs = recorded.pop("inputs", None) or {}
    recorded.pop("numerics", None)
    section = {k: v for k, v in recorded.items() if k in FinetuneConfig.model_fields}
    for role, rec in inputs.items():
        section[role] = _located(role, rec, getattr(dev_data, role, None))
    data = load_data(FinetuneConfig.model_validate(section))
    pred = pq.read_table(io.BytesIO(finetune_art.read_verified(f"{split}_predictions.parquet")))
    rows = {r["row_id"]: r for r in (data.test if split == "test" else data.dev)}
    ids = pred.column("row_id").to_pylist()
    labels = np.asarray(pred.column("label").to_numpy(), np.int64)
    if len(rows) != len(ids) or any(i not in rows or rows[i]["label"] != y for i, y in zip(ids, labels.tolist())):
        raise ValueError(f"{finetune_art.uri}: the {split} rows re-read from {sorted(inputs) or 'its files'} are not "
                         f"the rows its {split}_predictions.parquet scored (changed data or split code); re-run "
                         "finetune")
    if "probs" in pred.column_names:  # K > 2 classes: [N, K]
        k = pred.column("probs").type.list_size
        outputs = pred.column("probs").combine_chunks().flatten().to_numpy().reshape(len(ids), k)
    else:
        outputs = pred.column("prob").to_numpy()
    texts = [rows[i]["text"] for i in ids]
    seen = {normalize_text(r["text"]) for r in data.train}
    unseen = np.array([normalize_text(t) not in seen for t in texts], bool)
    return texts, labels, np.asarray(outputs, np.float32), unseen


OOF_NOTE = ("out-of-fold stacked dev probabilities: the stack refitted on four folds of dev, applied to the fifth "
            "(the encoder's dev logits recovered from the shipped probabilities)")


def stack_out_of_fold(finetune_art, texts: list[str], labels: np.ndarray, outputs: np.ndarray,
                      unseen: np.ndarray | None = None, folds: int = 5) -> np.ndarray | None:
    """float32 [N]: a two-class stack's dev probabilities as on unseen rows: the stack (``combine: stack``, fitted on
    dev) refitted on the other folds for each fold (row i in fold ``i % folds``), on their rows whose text is not
    among the training rows (``unseen``, as fine-tuning fitted it; all of them when those lack a class), on the
    encoder's dev logits
    (recovered from the shipped probabilities: ``logit(p) = w_e z_e + w_b z_b + bias``) and the baseline's
    (recomputed). None for anything else (no stack, ``residual``: nothing fitted on dev; K > 2 classes: a softmax
    does not give the encoder's logits back)."""
    if finetune_art.manifest.config.get("combine") != "stack" or np.asarray(outputs).ndim != 1:
        return None
    blend = blend_from_dict(json.loads(finetune_art.read_verified("blend.json")))
    if not isinstance(blend, Blend) or blend.w_encoder == 0:
        return None
    base = BaselineModel.from_table(pq.read_table(io.BytesIO(finetune_art.read_verified("baseline.parquet"))))
    z_base = base.logits([normalize_text(t) for t in texts])
    p = np.clip(np.asarray(outputs, np.float64), 1e-7, 1 - 1e-7)
    z_enc = (np.log(p) - np.log1p(-p) - blend.w_baseline * z_base - blend.bias) / blend.w_encoder
    y = np.asarray(labels, np.int64)
    fold = np.arange(len(y)) % folds
    out = np.array(outputs, np.float32)
    unseen = np.ones(len(y), bool) if unseen is None else np.asarray(unseen, bool)
    for f in range(folds):
        rest, held = fold != f, fold == f
        fit = rest & unseen if len(np.unique(y[rest & unseen])) == 2 else rest
        if held.any() and len(np.unique(y[fit])) == 2:
            out[held] = fit_blend(y[fit], z_enc[fit], z_base[fit]).prob(z_enc[held], z_base[held])
    return out


def _located(role: str, rec: dict[str, Any], current: str | None) -> str:
    """The URI of the finetune input ``role`` whose recorded fingerprint is ``rec``: the recorded URI when the file
    is still there with the same bytes, else ``current`` (the pipeline's config) when its bytes match."""
    want = {k: v for k, v in rec.items() if k not in ("uri", "name")}
    tried = []
    for uri in dict.fromkeys(u for u in (rec.get("uri"), current) if u):
        try:
            got = fingerprint_input(uri)
        except OSError as e:
            tried.append(f"{uri} ({type(e).__name__})")
            continue
        if all(got.get(k) == v for k, v in want.items() if k in got):
            return uri
        tried.append(f"{uri} (other bytes)")
    raise FileNotFoundError(2, f"finetune.{role} with the bytes fine-tuning read (needed for the bundle's dev "
                            f"reference) is not found: tried {', '.join(tried) or 'nothing'}; give its current "
                            "location in the pipeline config", str(rec.get("uri")))


def _build(ctx: StageContext, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef, lexicon_ref: ArtifactRef,
           dev_data: FinetuneConfig | None = None) -> StageResult:
    return build(ctx.writer, *map(open_artifact, (finetune_ref, threshold_ref, lexicon_ref)), dev_data=dev_data)


# no config section: a bundle is a function of its three parents
STAGE = Stage("bundle", CODE_VERSION, None, parents=("finetune_ref", "threshold_ref", "lexicon_ref"), build=_build)
