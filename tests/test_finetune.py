"""Fine-tuning: padding-free pooling, pretrained-encoder loading, tiny end-to-end stage run."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch

from models import LebertClassifier, LebertForPretraining, ModelConfig
from tasks.common.labelled import read_labelled
from tasks.finetune.config import FinetuneConfig
from tasks.finetune.train import finetune, run_finetune_stage
from tasks.training.checkpoint import weights
from tests.reporting import Recording
from tests.staging import begin

# ----------------------------------------------------------------------------- tiny model / featurizer

CHARS = list("我们今天去吃饭店里的东西还可以服务一般真好差")
LEX = ["饭店", "今天", "服务", "东西", "还可以"]


def _featurizer(max_len=64):
    from tasks.text.featurize import Featurizer
    from tasks.text.matcher import build_trie, compile_trie
    from tasks.text.vocab import SPECIALS

    vocab = list(SPECIALS) + CHARS
    words = ["[PAD]", "[UNK]"] + LEX
    return Featurizer.build(vocab, LEX, words, compile_trie(build_trie(LEX)), 2, max_len)


def _model_cfg(**kw):
    base = dict(vocab_size=6 + len(CHARS), hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_len=64,
                hidden_dropout=0.1, attention_dropout=0.1, word_vocab_size=2 + len(LEX), word_dim=8, max_word_num=2)
    base.update(kw)
    return ModelConfig(**base)


# ----------------------------------------------------------------------------- model


def test_mean_max_pooling_ignores_padding():
    torch.manual_seed(0)
    m = LebertClassifier(_model_cfg(), use_layers=5).eval()  # clamped to 2
    assert m.use_layers == 2
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    words = torch.randint(0, 7, (1, 5, 2))
    a = m(ids, torch.ones(1, 5, dtype=torch.bool), words)
    pad_ids = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], 1)
    pad_mask = torch.arange(11)[None] < 5
    pad_words = torch.cat([words, torch.randint(0, 7, (1, 6, 2))], 1)  # junk under padding
    b = m(pad_ids, pad_mask, pad_words)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # the same sequence inside a batch with a longer one
    other = torch.randint(5, 20, (1, 11))
    full = torch.ones(1, 11, dtype=torch.bool)
    c = m(torch.cat([pad_ids, other]), torch.cat([pad_mask, full]), torch.cat([pad_words, pad_words]))
    torch.testing.assert_close(a, c[:1], atol=1e-6, rtol=1e-6)


def test_load_pretrained_encoder_strict_with_clear_error():
    cfg = _model_cfg()
    pre = LebertForPretraining(cfg)
    sd = weights(pre)  # tied decoder stored once, as in the pretrain artifact
    clf = LebertClassifier(cfg)
    clf.load_pretrained_encoder(sd)
    for k, v in clf.encoder.state_dict().items():
        assert torch.equal(v, pre.encoder.state_dict()[k]), k
    broken = {k: v for k, v in sd.items() if k != "encoder.blocks.1.ln2.bias"}
    broken["encoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['blocks.1.ln2.bias'\].*unexpected \['extra.weight'\]"):
        clf.load_pretrained_encoder(broken)


# ----------------------------------------------------------------------------- end to end


def _synthetic_csv(path, n=320, seed=0):
    rng = np.random.default_rng(seed)
    filler = [c for c in CHARS if c not in "好差"]
    lines = ["label,review"]
    for i in range(n):
        y = i % 2
        chars = list(rng.choice(filler, size=int(rng.integers(4, 14))))
        chars.insert(int(rng.integers(0, len(chars) + 1)), "好" if y else "差")
        lines.append(f"{y},{''.join(chars)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_tiny_end_to_end_stage_is_deterministic_and_learns(tmp_path, monkeypatch):
    import pickle

    import pyarrow.parquet as pq
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from storage.artifacts import ArtifactStore
    from tasks.common.stage import StageResult
    from tasks.text.featurize import Featurizer

    data = tmp_path / "s.csv"
    _synthetic_csv(data)
    cfg = FinetuneConfig(data_uri=str(data), max_len=32, use_layers=2, dropout=0.1, batch_size=16, lr=2e-3,
                         max_epochs=6, patience=3, threads=1, device="cpu", max_eval_rows=30,
                         combine="none")  # the encoder's own outputs (the stacked ones: test_baseline.py)
    mc = _model_cfg()
    torch.manual_seed(1)
    enc_state = weights(LebertForPretraining(mc))
    feat = _featurizer(32)

    # an in-memory store holding a "pretrain" artifact and a stand-in lexicon artifact
    store = ArtifactStore(f"memory://ft-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(enc_state))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lex = begin(store, "lexicon", "l1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    monkeypatch.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)

    writer = begin(store, "finetune", "f1")
    res = run_finetune_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    assert isinstance(res, StageResult)
    assert res.stats == {"in": 320, "out": 320, "rejected": {}}
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    with art.open("epochs.parquet") as f:
        log = pq.read_table(f).to_pylist()

    m = res.metrics
    assert m["dev_auc"] > 0.9 and m["test_auc"] > 0.9, log
    assert (m["n_train"], m["n_dev"], m["n_test"]) == (256, 30, 30)
    assert m["capped"] == {"train": 0, "dev": 2, "test": 2}
    assert [r["epoch"] for r in log] == list(range(1, len(log) + 1))
    assert list(log[0]) == ["epoch", "train_loss", "train_auc", "dev_loss", "dev_auc", "lr", "best_threshold", "dev_f1",
                            "improved"]
    for prev, row in zip(log, log[1:]):  # LR decays exactly on non-improving epochs
        assert row["lr"] == pytest.approx(prev["lr"] * (1.0 if prev["improved"] else 0.8))
    th = json.loads(art.read_verified("threshold.json"))
    assert th["epoch"] == m["best_epoch"]
    assert th["threshold"] == m["threshold"] == log[m["best_epoch"] - 1]["best_threshold"]
    assert set(art.files()) >= {"model.safetensors", "model_config.json", "epochs.parquet", "curves.png",
                                "threshold.json", "threshold_table.parquet", "test_predictions.parquet",
                                "dev_predictions.parquet"}
    assert art.read_verified("curves.png")[:8] == b"\x89PNG\r\n\x1a\n"

    # publish: picklable (it may cross a worker boundary), a no-op outside a run, the epoch table inside one
    publish = pickle.loads(pickle.dumps(res.publish))
    idle = Recording(active=False)
    publish(art, idle)
    assert idle.made == []  # no UI: nothing published
    rec = Recording()
    publish(art, rec)
    made = rec.artifacts
    assert [k["key"] for k in made] == ["finetune-epochs", "finetune-report"]
    assert made[0]["table"] == [{k: v for k, v in r.items() if k != "improved"} for r in log]
    assert f"best epoch {m['best_epoch']}" in made[1]["markdown"] and art.uri in made[0]["description"]

    # the written classifier reloads (as the bundle does) and reproduces the test probabilities
    mcj = json.loads(art.read_verified("model_config.json"))
    clf = LebertClassifier(ModelConfig.model_validate(mcj["model"]), mcj["use_layers"], mcj["dropout"])
    clf.load_state_dict(st_load(art.read_verified("model.safetensors")))
    clf.eval()
    with art.open("test_predictions.parquet") as f:
        pred = pq.read_table(f).to_pylist()
    rows, _ = read_labelled(str(data), cfg)
    by_id = {r["row_id"]: r for r in rows}
    e = feat.encode([by_id[pred[0]["row_id"]]["text"]])[0]
    with torch.no_grad():
        p0 = torch.sigmoid(clf(torch.from_numpy(e.input_ids)[None], None, torch.from_numpy(e.word_ids)[None]))
    assert float(p0) == pytest.approx(pred[0]["prob"], abs=1e-5)
    assert pred[0]["label"] == by_id[pred[0]["row_id"]]["label"]

    # run-to-run determinism on CPU
    again = finetune(cfg, feat, mc, enc_state)
    assert again.train.log == log
    assert again.metrics == m and "wall_s" not in m  # the wall time is measured: the manifest's run section
    assert again.run["wall_s"] >= 0


def test_head_tail_truncation_keeps_both_ends_and_matches_words_in_what_it_keeps():
    from dataclasses import replace

    head = _featurizer(max_len=10)  # 8 tokens between [CLS] and [SEP]
    both = replace(head, truncation="head_tail")
    text = "今天去吃饭店里的东西还可以"  # 13 characters
    assert head.tokens(text) == "今天去吃饭店里的"
    assert both.tokens(text) == "今天去吃" + "西还可以"  # the first and the last four
    assert both.tokens("今天去吃饭") == head.tokens("今天去吃饭") == "今天去吃饭"  # short texts are not cut
    words = {w for e in both.encode([text]) for w in e.word_ids.ravel().tolist() if w}
    assert words == {2 + LEX.index("今天"), 2 + LEX.index("还可以")}  # 饭店 and 东西 were cut out
    assert len(both.encode([text])[0].input_ids) == 10
    with pytest.raises(ValueError, match="truncation 'middle': expected head or head_tail"):
        replace(head, truncation="middle")  # refused when built, before any text is cut
