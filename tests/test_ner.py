"""NER: CRF against brute force, tagger masking/padding, 1:1 character features, tiny end-to-end stage."""

from __future__ import annotations

import itertools
import json
import uuid

import numpy as np
import pytest
import torch

from models import CRF, LebertForPretraining, LebertTagger, ModelConfig
from tasks.common.text import norm_char
from tasks.inference.ner import NerModel, NerScorer, build_chunks
from tasks.ner.config import NerConfig
from tasks.ner.train import run_hmm_eval, run_ner_stage, train_ner
from tasks.training.checkpoint import weights
from tests.reporting import Recording
from tests.staging import begin

# ----------------------------------------------------------------------------- CRF


def _brute(crf: CRF, em: torch.Tensor, n: int):
    """Every path of length n with its score, computed independently of the CRF code."""
    A, s, e = crf.transitions.detach(), crf.start.detach(), crf.end.detach()
    out = {}
    for path in itertools.product(range(crf.num_tags), repeat=n):
        emit = sum(em[t, y] for t, y in enumerate(path))
        sc = s[path[0]] + e[path[-1]] + emit + sum(A[a, b] for a, b in zip(path, path[1:]))
        out[path] = float(sc)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_crf_matches_brute_force(seed):
    torch.manual_seed(seed)
    N, T, lengths = 3, 5, [5, 3, 1, 4]
    crf = CRF(N)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    em = torch.randn(len(lengths), T, N)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    tags = torch.randint(0, N, (len(lengths), T)).masked_fill(~mask, -100)
    nll, paths = crf.nll(em, tags, mask), crf.decode(em, mask)
    for b, n in enumerate(lengths):
        scores = _brute(crf, em[b], n)
        best = max(scores, key=scores.get)
        assert tuple(paths[b]) == best
        logz = torch.logsumexp(torch.tensor(list(scores.values()), dtype=torch.float64), 0).item()
        gold = scores[tuple(tags[b, :n].tolist())]
        assert nll[b].item() == pytest.approx(logz - gold, abs=1e-4)
    # an empty sequence: nll 0, decodes to []
    assert crf.decode(em[:1], torch.zeros(1, T, dtype=torch.bool)) == [[]]
    assert crf.nll(em[:1], tags[:1], torch.zeros(1, T, dtype=torch.bool)).item() == 0.0


# ----------------------------------------------------------------------------- tagger


def _cfg(**kw):
    base = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_len=48, hidden_dropout=0.0,
                attention_dropout=0.0, word_vocab_size=10, word_dim=8, max_word_num=2)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("use_crf", [False, True])
def test_tagger_loss_ignores_special_positions_and_decode_ignores_padding(use_crf):
    torch.manual_seed(0)
    m = LebertTagger(_cfg(), num_tags=5, dropout=0.0, use_crf=use_crf).eval()
    ids = torch.tensor([[2, 7, 8, 9, 10, 3, 0, 0], [2, 11, 12, 3, 0, 0, 0, 0]])
    att = ids != 0
    tag_mask = att & (ids != 2) & (ids != 3)
    words = torch.randint(0, 10, (2, 8, 2))
    tags = torch.randint(0, 5, (2, 8))
    a = m.loss(ids, att, words, tags, tag_mask)
    junk = torch.where(tag_mask, tags, torch.randint(0, 5, (2, 8)))  # other labels on [CLS]/[SEP]/pads
    junk_words = torch.where(att[..., None], words, torch.randint(0, 10, (2, 8, 2)))
    b = m.loss(ids, att, junk_words, junk, tag_mask)
    torch.testing.assert_close(a, b)
    assert m.loss(ids, att, words, torch.where(tag_mask, (tags + 1) % 5, tags), tag_mask) != a  # real labels do matter

    one = m.decode(ids[1:, :4], att[1:, :4], words[1:, :4], tag_mask[1:, :4])
    both = m.decode(ids, att, junk_words, tag_mask)
    assert [len(p) for p in both] == [4, 2]
    assert both[1] == one[0]


def test_tagger_loads_pretrained_encoder_strictly():
    torch.manual_seed(0)
    pre = LebertForPretraining(_cfg())
    m = LebertTagger(_cfg(), num_tags=3)
    m.load_pretrained_encoder(pre.state_dict())
    torch.testing.assert_close(m.encoder.blocks[0].attn.qkv.weight, pre.encoder.blocks[0].attn.qkv.weight)
    with pytest.raises(ValueError, match="missing"):
        m.load_pretrained_encoder({k: v for k, v in pre.state_dict().items() if "blocks.1" not in k})


# ----------------------------------------------------------------------------- features

FILLER = list("我们今天去了那里看到很多人和东西都不错")
LEX = ["北京", "上海", "买了", "今天", "东西", "2023年"]  # 2023年 can never match: digits are #NUM# to the matcher


def _featurizer(max_len=64):
    from tasks.text.featurize import Featurizer
    from tasks.text.matcher import build_trie, compile_trie
    from tasks.text.vocab import SPECIALS

    vocab = list(SPECIALS) + FILLER + list("北京上海买张三李四")
    words = ["[PAD]", "[UNK]"] + LEX
    return Featurizer.build(vocab, LEX, words, compile_trie(build_trie(LEX)), 2, max_len)


def test_encode_chars_is_one_to_one_and_matches_the_lexicon():
    from tasks.text.matcher import build_trie, match_words
    from tasks.text.numbers import NUM_CHAR
    from tasks.text.vocab import NUM_ID, UNK

    feat = _featurizer()
    chars = list("我在北京２０２3年買了东西☃") + ["abc"] + list("上海")
    enc = feat.encode_chars([chars])[0]
    assert len(enc.input_ids) == len(chars) + 2 and enc.word_ids.shape == (len(chars) + 2, 2)
    norm = [norm_char(c) for c in chars]
    assert norm[4:8] == list("2023") and norm[9] == "买" and norm[-3] == "abc"
    ids = enc.input_ids[1:-1]
    assert (ids[4:8] == NUM_ID).all() and ids[13] == UNK and ids[14] == UNK and ids[1] == UNK  # digits, ☃, 'abc', 在
    assert ids[2] == feat.vocab_index["北"] and ids[9] == feat.vocab_index["买"]
    # reference: the pure-python matcher on the normalised text (digits -> #NUM#, multi-char token -> separator)
    text = "".join(NUM_CHAR if c.isdigit() else (c if len(c) == 1 else "\x00") for c in norm)
    ref = match_words(text, build_trie(LEX), 2)
    word_id = {w: i for i, w in enumerate(["[PAD]", "[UNK]"] + LEX)}
    want = np.array([[0 if w == "[PAD]" else word_id[w] for w in row] for row in ref])
    np.testing.assert_array_equal(enc.word_ids[1:-1], want)
    assert word_id["买了"] in enc.word_ids[10] and word_id["北京"] in enc.word_ids[3] and not enc.word_ids[5:10].any()


def test_encode_chars_and_encode_share_one_core():
    feat = _featurizer(max_len=8)
    text = "我们今天去了北京"  # nothing here is changed by normalisation: one token per character either way
    a, b = feat.encode([text])[0], feat.encode_chars([list(text[:6])])[0]
    np.testing.assert_array_equal(a.input_ids, b.input_ids)  # encode truncates to max_len - 2 = 6 tokens
    np.testing.assert_array_equal(a.word_ids, b.word_ids)
    assert b.word_ids.any()  # 今天 matched
    whole = feat.encode_chars([list(text)])[0]
    assert len(whole.input_ids) == len(text) + 2  # pre-tokenised: never truncated
    # a batch equals one sentence at a time (no match crosses a sentence), empty sentences included
    sents = [list("今天北京"), [], list("北京东西上海"), ["1", "2", "年"]]
    batch = feat.encode_chars(sents)
    for s, e in zip(sents, batch):
        one = feat.encode_chars([s])[0]
        np.testing.assert_array_equal(e.input_ids, one.input_ids)
        np.testing.assert_array_equal(e.word_ids, one.word_ids)
    assert batch[1].input_ids.tolist() == [2, 3] and batch[3].input_ids[1:3].tolist() == [5, 5]  # [CLS][SEP]; #NUM#


def test_chunks_keep_alignment_and_words_across_cuts():
    feat = _featurizer()
    chars = list("今天北京东西上海") * 3  # 24 chars, chunks of 5
    tags = ["O", "O", "B-LOC", "I-LOC", "O", "O", "B-LOC", "I-LOC"] * 3
    ds = build_chunks([chars], feat, 7, [tags], {"O": 0, "B-LOC": 1, "I-LOC": 2})
    assert [len(e.input_ids) for e in ds.encoded] == [7, 7, 7, 7, 6] and ds.owner.tolist() == [0] * 5
    whole = feat.encode_chars([chars])[0]
    np.testing.assert_array_equal(np.concatenate([e.word_ids[1:-1] for e in ds.encoded]), whole.word_ids[1:-1])
    assert ds.tags[3].tolist() == [1, 0, 0, 1, 2]  # chunk 3 starts inside 上海: re-read as BIO, I-LOC -> B-LOC


def test_numbers_are_one_num_token_and_tags_return_to_every_digit():
    from tasks.text.featurize import collapse_numbers, expand_tags

    chars = list("于1998年3.14米，１２人")
    items, index = collapse_numbers(chars)
    assert items == ["于", "0", "年", "0", "米", "，", "0", "人"]
    assert index.tolist() == [0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 5, 6, 6, 7]
    assert expand_tags(["O", "B-T", "I-T", "O", "O", "O", "B-N", "O"], index) == [
        "O", "B-T", "I-T", "I-T", "I-T", "I-T", "O", "O", "O", "O", "O", "O", "B-N", "I-N", "O"]
    items2, index2 = collapse_numbers(list("1."))
    assert items2 == ["0", "."] and index2.tolist() == [0, 1]  # a trailing point is not inside the number
    feat = _featurizer()
    tags = ["O", "B-T", "I-T", "I-T", "I-T", "I-T"] + ["O"] * 9
    ds = build_chunks([chars], feat, 64, [tags], {"O": 0, "B-T": 1, "I-T": 2})
    (e,) = ds.encoded
    assert e.input_ids.tolist().count(5) == 3 and len(e.input_ids) == len(items) + 2  # one #NUM# per number
    assert ds.tags[0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]  # the number takes its first digit's tag


# ----------------------------------------------------------------------------- end to end


def _write_bio(path, n, seed):
    rng = np.random.default_rng(seed)
    ents = [("北京", "LOC"), ("上海", "LOC"), ("张三", "PER"), ("李四", "PER")]
    lines = []
    for _ in range(n):
        chars, tags = [], []
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(2, 9))
            chars += list(rng.choice(FILLER, size=k))
            tags += ["O"] * k
            word, kind = ents[int(rng.integers(len(ents)))]
            chars += list(word)
            tags += [f"B-{kind}", f"E-{kind}"]  # BMES-style input: converted to BIO by the reader
        lines += [f"{c} {t}" for c, t in zip(chars, tags)] + [""]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _data(tmp_path):
    for name, n, seed in (("train", 240, 0), ("dev", 40, 1), ("test", 40, 2)):
        _write_bio(tmp_path / f"{name}.bio", n, seed)
    return {f"{k}_uri": str(tmp_path / f"{k}.bio") for k in ("train", "dev", "test")}


def test_tiny_stage_learns_selects_on_dev_and_round_trips(tmp_path, monkeypatch):
    import pickle

    import pyarrow.parquet as pq
    from safetensors.torch import save as st_save

    from storage.artifacts import ArtifactStore
    from tasks.text.featurize import Featurizer

    feat = _featurizer()
    mc = _cfg(vocab_size=len(feat.vocab_index), num_layers=1, word_vocab_size=2 + len(LEX), max_len=24)
    torch.manual_seed(1)
    store = ArtifactStore(f"memory://ner-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(weights(LebertForPretraining(mc))))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lex = begin(store, "lexicon", "l1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    monkeypatch.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)

    # max_len 24 < the longest sentences (~36 chars): training and prediction go through chunks
    cfg = NerConfig(**_data(tmp_path), max_len=24, use_crf=True, batch_size=16, lr=3e-3, max_epochs=6, patience=2,
                    threads=2, device="cpu")
    writer = begin(store, "ner", "n1")
    res = run_ner_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    with art.open("epochs.parquet") as f:
        log = pq.read_table(f).to_pylist()
    m = res.metrics
    assert res.stats == {"in": 320, "out": 320, "rejected": {}}
    assert m["n_train_chunks"] > m["n_train"] == 240
    assert m["dev_f1"] > 0.9 and m["test_f1"] > 0.9, log
    assert set(m["test_per_type"]) == {"LOC", "PER"}
    assert list(log[0]) == ["epoch", "train_loss", "dev_f1", "dev_precision", "dev_recall", "lr", "improved"]
    assert {r["lr"] for r in log} == {cfg.lr}  # NER never decays the LR
    dev_f1 = [r["dev_f1"] for r in log]
    assert m["best_epoch"] == int(np.argmax(dev_f1)) + 1 and m["dev_f1"] == round(max(dev_f1), 6)  # chosen on dev
    assert {"model.safetensors", "model_config.json", "tags.json", "epochs.parquet", "curves.png",
            "test_predictions.parquet", "vocab.txt", "rank_to_word.npy", "compiled.npz"} <= set(art.files())

    # publish: picklable, and the epoch table (all columns) once inside a run
    rec = Recording()
    pickle.loads(pickle.dumps(res.publish))(art, rec)
    made = [kw for kind, kw in rec.made if kind == "table"]
    md = [kw for kind, kw in rec.made if kind == "md"]
    assert [k["key"] for k in made] == ["ner-epochs"] and made[0]["table"] == log
    # the HMM beside the tagger, on the same sentences: manifest metrics and the report
    from tasks.ner.data import read_ner

    hmm = run_hmm_eval(*(read_ner(_data(tmp_path)[f"{k}_uri"]).sentences for k in ("train", "dev", "test")))
    assert m["hmm_test_f1"] == hmm["test_f1"] and m["hmm_dev_f1"] == hmm["dev_f1"]
    assert md[0]["key"] == "ner-report"
    assert f"| test | {m['test_f1']:.4f} | {m['hmm_test_f1']:.4f} |" in md[0]["markdown"]

    ner = NerModel.load(art.uri)
    text = "我们今天去了上海看到很多人和东西都不错那里李四都不错我们今天去了北京"  # 34 chars > 22: two chunks
    ents = ner.predict_entities([text, ""])
    assert ents[1] == []
    assert [(e["type"], e["text"]) for e in ents[0]] == [("LOC", "上海"), ("PER", "李四"), ("LOC", "北京")]
    assert all(text[e["start"] : e["end"]] == e["text"] for e in ents[0])

    # ner-label: the sentiment labeller's streaming/rejects/reconciliation with the NER scorer
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    src = tmp_path / "texts.csv"
    src.write_text("id,text\na," + text + "\nb,   \nc,我们今天去了北京\n", encoding="utf-8")
    opts = LabelOptions(text_column="text", id_column="id")
    out = label_stream(NerScorer(art.uri), str(src), str(tmp_path / "ner_out"), opts, progress=False)
    assert out["stats"] == {"in": 3, "out": 2, "rejected": {"empty_text": 1}}
    rows = pq.read_table(tmp_path / "ner_out" / "part-00000.parquet").to_pylist()
    assert [r["row_id"] for r in rows] == ["a", "c"]
    assert [(e["type"], e["text"]) for e in rows[0]["entities"]] == [("LOC", "上海"), ("PER", "李四"), ("LOC", "北京")]
    assert rows[1]["n_entities"] == 1 and rows[1]["model_version"] == art.manifest.version


def test_softmax_ablation_without_words_and_hmm_baseline(tmp_path):
    from tasks.ner.data import read_ner

    feat = _featurizer()
    paths = _data(tmp_path)
    mc = _cfg(vocab_size=len(feat.vocab_index), num_layers=1, word_vocab_size=2 + len(LEX), max_len=48)
    cfg = NerConfig(**paths, use_adapter=False, batch_size=16, lr=3e-3, max_epochs=4, threads=2, device="cpu",
                    max_eval_sentences=30)
    res = train_ner(cfg, feat, mc)
    assert res.metrics["uses_lexicon"] is False and res.metrics["n_dev"] == 30
    assert res.metrics["dev_f1"] > 0.9, res.train.log
    hmm = run_hmm_eval(*(read_ner(paths[f"{k}_uri"]).sentences for k in ("train", "dev", "test")))
    assert hmm["test_f1"] > 0.9 and set(hmm["test"]["per_type"]) == {"LOC", "PER"}
