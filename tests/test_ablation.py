"""The honest ablation machinery: two separately pretrained encoders (adapter on/off), fine-tuned and NER-trained
the same way, beside the baseline / HMM and the contamination count; tiny real data, real training."""

from __future__ import annotations

import numpy as np

from tasks.evaluate.ablation import markdown, ner_rows, overlap, pretrain_variants, sentiment_rows, warn
from tasks.finetune.config import FinetuneConfig
from tasks.ner.config import NerConfig
from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.data import rows_of
from tasks.pretrain.domain import text_rows
from tasks.text.featurize import Featurizer
from tasks.text.matcher import build_trie, compile_trie
from tasks.text.vocab import SPECIALS

GOOD, BAD, FILL = ["很好", "干净", "满意"], ["很差", "脏乱", "失望"], list("房间酒店服务前台早餐")
LEX = GOOD + BAD + ["酒店", "房间", "前台", "早餐"]


def _featurizer() -> Featurizer:
    chars = sorted(set("".join(GOOD + BAD + FILL + LEX)) | set("北京上海"))
    return Featurizer.build(list(SPECIALS) + chars, LEX, ["[PAD]", "[UNK]"] + LEX, compile_trie(build_trie(LEX)), 2,
                            64)


def _reviews(n: int, seed: int) -> list[tuple[int, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        y = int(rng.integers(0, 2))
        words = list(rng.choice(FILL, size=4)) + [str(rng.choice(GOOD if y else BAD))]
        rng.shuffle(words)
        out.append((y, "".join(words) + "。" + "".join(rng.choice(FILL, size=3)) + "。"))
    return out


def test_two_separately_pretrained_encoders_side_by_side(tmp_path):
    feat = _featurizer()
    reviews = _reviews(160, 0)
    csv = tmp_path / "s.csv"
    csv.write_text("label,review\n" + "".join(f"{y},{t}\n" for y, t in reviews), encoding="utf-8")
    rows = text_rows([t for _, t in reviews], feat, "d")
    pcfg = PretrainConfig.model_validate({
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
        "data": {"max_seq_len": 32, "batch_size": 8, "shuffle_buffer": 16, "bucket_batches": 2, "heldout_frac": 0.2},
        "steps": 6, "warmup_steps": 1, "log_every": 3, "eval_every": 3, "eval_batches": 2, "threads": 1})
    wv = np.random.default_rng(1).normal(size=(len(LEX) + 2, 8)).astype(np.float32)
    variants = pretrain_variants(pcfg, rows_of(rows), len(feat.vocab_index), wv, 2)
    on, off = variants["adapter on"], variants["adapter off"]
    assert on["model_cfg"].use_adapter and not off["model_cfg"].use_adapter
    assert any("adapter" in k for k in on["state"]) and not any("adapter" in k for k in off["state"])
    assert on["heldout_mlm_acc"] is not None and off["heldout_mlm_acc"] is not None

    fcfg = FinetuneConfig(data_uri=str(csv), max_epochs=1, patience=1, batch_size=16, threads=1, use_layers=1,
                          lr=1e-3)
    rows_s = sentiment_rows(variants, fcfg, feat)
    assert [r["model"] for r in rows_s] == ["LEBERT, adapter on", "LEBERT, adapter off",
                                            "baseline (TF-IDF char 1-2-gram LR)"]
    assert all(0.0 <= r["test_auc"] <= 1.0 for r in rows_s) and rows_s[2]["test_auc"] > 0.9  # words decide
    # figures on the uncontaminated test rows exist exactly when some test rows repeat a training text
    assert all((r["n_clean_test"] is None) == (r["contaminated_test_rows"] == 0) for r in rows_s)
    table = markdown(rows_s, ("model", "test_auc", "heldout_mlm_acc", "contaminated_test_rows"))
    assert table.count("\n") == 5 and "| baseline (TF-IDF char 1-2-gram LR) |" in table and "n/a" in table

    bio = tmp_path / "n.bio"
    lines = []
    for i, (_, t) in enumerate(reviews[:60]):
        city = ("北京", "上海")[i % 2]
        chars = list(t[:6]) + list(city)
        tags = ["O"] * 6 + ["B-LOC", "I-LOC"]
        lines += [f"{c} {g}" for c, g in zip(chars, tags)] + [""]
    bio.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ncfg = NerConfig(data_uri=str(bio), max_epochs=1, patience=1, batch_size=16, threads=1, use_layers=1)
    rows_n = ner_rows(variants, ncfg, feat, 64)
    assert [r["model"] for r in rows_n] == ["LEBERT, adapter on", "LEBERT, adapter off", "HMM"]
    assert all(r["test_f1"] is not None and 0.0 <= r["test_f1"] <= 1.0 for r in rows_n)


def test_overlap_warning():
    assert overlap(["這個好", "b"], ["这个好", "c"]) == 1  # normalised: traditional = simplified
    assert warn(0, 10, "test") == "" and "WARNING: 3 of 10 test rows" in warn(3, 10, "test")
