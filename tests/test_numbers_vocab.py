"""numbers (#NUM#, English whole words) and vocab (specials, min_count)."""

from collections import Counter

import pytest

from tasks.prepare.vocab import build_vocab
from tasks.text.numbers import NUM, english_spans, number_row, replace_numbers, to_token_string, tokenize
from tasks.text.vocab import NUM_ID, SPECIALS, UNK, parse_vocab, token_ids, vocab_bytes


@pytest.mark.parametrize(
    "src,want",
    [
        ("2019年", "#NUM#年"),
        ("3.14", "#NUM#"),
        ("1,234,567人", "#NUM#人"),
        ("12.5%", "#NUM#%"),
        ("１９９８年", "#NUM#年"),  # full-width digits first normalised
        ("增长１２．５％", "#NUM#％".join(["增长", ""])),
        ("一九九八年", "一九九八年"),  # Chinese numerals are not numbers here
        ("第3、4名", "第#NUM#、#NUM#名"),
        ("1,234.5元", "#NUM#元"),  # thousands separators and a decimal part: one number
        ("3,4", "#NUM#,#NUM#"),  # a comma not followed by three digits separates two numbers
        ("-40度", "-#NUM#度"),
        ("0.5和10,000", "#NUM#和#NUM#"),
    ],
)
def test_replace_numbers(src, want):
    assert replace_numbers(src) == want


def test_every_number_is_exactly_one_token():
    text = replace_numbers("1998年12月31日，GDP增长7.8%，人口1,234,567")
    toks = tokenize(text)
    assert toks.count(NUM) == 5
    assert "".join(toks) == text
    assert len(to_token_string(text)) == len(toks)


def test_english_words_marked_in_token_coordinates():
    row = number_row({"doc_id": "d", "sent_idx": 0, "text": "在2020年WHO和Google发布"})
    toks = tokenize(row["text"])
    spans = list(zip(row["en_starts"], row["en_ends"]))
    assert ["".join(toks[s:e]) for s, e in spans] == ["WHO", "Google"]
    assert row["n_numbers"] == 1
    assert english_spans("a b cd", 2) == [(4, 6)]


def test_vocab_specials_first_then_frequency_with_min_count():
    counts = Counter({"的": 10, "是": 10, "一": 3, "罕": 1, NUM: 7})
    tokens, stats = build_vocab(counts, min_count=2)
    assert tokens[: len(SPECIALS)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "#NUM#"]
    assert tokens[len(SPECIALS):] == ["是", "的", "一"]  # ties broken by the character
    assert stats == {"in": 4, "out": 3, "rejected": {"below_min_count": 1}}
    assert parse_vocab(vocab_bytes(tokens)) == tokens
    index = {t: i for i, t in enumerate(tokens)}
    assert token_ids(to_token_string("的#NUM#罕"), index) == [index["的"], NUM_ID, UNK]


def test_config_overrides_and_unknown_keys(tmp_path):
    from flows.config import PipelineConfig, PrepareFlowConfig, load_config

    prof = tmp_path / "p.yaml"
    prof.write_text("prepare: {corpus_uri: a.jsonl, embeddings_uri: e.txt, clean: {min_chars: 4}}\n"
                    "pretrain: {steps: 7}\n")
    cfg = load_config(PrepareFlowConfig, prof,
                      ["prepare.clean.min_chars=9", "prepare.trie.max_scan_num=null", "runner.kind=dask"])
    assert (cfg.prepare.clean.min_chars, cfg.prepare.trie.max_scan_num, cfg.runner.kind) == (9, None, "dask")
    assert load_config(PipelineConfig, prof).pretrain.steps == 7
    with pytest.raises(ValueError, match="unknown top-level key"):
        load_config(PrepareFlowConfig, prof, ["stor_uri=x"])
    with pytest.raises(ValueError, match="min_chars"):
        load_config(PrepareFlowConfig, prof, ["prepare.clean.min_chars=0"])
    with pytest.raises(ValueError, match="expected key=value"):
        load_config(PrepareFlowConfig, prof, ["prepare.clean.min_chars"])


def test_vocab_max_size_counts_what_it_drops():
    tokens, stats = build_vocab(Counter({"的": 5, "是": 4, "一": 3}), min_count=1, max_size=len(SPECIALS) + 2)
    assert tokens[len(SPECIALS):] == ["的", "是"]
    assert stats == {"in": 3, "out": 2, "rejected": {"over_max_size": 1}}
