"""Any number of classes (``finetune.classes: any``): K-class fine-tuning learns, the stack of the encoder with the
multinomial TF-IDF baseline is fitted on dev and shipped, the threshold stage is skipped, labelled outputs carry the
class name and every class's probability, the int8 gate compares arg-maxes, explain attributes the arg-max class,
string and integer labels, a class missing from dev or train; binary-mode configs dump as they always did."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch

from models import LebertForPretraining
from tasks.finetune.config import FinetuneConfig
from tasks.training.checkpoint import weights
from tests.reporting import Recording
from tests.staging import begin
from tests.test_finetune import CHARS, _featurizer, _model_cfg

MARKS = {"neg": "差", "mid": "般", "pos": "好"}  # class -> the character that decides it


def _three_class_csv(path, n=300, seed=0, noise=0.0):
    """``n`` rows, the class decided by one character; ``noise``: that share of rows gets a random label instead
    (so no model is perfect, and the shipped, encoder-alone and baseline figures can differ)."""
    rng = np.random.default_rng(seed)
    filler = [c for c in CHARS if c not in "好差般"]
    lines = ["cat,review"]
    for i in range(n):
        cls = ("pos", "neg", "mid")[i % 3]
        chars = list(rng.choice(filler, size=int(rng.integers(4, 12))))
        chars.insert(int(rng.integers(0, len(chars) + 1)), MARKS[cls])
        label = str(rng.choice(["pos", "neg", "mid"])) if rng.random() < noise else cls
        lines.append(f"{label},{''.join(chars)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One K = 3 finetune stage run on tiny data (committed in a memory store), and its threshold artifact."""
    from safetensors.torch import save as st_save

    from storage.artifacts import ArtifactStore
    from tasks.finetune import threshold
    from tasks.finetune.train import run_finetune_stage
    from tasks.text.featurize import Featurizer
    from tasks.text.vocab import vocab_bytes
    from tests.test_finetune import LEX

    data = tmp_path_factory.mktemp("k") / "k.csv"
    _three_class_csv(data, noise=0.15)
    cfg = FinetuneConfig(data_uri=str(data), label_column="cat", classes="any", max_len=32, use_layers=2,
                         dropout=0.1, batch_size=16, lr=2e-3, max_epochs=5, patience=3, threads=1, device="cpu")
    mc = _model_cfg()
    torch.manual_seed(1)
    enc_state = weights(LebertForPretraining(mc))
    store = ArtifactStore(f"memory://k-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(enc_state))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lw = begin(store, "lexicon", "l1")
    lw.write_bytes("words.txt", vocab_bytes(["[PAD]", "[UNK]", *LEX]))  # what finetune-explain names words with
    lex = lw.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    feat = _featurizer(32)
    mp = pytest.MonkeyPatch()
    mp.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
    try:
        writer = begin(store, "finetune", "f1")
        res = run_finetune_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    finally:
        mp.undo()
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    tw = begin(store, "threshold", "t1")
    th = threshold.build(tw, art)
    th_art = tw.commit(code_version="t", config={}, parents=[], stats=th.stats, metrics=th.metrics, rows=th.rows)
    return {"store": store, "art": art, "res": res, "th": th, "th_art": th_art, "feat": feat, "data": data}


def test_kclass_finetune_learns_with_softmax_head_and_records_classes(trained):
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
    rec = Recording()
    trained["res"].publish(art, rec)
    made = [kw for kind, kw in rec.made if kind in ("table", "md")]
    report = made[1]["markdown"]
    assert "test confusion matrix" in report and "| mid |" in report and "confusion.png" in report
    assert "Shipped against the baseline: test macro-F1" in report
    # the explained dev examples (most confident right / wrong), gold and predicted as class names
    (explained,) = [m for m in made if m.get("key") == "finetune-explain"]
    assert "data:image/png;base64," in explained["markdown"]
    assert any(f"gold {c}, predicted" in explained["markdown"] for c in ("mid", "neg", "pos"))


def test_kclass_stage_stacks_the_encoder_with_the_multinomial_baseline(trained):
    import pyarrow.parquet as pq

    from tasks.inference.blend import BaselineModel, KBlend, blend_from_dict

    art, m = trained["art"], trained["res"].metrics
    assert m["combine"] == "stack" and 0 < m["blend_fit_rows"] <= m["n_dev"]
    blend = blend_from_dict(json.loads(art.read_verified("blend.json")))
    assert isinstance(blend, KBlend) and np.asarray(blend.weights).shape == (3, 6) and len(blend.bias) == 3
    assert blend.to_dict() == m["blend"]
    base = BaselineModel.from_table(pq.read_table(__import__("io").BytesIO(art.read_verified("baseline.parquet"))))
    assert base.num_classes == 3 and base.coef.shape[1] == 3
    # the shipped, the encoder alone and the baseline, each scored on the same test rows
    for key in ("test_macro_f1", "encoder_test_macro_f1", "baseline_test_macro_f1"):
        assert 0.0 <= m[key] <= 1.0, key
    probs, preds = _test_predictions(art)
    assert probs.shape == (m["n_test"], 3) and np.allclose(probs.sum(1), 1.0, atol=1e-5)
    pred, gold = preds.column("pred").to_numpy(), preds.column("label").to_numpy()
    assert m["test_accuracy"] == pytest.approx(float((pred == gold).mean()), abs=1e-6)  # the shipped one's
    report = __import__("tasks.finetune.report", fromlist=["x"]).comparison_markdown(m)
    assert "shipped (encoder + baseline) | encoder alone | baseline" in report and "Contamination" in report


def _test_predictions(art):
    """(the stage's shipped test probabilities float32 [n, K] in heldout.parquet's row order, the predictions table)."""
    import io

    import pyarrow.parquet as pq

    preds = pq.read_table(io.BytesIO(art.read_verified("test_predictions.parquet")))
    held = pq.read_table(io.BytesIO(art.read_verified("heldout.parquet")))
    by_id = dict(zip(preds.column("row_id").to_pylist(), preds.column("probs").to_pylist()))
    return np.asarray([by_id[i] for i in held.column("row_id").to_pylist()], np.float32), preds


def test_multinomial_baseline_arrays_give_sklearns_decision_values_row_by_row():
    from tasks.finetune.baseline import fit_baseline
    from tasks.inference.blend import BaselineModel

    rng = np.random.default_rng(3)
    texts = ["".join(rng.choice(list("好差般我们酒店服务一 ab"), size=int(rng.integers(1, 15)))) for _ in range(90)]
    y = np.arange(90) % 4
    sk = fit_baseline(texts, y, multinomial=True)
    model = BaselineModel.from_sklearn(sk)
    probe = texts[:30] + ["", "未见过的字", "AB  好"]
    z = model.logits(probe)
    assert z.shape == (33, 4)
    np.testing.assert_allclose(z, sk.decision_function(probe), rtol=0, atol=1e-9)  # two computations: to 1e-9
    # by design a text's logits are a sequential sum over its own n-grams: the same bits alone as in any batch,
    # and exactly the plain-Python sequential sum
    assert np.array_equal(model.logits([probe[5]])[0], z[5])
    js, vs, norm = model._grams(probe[5])
    seq = [0.0] * 4
    for j, v in zip(js, vs):
        seq = [a + v * float(model.coef[j, c]) for c, a in enumerate(seq)]
    assert [s / norm + float(model.intercept[c]) for c, s in enumerate(seq)] == z[5].tolist()
    assert np.array_equal(z[30], model.intercept)  # no known n-gram: the intercepts themselves, no arithmetic
    again = BaselineModel.from_table(model.to_table())  # Parquet form round-trips the float64 arrays exactly,
    assert np.array_equal(again.logits(probe), z) and again.ngrams == model.ngrams  # so the same sums run twice


def test_kblend_is_row_invariant_and_refuses_a_class_it_never_saw():
    from tasks.finetune.baseline import fit_kblend
    from tasks.inference.blend import blend_from_dict

    rng = np.random.default_rng(0)
    y = np.arange(200) % 3
    z_enc = rng.normal(size=(200, 3)) + 2.0 * np.eye(3)[y]
    z_base = rng.normal(size=(200, 3)) + 1.0 * np.eye(3)[y]
    blend = fit_kblend(y, z_enc, z_base, 3)
    p = blend.prob(z_enc, z_base)
    assert p.dtype == np.float32 and p.shape == (200, 3)
    # the promise under test (row invariance, by design: elementwise products in a fixed order, padded softmax):
    assert np.array_equal(blend.prob(z_enc[17:18], z_base[17:18])[0], p[17])  # the same bits alone as in a batch
    assert (p.argmax(1) == y).mean() > (z_enc.argmax(1) == y).mean()  # two noisy views beat one
    w = np.asarray(blend.weights)
    np.testing.assert_allclose(blend.logits(z_enc, z_base), np.c_[z_enc, z_base] @ w.T + blend.bias, atol=1e-12)
    assert blend_from_dict(json.loads(json.dumps(blend.to_dict()))) == blend
    with pytest.raises(ValueError, match=r"class index\(es\) \[2\]"):
        fit_kblend(y[y < 2], z_enc[y < 2], z_base[y < 2], 3)


def test_stack_rows_prefer_unseen_dev_rows_and_skip_when_dev_lacks_a_class():
    from tasks.finetune.heads import stack_rows

    y = np.array([0, 1, 2, 0, 1, 2])
    unseen = np.array([True, True, True, False, True, False])
    rows, note = stack_rows(y, unseen, 3)
    assert rows.tolist() == unseen.tolist() and note is None
    rows, note = stack_rows(y, np.array([True, True, False, True, True, False]), 3)  # unseen rows lack class 2
    assert rows.all() and note is None
    rows, note = stack_rows(np.array([0, 1, 1]), np.ones(3, bool), 3)
    assert rows is None and "lacks a class" in note


def test_residual_is_refused_for_three_classes_and_classes_any_has_its_own_code_version():
    from tasks.finetune import train as ft
    from tasks.finetune.heads import check_combine

    cfg = FinetuneConfig(data_uri="x.csv", classes="any", combine="residual")
    with pytest.raises(ValueError, match="residual is implemented for two classes only"):
        check_combine(cfg)  # refused before any data is read
    assert ft.code_version(FinetuneConfig(data_uri="x.csv")) == ft.CODE_VERSION  # binary versions unchanged
    assert ft.code_version(cfg) == ft.CLASSES_CODE_VERSION != ft.CODE_VERSION


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
    from tasks.bundle.bundle import BLEND_FILES
    from tasks.inference.bundle import load_bundle
    from tasks.text.matcher import build_trie, compile_trie
    from tasks.text.vocab import SPECIALS
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
    art = trained["art"]
    stacked = {f: art.read_verified(f) for f in BLEND_FILES if f in art.files()}  # the stage's stack, as bundled
    if not st.is_committed("bundle", "b1"):
        write_bundle(begin(st, "bundle", "b1"), {"k": 3}, model, mc, info, vocab, words, vectors,
                     trained["feat"].rank_to_word, trie, compile_trie(trie), extra=stacked)
    return load_bundle(f"{store.uri}/bundle/b1")


def test_labelled_output_has_class_names_and_probabilities_that_sum_to_one(trained):
    import pyarrow as pa

    import lexiflow
    from tasks.inference.sentiment import ClassifierScorer

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


def test_stacked_bundle_labels_what_the_stage_measured(trained):
    from tasks.inference.sentiment import ClassifierScorer, _score_encoded

    bundle = _bundle(trained)
    assert bundle.blend is not None and bundle.baseline is not None
    import io

    import pyarrow.parquet as pq

    held = pq.read_table(io.BytesIO(trained["art"].read_verified("heldout.parquet")))
    texts = held.column("review").to_pylist()  # the stage's test rows
    stage_prob, _ = _test_predictions(trained["art"])
    got, empty = ClassifierScorer(bundle, batch_size=8, threads=1).score(texts)
    got = np.asarray(got)
    assert not empty and got.shape == (len(texts), 3)
    # the labeller's path and the stage's training-time path are two computations: close, not equal
    np.testing.assert_allclose(got, stage_prob, atol=1e-4)
    alone = _score_encoded(bundle.model, bundle.featurizer.encode(texts), 8)  # the encoder alone differs
    assert np.abs(alone - got).max() > 1e-3
    # by design a text's K probabilities are the same bits alone as in any batch (baseline, stack and softmax too)
    scorer = ClassifierScorer(bundle, batch_size=3, threads=1)
    for i in (0, 7, len(texts) - 1):
        (one,), _ = scorer.score([texts[i]])
        assert np.array_equal(one, got[i]), i
    some, _ = scorer.score(texts[2:9])  # batches of 3 (and what is left), against batches of 8
    assert np.array_equal(np.asarray(some), got[2:9])


def test_explain_attributes_the_arg_max_class_of_a_stacked_three_class_bundle(trained):
    from tasks.inference.explain_bundle import explain_text, labelled_prob

    bundle = _bundle(trained)
    words = ["[PAD]", "[UNK]", *__import__("tests.test_finetune", fromlist=["LEX"]).LEX]
    text = "我们今天好"
    probs = labelled_prob(bundle, text)
    ex = explain_text(bundle, text, words)
    c = int(np.argmax(probs))
    assert ex.label == bundle.classes[c] and ex.threshold is None and ex.prob == float(probs[c])
    assert ex.prob_forward == pytest.approx(ex.prob, abs=1e-4) and ex.blended
    assert len(ex.attribution) == len(ex.tokens) and np.isfinite(ex.attribution["attribution"]).all()
    assert "arg-max" in __import__("tasks.inference.explain", fromlist=["x"])._title(ex, 0, len(ex.tokens))
    # the attribution is the derivative of (shipped logit of the label - mean of the K shipped logits) along each
    # character's embedding: checked against central finite differences of the whole stacked model (two
    # computations: to a tolerance)
    from tasks.common.text import normalize_text

    enc = bundle.featurizer.encode([text])[0]
    z_base = bundle.baseline.logits([normalize_text(text)])

    def centred(pos: int, eps: float) -> float:
        def scale(_mod, _args, out):
            out = out.clone()
            out[0, pos] = out[0, pos] * (1 + eps)
            return out

        hook = bundle.model.encoder.embeddings.token.register_forward_hook(scale)
        try:
            ids = torch.from_numpy(np.asarray(enc.input_ids, np.int64))[None]
            with torch.no_grad():
                z = bundle.model.eval()(ids, attention_mask=ids != 0,
                                        word_ids=torch.from_numpy(np.asarray(enc.word_ids, np.int64))[None])
        finally:
            hook.remove()
        shipped = bundle.blend.logits(z.double().numpy(), z_base)[0]
        return float(shipped[c] - shipped.mean())

    fd = [(centred(p, 1e-2) - centred(p, -1e-2)) / 2e-2 for p in range(1, len(ex.tokens) + 1)]
    np.testing.assert_allclose(ex.attribution["attribution"].to_numpy(), fd, atol=2e-3 * max(1.0, np.abs(fd).max()))


def test_label_stream_writes_class_columns_and_reads_back(trained, tmp_path):
    import pyarrow.parquet as pq

    import lexiflow
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    bundle = _bundle(trained)
    inp = tmp_path / "in.csv"
    inp.write_text("review\n我们今天好\n东西差\n\n服务一般\n", encoding="utf-8")
    out = tmp_path / "out"
    summary = label_stream(bundle, str(inp), str(out), LabelOptions(), progress=False, threads=1)
    assert summary["stats"]["out"] == 3 and summary["metrics"]["classes"] == ["mid", "neg", "pos"]
    assert summary["metrics"]["threshold"] is None and summary["metrics"]["positive"] is None
    part = pq.read_table(out / "part-00000.parquet")
    assert part.column_names == ["row_id", "label", "prob", "prob_mid", "prob_neg", "prob_pos", "bundle_version",
                                 "no_cjk", "truncated_at"]
    frame = lexiflow.read_labelled(str(out))
    ok = frame[frame["reason"].isna()]
    assert set(ok["label"]) <= {"mid", "neg", "pos"} and len(ok) == 3
    assert np.allclose(ok[["prob_mid", "prob_neg", "prob_pos"]].sum(axis=1), 1.0, atol=1e-5)


def test_int8_gate_with_three_classes_compares_arg_max(trained):
    from tasks.inference.sentiment import agreement, gated_model, quantized

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
    from tasks.common.labelled import load_data, sorted_classes

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
    from tasks.finetune.heads import check_classes
    from tasks.finetune.metrics import macro_f1

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
    from tasks.finetune.train import finetune
    from tasks.inference.bundle import load_bundle
    from tasks.inference.sentiment import ClassifierScorer
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

    from tasks.bundle.export_hf import export_hf
    from tasks.bundle.model_card import model_card

    card = model_card("v1", "bundle-6", {"finetune": trained["art"].manifest, "threshold": trained["th_art"].manifest})
    assert "3 classes (mid, neg, pos)" in card and "test macro-F1" in card and "| mid |" in card
    assert "arg-max" in card and "prob >=" not in card
    bundle = _bundle(trained)
    warned = []
    export_hf(bundle.uri, tmp_path / "hf", warn=warned.append)
    config = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    assert config["lexiflow"]["classes"] == ["mid", "neg", "pos"]
    # the stack travels with the export, said in config.json, the README and a warning
    assert np.asarray(config["lexiflow"]["stacked"]["weights"]).shape == (3, 6)
    assert (tmp_path / "hf" / "lexiflow_blend.json").read_bytes() == trained["art"].read_verified("blend.json")
    assert (tmp_path / "hf" / "lexiflow_baseline.parquet").exists() and any("stacks" in w for w in warned)
    assert "shipped classifier is stacked" in (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    head = load_file(str(tmp_path / "hf" / "lexiflow_head.safetensors"))
    assert tuple(head["head.weight"].shape)[0] == 3 and "softmax" in (tmp_path / "hf" / "README.md").read_text()


def test_extra_texts_from_a_k_class_file_are_exactly_its_finetune_train_split(tmp_path):
    from tasks.common.labelled import load_data
    from tasks.pretrain.config import ExtraTexts
    from tasks.pretrain.domain import train_texts

    data = tmp_path / "k.csv"
    _three_class_csv(data, n=90)
    ft = load_data(FinetuneConfig(data_uri=str(data), label_column="cat", classes="any"))
    texts = train_texts(ExtraTexts(data_uri=str(data), label_column="cat", classes="any"))
    assert texts == [r["text"] for r in ft.train] and len(texts) == 72
    assert "classes" not in ExtraTexts(data_uri="x.csv").model_dump()  # binary: the pretrain version is unchanged


def test_paired_macro_f1_difference_brackets_the_observed_gap():
    from tasks.finetune.metrics import macro_f1, paired_macro_f1_difference

    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 400)
    good = np.where(rng.random(400) < 0.85, y, rng.integers(0, 4, 400))
    poor = np.where(rng.random(400) < 0.55, y, rng.integers(0, 4, 400))
    vs = paired_macro_f1_difference(y, good, poor, 4, resamples=300, seed=0)
    assert vs["diff"] == pytest.approx(macro_f1(y, good) - macro_f1(y, poor), abs=1e-6)
    assert 0 < vs["ci95"][0] < vs["diff"] < vs["ci95"][1] and vs["p_not_better"] == 0.0
    # the vectorised per-resample macro-F1 is sklearn's on the same resample (two computations: to 1e-12)
    rows = np.random.default_rng(0).integers(0, 400, (300, 400))
    d0 = macro_f1(y[rows[0]], good[rows[0]]) - macro_f1(y[rows[0]], poor[rows[0]])
    same = paired_macro_f1_difference(y, good, poor, 4, resamples=1, seed=0)
    assert same["ci95"][0] == pytest.approx(d0, abs=1e-6)
    tie = paired_macro_f1_difference(y, good, good, 4, resamples=50)
    assert tie["diff"] == 0 and tie["ci95"] == [0, 0] and tie["p_not_better"] == 1.0
    assert paired_macro_f1_difference(np.zeros(0, int), good[:0], good[:0], 4) is None


def test_confusion_png_draws_cjk_class_names_as_indices_with_the_bundled_font_only():
    import warnings

    from tasks.common.plots import confusion_png, drawable

    assert drawable("mid") and not drawable("书籍")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns per missing glyph: none may be drawn as a box
        png = confusion_png([[3, 1], [0, 4]], ["书籍", "平板"], "test confusion")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert png == confusion_png([[3, 1], [0, 4]], ["书籍", "平板"], "test confusion")  # the same call twice


def test_pipeline_summary_of_a_kclass_bundle_names_its_figures_and_why_the_gate_refused(tmp_path):
    from flows.config import PipelineConfig, load_config
    from storage.artifacts import ArtifactStore
    from tasks.evaluate.summary import summary_lines

    store = ArtifactStore(str(tmp_path / "s"))
    stats = {"in": 0, "out": 0, "rejected": {}}
    pre = begin(store, "pretrain", "p1").commit(code_version="t", config={}, parents=[], stats=stats,
                                               metrics={"first_mlm_loss": 8.0, "last_mlm_loss": 6.0})
    m = {"test_macro_f1": 0.81, "test_accuracy": 0.85, "encoder_test_macro_f1": 0.75, "encoder_test_accuracy": 0.8,
         "baseline_test_macro_f1": 0.78, "baseline_test_accuracy": 0.83, "combine": "stack", "best_epoch": 2,
         "blend": {"weights": [[1.0]], "bias": [0.0]}, "contaminated_test_rows": 3, "contaminated_dev_rows": 1,
         "n_clean_test": 17, "clean_test_macro_f1": 0.8, "clean_test_accuracy": 0.84,
         "encoder_clean_test_macro_f1": 0.7, "encoder_clean_test_accuracy": 0.79,
         "baseline_clean_test_macro_f1": 0.77, "baseline_clean_test_accuracy": 0.82,
         "test_macro_f1_vs_baseline": {"diff": 0.03, "ci95": [0.01, 0.05], "p_not_better": 0.0, "resamples": 1000,
                                       "seed": 42}}
    ft = begin(store, "finetune", "f1").commit(code_version="t", config={}, parents=[pre.ref], stats=stats, metrics=m)
    bundle = begin(store, "bundle", "b1").commit(code_version="t", config={}, parents=[ft.ref], stats=stats,
                                                metrics={"threshold": None, "test_macro_f1": 0.81})
    cfg = load_config(PipelineConfig, "configs/demo.yaml",
                      [f"store_uri={store.uri}", "label.input_uri=null", "promote.alias=production",
                       "promote.metric=test_auc"])
    text = "\n".join(summary_lines(cfg, bundle.ref))
    assert "test metrics:    macro_f1=0.8100, accuracy=0.8500  (arg-max over the classes, best epoch 2" in text
    assert "encoder alone:   macro_f1=0.7500, accuracy=0.8000" in text
    assert "baseline (same rows): TF-IDF char 1-2-gram LR macro_f1=0.7800, accuracy=0.8300" in text
    assert "vs baseline:     test macro-F1 +0.0300" in text and "above the baseline" in text
    assert ("On the 17 test rows whose text is not among the training rows: shipped macro-F1 0.8000, accuracy "
            "0.8400; encoder alone macro-F1 0.7000, accuracy 0.7900; baseline macro-F1 0.7700") in text
    assert ("bundle@production: still None  (gate not passed: the new bundle has no metric 'test_auc' (it has "
            "test_macro_f1; set promote.metric to one of them))") in text


def test_kclass_comparison_says_why_it_was_not_stacked():
    from tasks.finetune.report import comparison_markdown

    m = {"combine": "none", "blend": None, "combine_note": "the dev split lacks a class: not stacked, the encoder "
         "alone is shipped", "test_macro_f1": 0.7, "baseline_test_macro_f1": 0.72, "n_train": 10}
    out = comparison_markdown(m)
    assert "| metric | shipped (encoder alone) | baseline |" in out and "dev split lacks a class" in out
    assert "encoder alone |" not in out.split("\n")[0].replace("shipped (encoder alone)", "")


def test_kclass_combine_none_and_a_dev_split_without_a_class_ship_the_encoder_alone(tmp_path):
    from tasks.finetune.train import finetune

    data = tmp_path / "k.csv"
    _three_class_csv(data, n=90)
    mc = _model_cfg()
    torch.manual_seed(1)
    enc = weights(LebertForPretraining(mc))
    base = dict(label_column="cat", classes="any", max_len=32, use_layers=2, batch_size=16, lr=2e-3, max_epochs=1,
                threads=1, device="cpu")
    res = finetune(FinetuneConfig(data_uri=str(data), combine="none", **base), _featurizer(32), mc, enc)
    assert res.metrics["combine"] == "none" and res.blend is None and res.baseline is None
    assert res.metrics["encoder_test_macro_f1"] == res.metrics["test_macro_f1"]
    # a dev file without one class: the stack could not weigh it, so it is not fitted, and the run says so
    lines = data.read_text(encoding="utf-8").splitlines()
    train, dev = tmp_path / "train.csv", tmp_path / "dev.csv"
    train.write_text("\n".join(lines[:61]) + "\n", encoding="utf-8")
    dev.write_text("\n".join([lines[0]] + [r for r in lines[61:] if not r.startswith("mid,")]) + "\n", encoding="utf-8")
    res = finetune(FinetuneConfig(train_uri=str(train), dev_uri=str(dev), test_uri=str(dev), **base),
                   _featurizer(32), mc, enc)
    assert res.metrics["combine"] == "none" and res.blend is None and res.metrics["dev_missing_classes"] == ["mid"]
    assert "lacks a class" in res.metrics["combine_note"]
