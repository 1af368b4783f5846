"""pretrain.init_from: importing a Hugging Face BERT directory (tasks.pretrain.import_hf) and its vocabulary
(tasks.prepare.vocab), checked against transformers itself on small random checkpoints, offline."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from flows.config import PipelineConfig
from lexiflow.cli.base import error_line
from tasks.prepare.vocab import checkpoint_vocab, import_vocab, read_checkpoint_vocab
from tasks.pretrain import import_hf
from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.train import build_model
from tasks.text.vocab import NUM, SPECIALS, TokenIds
from tests.hf_checkpoint import MODEL, RESERVED, write_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHARS = list("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面")
TOKENS = RESERVED + CHARS + ["##的", "a", "b"]


def _cfg(ckpt, **model) -> PretrainConfig:
    return PretrainConfig(init_from=str(ckpt), model={**MODEL, "use_adapter": False, "hidden_dropout": 0.0,
                                                      "attention_dropout": 0.0, **model})


def _imported(ckpt, nsp: str = "auto", **model):
    cfg = _cfg(ckpt, **model).model_copy(update={"nsp": nsp})
    vocab, _ = import_vocab(read_checkpoint_vocab(str(ckpt)))
    torch.manual_seed(0)
    return build_model(cfg, len(vocab), None, 3, import_hf.read_checkpoint(str(ckpt))).eval()


def _batch(V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 11), generator=g)
    seg = (torch.arange(11) >= 6).long().expand(3, 11).contiguous()
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 8:], mask[2, 5:] = False, False  # padded rows
    return ids, seg, mask


@pytest.mark.parametrize("fmt, legacy", [("safetensors", False), ("bin", False), ("bin", True)])
def test_imported_encoder_and_heads_equal_transformers(tmp_path, fmt, legacy):
    """Adapter off: hidden states of the imported encoder equal transformers' BertModel on the same ids within
    1e-5 (real positions; padding masked), and so do the MLM and NSP logits of BertForPreTraining."""
    hf = write_checkpoint(tmp_path / "ckpt", TOKENS, fmt, legacy_names=legacy)
    ours = _imported(tmp_path / "ckpt")
    ids, seg, mask = _batch(len(TOKENS))
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=seg, attention_mask=mask.long())
        ref_hidden = hf.bert(input_ids=ids, token_type_ids=seg, attention_mask=mask.long()).last_hidden_state
        hidden = ours.encoder(ids, seg, mask)  # [B,T,H]
        out = ours(ids, seg, mask, None, mask)  # MLM logits at every real position
    assert (hidden[mask] - ref_hidden[mask]).abs().max() < 1e-5
    assert (out.mlm_logits - ref.prediction_logits[mask]).abs().max() < 1e-4  # [N,V], V logits of size ~10
    assert (out.nsp_logits - ref.seq_relationship_logits).abs().max() < 1e-5
    assert ours.nsp_head.classifier.weight.requires_grad  # nsp auto: the checkpoint has its head


def test_a_checkpoint_without_nsp_head_pretrains_mlm_alone(tmp_path):
    write_checkpoint(tmp_path / "ckpt", TOKENS, head="mlm")
    ours = _imported(tmp_path / "ckpt")
    assert not ours.nsp_head.classifier.weight.requires_grad and not ours.nsp_head.pooler.weight.requires_grad
    assert import_hf.nsp_on(PretrainConfig(nsp="auto"), None)  # from scratch: on, as always
    cfg = _cfg(tmp_path / "ckpt").model_copy(update={"nsp": "on"})
    with pytest.raises(ValueError, match="has no NSP head"):
        import_hf.check_config(cfg)


def test_vocab_import_keeps_ids_and_puts_num_in_unused1():
    tokens, slot = import_vocab(TOKENS)
    assert slot == "[unused1]" and tokens[1] == NUM and tokens[4:] == TOKENS[4:] and len(tokens) == len(TOKENS)
    ids = TokenIds.of(tokens)
    assert (ids.pad, ids.num, ids.unk, ids.cls, ids.sep, ids.mask) == (0, 1, 4, 5, 6, 7)
    assert set(ids.regular.tolist()) == set(range(8, len(TOKENS)))  # no special, no [unusedN]
    draws = ids.draw(np.random.default_rng(0), 5000)
    assert set(draws.tolist()) == set(range(8, len(TOKENS)))
    again, kept = import_vocab(tokens)  # a lexiflow export re-imported: #NUM# stays where it is
    assert again == tokens and kept == NUM
    _, stats, metrics = checkpoint_vocab(TOKENS, Counter({"的": 5, "罕": 2, "见": 1, NUM: 3}))
    assert stats == {"in": 3, "out": 1, "rejected": {"not_in_checkpoint_vocab": 2}}  # #NUM# is a special
    assert metrics["oov_occurrences"] == 3 and metrics["oov_top"] == [["罕", 2], ["见", 1]]
    assert (metrics["num_slot"], metrics["num_id"]) == ("[unused1]", 1)


def test_counted_vocabulary_draws_as_it_always_did():
    ids = TokenIds.of(list(SPECIALS) + CHARS)
    assert ids.regular is None and (ids.cls, ids.sep, ids.mask, ids.num) == (2, 3, 4, 5)
    a = ids.draw(np.random.default_rng(7), 100)
    assert a.tolist() == np.random.default_rng(7).integers(6, len(SPECIALS) + len(CHARS), size=100).tolist()


def test_config_contradicting_the_checkpoint_is_one_error(tmp_path):
    write_checkpoint(tmp_path / "ckpt", TOKENS)
    with pytest.raises(ValueError) as e:
        import_hf.check_config(_cfg(tmp_path / "ckpt", hidden_size=64, num_layers=3, num_heads=4))
    msg = str(e.value)
    assert error_line(e.value) == msg and "hidden_size 64" in msg and "num_layers 3" in msg and "num_heads 4" in msg
    assert "hidden_size: 32" in msg and "num_layers: 2" in msg and "num_heads: 2" in msg
    with pytest.raises(ValueError, match="position sinusoidal"):
        import_hf.check_config(_cfg(tmp_path / "ckpt", position="sinusoidal"))


def test_shapes_disagreeing_with_config_or_no_vocab_is_one_line(tmp_path):
    import json

    write_checkpoint(tmp_path / "bad", TOKENS)
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ValueError) as e:
        _imported(tmp_path / "bad", ffn_size=48)
    assert error_line(e.value) == str(e.value)  # the CLI's one `error:` line
    assert "disagrees with its config.json" in str(e.value) and "intermediate.dense.weight" in str(e.value)

    write_checkpoint(tmp_path / "novocab", TOKENS)
    (tmp_path / "novocab" / "vocab.txt").unlink()
    for call in (lambda: import_hf.checkpoint_files(str(tmp_path / "novocab")),
                 lambda: read_checkpoint_vocab(str(tmp_path / "novocab"))):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert error_line(e.value) == str(e.value) and "no vocab.txt" in str(e.value)


def test_init_from_sets_the_vocab_checkpoint_and_defaults_keep_every_dump():
    base = {"prepare": {"corpus_uri": "c", "embeddings_uri": "e"}}
    plain = PipelineConfig.model_validate(base)
    assert "init_from" not in plain.pretrain.model_dump() and "nsp" not in plain.pretrain.model_dump()
    assert "checkpoint" not in plain.prepare.vocab.model_dump()
    cfg = PipelineConfig.model_validate({**base, "pretrain": {"init_from": "/ck", "steps": 0}})
    assert cfg.prepare.vocab.checkpoint == "/ck"
    with pytest.raises(ValueError, match="needs pretrain.init_from"):
        PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="different checkpoints"):
        PipelineConfig.model_validate({"prepare": {**base["prepare"], "vocab": {"checkpoint": "/a"}},
                                       "pretrain": {"init_from": "/b"}})


def test_pretrain_version_counts_the_checkpoint_bytes_not_its_place(tmp_path):
    import shutil

    from storage.artifacts import compute_version
    from tasks.pretrain.stage import version_config

    write_checkpoint(tmp_path / "a" / "ckpt", TOKENS)
    shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")

    def version(where):
        cfg = PipelineConfig.model_validate({"prepare": {"corpus_uri": "c", "embeddings_uri": "e"},
                                             "pretrain": {"init_from": str(where), "model": MODEL}})
        return compute_version("pretrain", "x", version_config(cfg.pretrain), [])

    def vocab_version(where):
        from tasks.prepare import vocab
        from tasks.prepare.config import VocabConfig

        return compute_version("vocab", vocab.CODE_VERSION, vocab.version_config(VocabConfig(checkpoint=str(where))),
                               [])

    assert version(tmp_path / "a" / "ckpt") == version(tmp_path / "b" / "ckpt")
    assert vocab_version(tmp_path / "a" / "ckpt") == vocab_version(tmp_path / "b" / "ckpt")
    write_checkpoint(tmp_path / "b" / "ckpt", TOKENS, seed=1)  # other weights: another version
    assert version(tmp_path / "a" / "ckpt") != version(tmp_path / "b" / "ckpt")
    assert vocab_version(tmp_path / "a" / "ckpt") == vocab_version(tmp_path / "b" / "ckpt")  # same vocab.txt
    (tmp_path / "b" / "ckpt" / "vocab.txt").write_text("\n".join(TOKENS + ["新"]) + "\n", encoding="utf-8")
    assert vocab_version(tmp_path / "a" / "ckpt") != vocab_version(tmp_path / "b" / "ckpt")


def test_continued_mlm_with_nsp_off_reads_the_checkpoint_ids(tmp_path):
    """nsp: off continues MLM alone (the NSP head keeps the checkpoint's weights); the packed batches carry the
    imported vocabulary's [CLS]/[SEP]/[MASK] ids and random replacements never draw a special or [unusedN]."""
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.packed import PackedBatches, pack_rows
    from tasks.pretrain.train import train
    from tests.test_pretrain import _rows

    hf = write_checkpoint(tmp_path / "ckpt", TOKENS)
    rows = [{**r, "char_ids": r["char_ids"] + 10} for r in _rows()]  # ordinary tokens of TOKENS (ids 16..49)
    ids = TokenIds.of(import_vocab(TOKENS)[0])
    cfg = _cfg(tmp_path / "ckpt", use_adapter=True).model_copy(
        update={"nsp": "off", "steps": 3, "threads": 1, "log_every": 1})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": 32, "batch_size": 4,
                                                                      "mask_random": 0.5, "mask_replace": 0.3})})
    wv = np.random.default_rng(1).normal(size=(5, 8)).astype(np.float32)
    model, log = train(cfg, rows_of(rows), ids, wv, 2, progress=False)
    assert [r["nsp_loss"] for r in log] == [0.0] * 3 and all(np.isfinite(r["mlm_loss"]) for r in log)
    # exact: with NSP off the head is frozen, so its weights are the checkpoint's copied tensor, never computed on
    assert torch.equal(model.nsp_head.classifier.weight, hf.cls.seq_relationship.weight)
    # three optimizer steps moved the embeddings (any difference will do; equality would mean nothing trained)
    assert not torch.equal(model.encoder.embeddings.token.weight, hf.bert.embeddings.word_embeddings.weight)

    pack = pack_rows(rows_of(rows)(0, 1), cfg.data, 2, None, specials=ids)
    seen = set()
    for b in PackedBatches(pack, cfg.data, ids).epoch(0):
        assert (b.input_ids[:, 0] == ids.cls).all()
        seen |= set(b.input_ids[b.attention_mask].tolist())
    assert not seen & {1, 2, 3, 4} and {ids.cls, ids.sep, ids.mask} <= seen
