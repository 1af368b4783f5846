"""Any number of classes (``finetune.classes: any``): K-class fine-tuning learns, the threshold stage is skipped,
labelled outputs carry the class name and every class's probability, the int8 gate compares arg-maxes, string and
integer labels, a class missing from dev or train; binary-mode configs dump as they always did."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch

from models import LebertForPretraining
from tasks.common.config import FinetuneConfig
from tasks.train.checkpoint import weights
from tests.test_finetune import CHARS, _featurizer, _model_cfg

MARKS = {"neg": "差", "mid": "般", "pos": "好"}  # class -> the character that decides it


def _three_class_csv(path, n=300, seed=0):
    rng = np.random.default_rng(seed)
    filler = [c for c in CHARS if c not in "好差般"]
    lines = ["cat,review"]
    for i in range(n):
        cls = ("pos", "neg", "mid")[i % 3]
        chars = list(rng.choice(filler, size=int(rng.integers(4, 12))))
        chars.insert(int(rng.integers(0, len(chars) + 1)), MARKS[cls])
        lines.append(f"{cls},{''.join(chars)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One K = 3 finetune stage run on tiny data (committed in a memory store), and its threshold artifact."""
    from safetensors.torch import save as st_save

    from storage.artifacts import ArtifactStore
    from tasks.train import threshold
    from tasks.train.featurize import Featurizer
    from tasks.train.finetune import run_finetune_stage

    data = tmp_path_factory.mktemp("k") / "k.csv"
    _three_class_csv(data)
    cfg = FinetuneConfig(data_uri=str(data), label_column="cat", classes="any", max_len=32, use_layers=2,
                         dropout=0.1, batch_size=16, lr=2e-3, max_epochs=5, patience=3, threads=1, device="cpu")
    mc = _model_cfg()
    torch.manual_seed(1)
    enc_state = weights(LebertForPretraining(mc))
    store = ArtifactStore(f"memory://k-{uuid.uuid4().hex}")
    w = store.begin("pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(enc_state))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lex = store.begin("lexicon", "l1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    feat = _featurizer(32)
    mp = pytest.MonkeyPatch()
    mp.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
    try:
        writer = store.begin("finetune", "f1")
        res = run_finetune_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    finally:
        mp.undo()
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    tw = store.begin("threshold", "t1")
    th = threshold.build(tw, art)
    th_art = tw.commit(code_version="t", config={}, parents=[], stats=th.stats, metrics=th.metrics, rows=th.rows)
    return {"store": store, "art": art, "res": res, "th": th, "th_art": th_art, "feat": feat, "data": data}


def test_kclass_finetune_learns_with_softmax_head_and_records_classes(trained, monkeypatch):
    from tasks.train import loop

    art, m = trained["art"], trained["res"].metrics
    mc = json.loads(art.read_verified("model_config.json"))
    assert mc["classes"] == ["mid", "neg", "pos"]  # sorted order of the distinct values
    assert m["num_classes"] == 3 and m["classes"] == ["mid", "neg", "pos"]
    assert m["test_macro_f1"] > 0.6 and m["dev_macro_f1"] > 0.6, m  # chance is 1/3
    assert m["baseline_test_macro_f1"] is not None and isinstance(m["contaminated_test_rows"], int)
    conf = np.array(m["test_confusion"])
    assert conf.shape == (3, 3) and conf.sum() == m["n_test"]
    assert art.read_verified("confusion.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert "threshold.json" not in art.files() and "threshold_table.parquet" not in art.files()
    made = []
    monkeypatch.setattr("prefect.artifacts.create_table_artifact", lambda **kw: made.append(kw))
    monkeypatch.setattr("prefect.artifacts.create_markdown_artifact", lambda **kw: made.append(kw))
    monkeypatch.setattr(loop, "_in_run", lambda: True)
    trained["res"].publish(art)
    report = made[1]["markdown"]
    assert "test confusion matrix" in report and "| mid |" in report and "confusion.png" in report


def test_threshold_stage_is_skipped_for_three_classes(trained):
    info = json.loads(trained["th_art"].read_verified("threshold.json"))
    assert info["threshold"] is None and "arg-max" in info["rule"] and info["classes"] == ["mid", "neg", "pos"]
    assert "f1_table.parquet" not in trained["th_art"].files()
    assert trained["th"].metrics["threshold"] is None


def _bundle(trained):
    """A bundle holding the trained K = 3 classifier (the fixture bundle's files, this model and its classes)."""
    from safetensors.torch import load as st_load

    from models import LebertClassifier, ModelConfig
    from storage.artifacts import ArtifactStore
    from tasks.prepare.matcher import build_trie, compile_trie
    from tasks.prepare.vocab import SPECIALS
    from tasks.train.bundle import load_bundle
    from tests.bundle_fixture import write_bundle
    from tests.test_finetune import LEX

    store = trained["store"]
    mc = json.loads(trained["art"].read_verified("model_config.json"))
    model = LebertClassifier(ModelConfig.model_validate(mc["model"]), mc["use_layers"], mc["dropout"], num_labels=3)
    model.load_state_dict(st_load(trained["art"].read_verified("model.safetensors")))
    vocab = list(SPECIALS) + CHARS
    words = ["[PAD]", "[UNK]"] + LEX
    trie = build_trie(LEX)
    vectors = np.zeros((len(words), 8), np.float32)
    info = {"max_len": 32, "max_word_num": 2, "threshold": None, "classes": mc["classes"], "metrics": {}}
    st = ArtifactStore(store.uri)
    if not st.is_committed("bundle", "b1"):
        write_bundle(st.begin("bundle", "b1"), {"k": 3}, model, mc, info, vocab, words, vectors,
                     trained["feat"].rank_to_word, trie, compile_trie(trie))
    return load_bundle(f"{store.uri}/bundle/b1")


def test_labelled_output_has_class_names_and_probabilities_that_sum_to_one(trained):
    import pyarrow as pa

    import lexiflow
    from tasks.train.scorer import ClassifierScorer

    bundle = _bundle(trained)
    assert bundle.classes == ["mid", "neg", "pos"] and bundle.threshold is None and bundle.model.num_labels == 3
    texts = ["我们今天好", "东西差", "服务一般", ""]
    frame = lexiflow.label_dataframe(__import__("pandas").DataFrame({"review": texts}), bundle)
    assert list(frame.columns[:7]) == ["row_id", "label", "prob", "prob_mid", "prob_neg", "prob_pos",
                                       "bundle_version"]
    ok = frame[frame["reason"].isna()]
    total = ok[["prob_mid", "prob_neg", "prob_pos"]].sum(axis=1).to_numpy()
    assert np.allclose(total, 1.0, atol=1e-5)
    top = ok[["prob_mid", "prob_neg", "prob_pos"]].to_numpy().argmax(1)
    assert ok["label"].tolist() == [bundle.classes[i] for i in top]
    assert np.allclose(ok["prob"].to_numpy(), ok[["prob_mid", "prob_neg", "prob_pos"]].max(axis=1).to_numpy())
    assert frame["reason"].iloc[3] is not None and __import__("pandas").isna(frame["label"].iloc[3])  # rejected
    # the labeller's part file (Parquet): the same columns, typed
    scorer = ClassifierScorer(bundle, batch_size=8)
    outputs, empty = scorer.score(texts[:3])
    part = scorer.part_table(["a", "b", "c"], outputs)
    assert part.schema.field("label").type == pa.string() and part.schema.field("prob_pos").type == pa.float32()
    assert part.column("label").to_pylist() == ok["label"].tolist() and not empty


def test_label_stream_writes_class_columns_and_reads_back(trained, tmp_path):
    import pyarrow.parquet as pq

    import lexiflow
    from tasks.common.config import LabelOptions
    from tasks.label import label_stream

    bundle = _bundle(trained)
    inp = tmp_path / "in.csv"
    inp.write_text("review\n我们今天好\n东西差\n\n服务一般\n", encoding="utf-8")
    out = tmp_path / "out"
    summary = label_stream(bundle, str(inp), str(out), LabelOptions(), progress=False, threads=1)
    assert summary["stats"]["out"] == 3 and summary["metrics"]["classes"] == ["mid", "neg", "pos"]
    assert summary["metrics"]["threshold"] is None and summary["metrics"]["positive"] is None
    part = pq.read_table(out / "part-00000.parquet")
    assert part.column_names == ["row_id", "label", "prob", "prob_mid", "prob_neg", "prob_pos", "bundle_version"]
    frame = lexiflow.read_labelled(str(out))
    ok = frame[frame["reason"].isna()]
    assert set(ok["label"]) <= {"mid", "neg", "pos"} and len(ok) == 3
    assert np.allclose(ok[["prob_mid", "prob_neg", "prob_pos"]].sum(axis=1), 1.0, atol=1e-5)


def test_int8_gate_with_three_classes_compares_arg_max(trained):
    from tasks.train.scorer import agreement, gated_model, quantized

    bundle = _bundle(trained)
    texts = bundle.heldout_texts()
    share, n = agreement(bundle, quantized(bundle.model), texts)
    assert n == len(texts) and 0.0 <= share <= 1.0
    # the gate passes exactly when the arg-max agreement reaches the required share
    _, check = gated_model(bundle, "int8", min_agreement=share)
    assert check == {"precision": "int8", "agreement": round(share, 6), "agreement_rows": n}
    with pytest.raises(ValueError, match="agree with fp32"):
        gated_model(bundle, "int8", min_agreement=min(1.0, share + 1e-3) if share < 1 else 1.01)


def test_integer_labels_sort_numerically_and_strings_by_code_point(tmp_path):
    from tasks.train.labelled import load_data, sorted_classes

    assert sorted_classes({"10", "2", "1"}) == ["1", "2", "10"]
    assert sorted_classes({"b", "a", "10"}) == ["10", "a", "b"]
    path = tmp_path / "ints.csv"
    rows = ["label,review"] + [f"{(2, 10, 1)[i % 3]},我们{'好差般'[i % 3]}{i}" for i in range(30)] + [",没有标签"]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    data = load_data(FinetuneConfig(data_uri=str(path), classes="any"))
    assert data.classes == ["1", "2", "10"]
    assert data.stats == {"in": 31, "out": 30, "rejected": {"bad_label": 1}}  # an empty label is rejected
    got = {r["text"]: r["label"] for part in (data.train, data.dev, data.test) for r in part}
    assert got["我们好0"] == 1 and got["我们差1"] == 2 and got["我们般2"] == 0  # index into the sorted classes
    with pytest.raises(ValueError, match="at least 2"):
        one = tmp_path / "one.csv"
        one.write_text("label,review\na,我们\na,今天\n", encoding="utf-8")
        load_data(FinetuneConfig(data_uri=str(one), classes="any"))


def test_class_missing_from_dev_is_reported_and_missing_from_train_refused():
    from tasks.train.multiclass import check_classes, macro_f1

    classes = ["a", "b", "c"]
    assert check_classes(classes, np.array([0, 1, 2, 2]), np.array([0, 1, 1])) == ["c"]
    with pytest.raises(ValueError, match=r"\['b'\] have no training row"):
        check_classes(classes, np.array([0, 2, 2]), np.array([0, 1, 2]))
    # macro-F1 averages over the classes present in y: a class absent from dev does not count as a zero
    assert macro_f1(np.array([0, 1, 1]), np.array([0, 1, 1])) == pytest.approx(1.0)


def test_binary_mode_config_dumps_as_before():
    assert "classes" not in FinetuneConfig(data_uri="x.csv").model_dump(mode="json")
    assert FinetuneConfig(data_uri="x.csv", classes="any").model_dump(mode="json")["classes"] == "any"


def test_softmax_rows_is_batch_invariant():
    from models.rowwise import softmax_rows

    z = torch.randn(300, 10, generator=torch.Generator().manual_seed(0))
    full = softmax_rows(z)
    assert torch.equal(full[7:8], softmax_rows(z[7:8]))  # the same bits alone as in a batch of 300
    assert torch.allclose(full.sum(1), torch.ones(300), atol=1e-6)
    assert torch.allclose(full, torch.softmax(z, 1), atol=1e-6)


def test_two_string_classes_train_the_binary_head_and_label_with_class_names(tmp_path):
    from tasks.train.bundle import load_bundle
    from tasks.train.finetune import finetune
    from tasks.train.scorer import ClassifierScorer
    from tests.bundle_fixture import make_tiny_bundle
    from tests.test_finetune import _synthetic_csv

    data = tmp_path / "s.csv"
    _synthetic_csv(data, n=120)
    text = data.read_text(encoding="utf-8").splitlines()
    data.write_text("\n".join([text[0]] + [("pos" if r[0] == "1" else "neg") + r[1:] for r in text[1:]]) + "\n",
                    encoding="utf-8")
    cfg = FinetuneConfig(data_uri=str(data), classes="any", max_len=32, use_layers=2, batch_size=16, lr=2e-3,
                         max_epochs=1, threads=1, device="cpu", combine="none")
    torch.manual_seed(1)
    mc = _model_cfg()
    res = finetune(cfg, _featurizer(32), mc, weights(LebertForPretraining(mc)))
    assert res.data.classes == ["neg", "pos"] and "test_auc" in res.metrics and res.threshold is not None
    # a K = 2 bundle's labelled rows: the class at the threshold, prob_<second> = the binary probability
    bundle = load_bundle(make_tiny_bundle(f"memory://k2-{uuid.uuid4().hex}"))
    bundle.info["classes"] = ["neg", "pos"]
    scorer = ClassifierScorer(bundle, batch_size=8)
    outputs, _ = scorer.score(["这家酒店服务很好", "隔音太差了"])
    part = scorer.part_table(["a", "b"], outputs)
    p = np.asarray(outputs, np.float32)
    assert part.column("prob_pos").to_pylist() == p.tolist()
    assert part.column("label").to_pylist() == ["pos" if x >= bundle.threshold else "neg" for x in p.tolist()]
    assert np.allclose(np.add(part.column("prob_neg").to_numpy(), p), 1.0, atol=1e-6)


def test_model_card_and_export_hf_handle_three_classes(trained, tmp_path):
    from safetensors.torch import load_file

    from tasks.train.export_hf import export_hf
    from tasks.train.model_card import model_card

    card = model_card("v1", "bundle-6", {"finetune": trained["art"].manifest, "threshold": trained["th_art"].manifest})
    assert "3 classes (mid, neg, pos)" in card and "test macro-F1" in card and "| mid |" in card
    assert "arg-max" in card and "prob >=" not in card
    bundle = _bundle(trained)
    export_hf(bundle.uri, tmp_path / "hf", warn=lambda w: None)
    config = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert config["lexiflow"]["classes"] == ["mid", "neg", "pos"]
    head = load_file(str(tmp_path / "hf" / "lexiflow_head.safetensors"))
    assert tuple(head["head.weight"].shape)[0] == 3 and "softmax" in (tmp_path / "hf" / "README.md").read_text()


def test_extra_texts_from_a_k_class_file_are_exactly_its_finetune_train_split(tmp_path):
    from tasks.common.config import ExtraTexts
    from tasks.train.domain import train_texts
    from tasks.train.labelled import load_data

    data = tmp_path / "k.csv"
    _three_class_csv(data, n=90)
    ft = load_data(FinetuneConfig(data_uri=str(data), label_column="cat", classes="any"))
    texts = train_texts(ExtraTexts(data_uri=str(data), label_column="cat", classes="any"))
    assert texts == [r["text"] for r in ft.train] and len(texts) == 72
    assert "classes" not in ExtraTexts(data_uri="x.csv").model_dump()  # binary: the pretrain version is unchanged
