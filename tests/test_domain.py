"""tasks.pretrain.domain: labelled TRAIN texts -> pretraining rows shaped like the lexicon shards (no dev/test)."""

from __future__ import annotations

import numpy as np

from tasks.common.labelled import read_labelled
from tasks.common.splits import split_rows
from tasks.pretrain.config import ExtraTexts
from tasks.pretrain.data import ROW_COLUMNS
from tasks.pretrain.domain import extra_rows, text_rows, train_texts
from tasks.text.featurize import Featurizer
from tasks.text.matcher import build_trie, compile_trie
from tests.pretrain_reference import iter_batches

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "#NUM#", *"南京市长江大桥很好酒店房间干净"]
EMB = ["长江", "长江大桥", "大桥", "南京", "南京市", "市长", "酒店", "干净"]
WORDS = ["[PAD]", "[UNK]", "长江", "长江大桥", "大桥", "南京", "南京市", "市长", "酒店"]  # no 干净: unknown


def feat() -> Featurizer:
    return Featurizer.build(VOCAB, EMB, WORDS, compile_trie(build_trie(EMB)), 3)


def test_text_rows_match_the_featurizer_and_carry_spans_and_groups():
    f = feat()
    rows = text_rows(["南京市长江大桥很好。房间干净2019年", "酒店"], f, "x/")
    assert [r["doc_id"] for r in rows] == ["x/0", "x/0", "x/1"]
    for r in rows:
        assert set(ROW_COLUMNS) <= set(r)
    enc = f.encode(["南京市长江大桥很好。"])[0]
    assert np.array_equal(rows[0]["char_ids"], enc.input_ids[1:-1])
    assert np.array_equal(rows[0]["word_ids"].reshape(-1, 3), enc.word_ids[1:-1])  # same words as fine-tuning
    words = rows[0]["word_ids"].reshape(-1, 3)
    ws, we = rows[0]["word_starts"].reshape(-1, 3), rows[0]["word_ends"].reshape(-1, 3)
    text = "南京市长江大桥很好。"
    for p in range(len(text)):
        for q in range(3):
            if words[p, q]:
                assert text[ws[p, q]:we[p, q]] == WORDS[words[p, q]] and ws[p, q] <= p < we[p, q]
    assert (0, 3) in zip(rows[0]["group_starts"].tolist(), rows[0]["group_ends"].tolist())  # FMM: 南京市
    assert rows[1]["char_ids"].tolist().count(5) == 1  # 2019 -> one #NUM#
    assert not rows[1]["word_ids"].any()  # 干净 has no id in the corpus word vocabulary: ignored
    b = next(iter_batches(rows, _data_cfg(), len(VOCAB), 3, 0))
    assert b.word_ids.shape[-1] == 3


def _data_cfg():
    from tasks.pretrain.config import PretrainDataConfig

    return PretrainDataConfig(batch_size=4, shuffle_buffer=4, bucket_batches=1, nsp_random_prob=0.0)


def test_only_train_texts_are_read(tmp_path):
    path = tmp_path / "s.csv"
    lines = ["label,review"] + [f"{i % 2},评论{i}号很好" for i in range(200)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ex = ExtraTexts(data_uri=str(path), split=(0.8, 0.1, 0.1), split_seed=7)
    got = train_texts(ex)
    rows, _ = read_labelled(str(path), ex)
    train, dev, test = split_rows(rows, (0.8, 0.1, 0.1), 7)
    assert got == [r["text"] for r in train]
    assert not set(got) & {r["text"] for r in dev + test}
    twice = extra_rows([ex.model_copy(update={"repeat": 2})], feat())
    assert len(twice) == 2 * len(text_rows(got, feat(), "extra0/"))
    assert len({r["doc_id"] for r in twice}) == 2 * len(got)


def test_pipeline_config_refuses_extra_texts_that_would_carry_dev_or_test():
    import pytest

    from flows.config import PipelineConfig

    base = {"prepare": {"corpus_uri": "c", "embeddings_uri": "e"}, "finetune": {"data_uri": "s.csv", "split_seed": 7}}
    ok = PipelineConfig.model_validate({**base, "pretrain": {"extra_texts": [{"data_uri": "s.csv", "split_seed": 7}]}})
    assert ok.pretrain.extra_texts[0].split_seed == 7
    with pytest.raises(ValueError, match="splits finetune.data_uri differently"):
        PipelineConfig.model_validate({**base, "pretrain": {"extra_texts": [{"data_uri": "s.csv", "split_seed": 8}]}})
    given = {"prepare": {"corpus_uri": "c", "embeddings_uri": "e"},
             "finetune": {"train_uri": "t.csv", "dev_uri": "d.csv"}}
    with pytest.raises(ValueError, match="dev/test file"):
        PipelineConfig.model_validate({**given, "pretrain": {"extra_texts": [{"train_uri": "d.csv"}]}})


def test_extra_texts_at_finetune_copies_the_finetune_data_and_split():
    from flows.config import PipelineConfig

    c = PipelineConfig.model_validate({
        "prepare": {"corpus_uri": "c", "embeddings_uri": "e"},
        "finetune": {"data_uri": "r.tsv", "text_column": "t", "label_column": "y", "split": [0.7, 0.2, 0.1],
                     "split_seed": 3},
        "pretrain": {"extra_texts": [{"data_uri": "@finetune", "repeat": 2}]}})
    (ex,) = c.pretrain.extra_texts
    assert (ex.data_uri, ex.text_column, ex.label_column, ex.split, ex.split_seed, ex.repeat) == (
        "r.tsv", "t", "y", (0.7, 0.2, 0.1), 3, 2)
    given = PipelineConfig.model_validate({
        "prepare": {"corpus_uri": "c", "embeddings_uri": "e"}, "finetune": {"train_uri": "t.csv", "dev_uri": "d.csv"},
        "pretrain": {"extra_texts": [{"data_uri": "@finetune"}]}})
    assert given.pretrain.extra_texts[0].train_uri == "t.csv" and given.pretrain.extra_texts[0].data_uri is None


def test_pretrain_version_covers_the_extra_texts_bytes(tmp_path):
    from flows.config import PipelineConfig
    from tasks.pretrain.stage import version_config

    csv = tmp_path / "s.csv"
    csv.write_text("label,review\n1,很好\n", encoding="utf-8")
    base = {"prepare": {"corpus_uri": "c", "embeddings_uri": "e"}, "finetune": {"data_uri": str(csv)}}
    plain = version_config(PipelineConfig.model_validate(base).pretrain)
    assert "extra_inputs" not in plain  # versions without extra texts are unchanged
    cfg = PipelineConfig.model_validate({**base, "pretrain": {"extra_texts": [{"data_uri": "@finetune"}]}})
    before = version_config(cfg.pretrain)
    csv.write_text("label,review\n1,很好\n0,很差\n", encoding="utf-8")
    after = version_config(cfg.pretrain)
    assert before["extra_inputs"][0]["uri"] == str(csv) and before != after
