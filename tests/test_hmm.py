"""tasks.ner.hmm: Viterbi against brute force, counts/probabilities on a hand corpus, unknown
characters, BIO validity, JSON round trip."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tasks.inference.tags import to_bio
from tasks.ner.hmm import HMM, path_score, viterbi


def _random_hmm(rng, N, T, with_zeros=False):
    def lognorm(x):
        return np.log(x / x.sum(axis=-1, keepdims=True))

    log_pi = lognorm(rng.random(N) + 0.05)
    log_A = lognorm(rng.random((N, N)) + 0.05)
    log_B = np.log(rng.random((T, N)) + 1e-3)  # arbitrary per-step emission scores
    if with_zeros:
        log_A[rng.random((N, N)) < 0.3] = -np.inf
        log_pi[rng.integers(N)] = -np.inf
    return log_pi, log_A, log_B


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_zeros", [False, True])
def test_viterbi_matches_brute_force(seed, with_zeros):
    rng = np.random.default_rng(seed)
    for N in (3, 4):
        for T in range(1, 7):
            log_pi, log_A, log_B = _random_hmm(rng, N, T, with_zeros)
            path, score = viterbi(log_pi, log_A, log_B)
            scores = {p: path_score(log_pi, log_A, log_B, p) for p in itertools.product(range(N), repeat=T)}
            best = max(scores.values())
            assert len(path) == T
            if best == -math.inf:
                assert score == -math.inf
                continue
            assert score == pytest.approx(best, rel=1e-12, abs=1e-12)
            assert scores[tuple(path)] == pytest.approx(score, rel=1e-12, abs=1e-12)
            winners = [p for p, s in scores.items() if s == pytest.approx(best, rel=1e-12, abs=1e-12)]
            assert tuple(path) in winners and len(winners) == 1  # continuous scores: unique


def test_viterbi_empty_and_shapes():
    assert viterbi(np.zeros(3), np.zeros((3, 3)), np.zeros((0, 3))) == ([], 0.0)
    with pytest.raises(ValueError):
        viterbi(np.zeros(3), np.zeros((3, 2)), np.zeros((2, 3)))


CORPUS = [
    {"chars": ["张", "三", "说"], "tags": ["B-PER", "I-PER", "O"]},
    {"chars": ["李", "四", "在", "京"], "tags": ["B-PER", "I-PER", "O", "B-LOC"]},
    (["他", "说"], ["O", "O"]),
]


def test_fit_counts_and_probs():
    m = HMM().fit(CORPUS)
    assert m.states == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    assert m.vocab == sorted("张三说李四在京他")
    assert m.c_init.tolist() == [1, 0, 0, 2, 0]
    S = {s: i for i, s in enumerate(m.states)}
    expected = np.zeros((5, 5), dtype=int)
    for a, b in [("B-PER", "I-PER"), ("I-PER", "O"), ("B-PER", "I-PER"), ("I-PER", "O"), ("O", "B-LOC"), ("O", "O")]:
        expected[S[a], S[b]] += 1
    assert m.c_trans.tolist() == expected.tolist()
    V = len(m.vocab)
    assert m.c_emit.sum() == 9 and m.c_emit[S["O"], m.vocab.index("说")] == 2
    # initial: add-1 over 5 states, I-* forbidden, renormalised
    raw = (np.array([1, 0, 0, 2, 0]) + 1.0) / (3 + 5)
    raw[[S["I-LOC"], S["I-PER"]]] = 0
    np.testing.assert_allclose(np.exp(m.log_pi), raw / raw.sum())
    assert m.log_pi[S["I-PER"]] == -np.inf
    # transition row O: counts O->O 1, O->B-LOC 1; add-1 -> /(2+5); I-LOC, I-PER forbidden
    row = (expected[S["O"]] + 1.0) / 7
    row[[S["I-LOC"], S["I-PER"]]] = 0
    np.testing.assert_allclose(np.exp(m.log_A[S["O"]]), row / row.sum())
    assert m.log_A[S["B-PER"], S["I-LOC"]] == -np.inf and m.log_A[S["I-LOC"], S["I-PER"]] == -np.inf
    assert np.isfinite(m.log_A[S["B-PER"], S["I-PER"]]) and np.isfinite(m.log_A[S["I-PER"], S["I-PER"]])
    np.testing.assert_allclose(np.exp(m.log_A).sum(axis=1), 1.0)
    # emission: add-0.01 over V; "说" under O: (2 + .01) / (4 + .01 V)
    assert math.exp(m.log_B[S["O"], m.vocab.index("说")]) == pytest.approx(2.01 / (4 + 0.01 * V))
    np.testing.assert_allclose(np.exp(m.log_B).sum(axis=1), 1.0)
    # I-LOC never seen: uniform emissions
    np.testing.assert_allclose(np.exp(m.log_B[S["I-LOC"]]), 1.0 / V)


def test_unconstrained_keeps_smoothed_transitions():
    m = HMM(constrain=False).fit(CORPUS)
    assert np.isfinite(m.log_A).all() and np.isfinite(m.log_pi).all()


def test_predict_known_unknown_and_valid_bio():
    m = HMM().fit(CORPUS * 5)
    assert m.predict(["张", "三", "说"]) == ["B-PER", "I-PER", "O"]
    assert m.predict([]) == []
    e = m.emissions(["张", "😀"])
    assert np.all(e[1] == m.log_unk) and m.log_unk == pytest.approx(math.log(1 / (len(m.vocab) + 1)))
    tags = m.predict(["😀", "三", "说", "龘"])
    assert len(tags) == 4 and to_bio(tags) == tags  # valid BIO: no repair needed
    rng = np.random.default_rng(0)
    alphabet = m.vocab + ["?", "!"]
    for _ in range(50):
        chars = [alphabet[i] for i in rng.integers(len(alphabet), size=rng.integers(1, 12))]
        tags, score = m.predict_with_score(chars)
        assert to_bio(tags) == tags and np.isfinite(score)


def test_fit_errors():
    with pytest.raises(ValueError):
        HMM().fit([])
    with pytest.raises(ValueError):
        HMM().fit([(["a"], ["O", "O"])])
    with pytest.raises(RuntimeError):
        HMM().predict(["a"])


def test_json_round_trip_deterministic():
    m = HMM(k_emit=0.5).fit(CORPUS)
    text = m.to_json()
    assert text == HMM(k_emit=0.5).fit(list(CORPUS)).to_json()
    m2 = HMM.from_json(text.encode("utf-8"))
    assert m2.to_json() == text
    assert m2.states == m.states and m2.vocab == m.vocab and m2.k_emit == 0.5
    for a, b in [(m.log_pi, m2.log_pi), (m.log_A, m2.log_A), (m.log_B, m2.log_B)]:
        assert np.array_equal(a, b)
    assert "张" in text  # UTF-8, not \\u-escaped
    with pytest.raises(ValueError):
        HMM.from_json('{"format": "other"}')


def test_fit_speed_20k_sentences():
    import time

    rng = np.random.default_rng(1)
    chars = [chr(0x4E00 + i) for i in range(3000)]
    kinds = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    sents = []
    for _ in range(20_000):
        n = 20
        tags = to_bio([kinds[i] for i in rng.integers(5, size=n)])
        sents.append(([chars[i] for i in rng.integers(3000, size=n)], tags))
    t0 = time.perf_counter()
    m = HMM().fit(sents)
    assert time.perf_counter() - t0 < 5.0
    assert m.c_emit.sum() == 400_000
