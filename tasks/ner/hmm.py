"""hmm: supervised first-order HMM tagger (BIO), the non-neural NER baseline.

Model: hidden states are BIO tags, observations are characters.

* States: ``O`` then ``B-X``, ``I-X`` for every type X seen in training (types sorted), so every
  type has both its B and I state even if one was never observed. Training tags go through
  :func:`tasks.inference.tags.to_bio` (any scheme; a stray ``I-X`` becomes ``B-X``).
* Vocabulary: the distinct training characters, sorted (code point order).
* Counting is vectorised: sentences are flattened to int arrays once and the initial,
  transition and emission counts are ``np.bincount`` over flat indices (the same as
  ``np.add.at`` on index arrays, faster).
* Maximum likelihood with add-k smoothing (defaults, all configurable):
  ``pi[s] = (c_init[s] + k_init) / (n_sent + k_init * N)`` with ``k_init = 1``;
  ``A[i, j] = (c[i->j] + k_trans) / (c[i->.] + k_trans * N)`` with ``k_trans = 1``;
  ``B[s, w] = (c[s emits w] + k_emit) / (c[s] + k_emit * V)`` with ``k_emit = 0.01`` (add-1 on
  a ~5k-character vocabulary would give rare states most of their mass for unseen pairs).
* BIO constraints (``constrain=True``), applied *after* smoothing: a sentence cannot start with
  ``I-X`` and ``I-X`` can only follow ``B-X`` or ``I-X`` - so ``O -> I-X``, ``B-Y -> I-X`` and
  ``I-Y -> I-X`` (Y != X) get probability 0 (log-prob ``-inf``); the remaining entries of pi and
  of each row of A are renormalised to sum to 1. Viterbi then only returns valid BIO.
* Unknown characters (not in the training vocabulary): every state gets the same emission
  log-prob ``log(1 / (V + 1))``, so the choice at an unknown character is driven by the
  transitions alone (the constant only shifts the path score).
* Everything is in log space (float64).

``HMM.to_json()`` stores the integer counts and the settings, not floats, and ``from_json``
re-derives the probabilities, so save/load is exact and the JSON text is a deterministic
function of the training data (compact separators, UTF-8 characters unescaped).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tasks.inference.tags import to_bio

__all__ = ["HMM", "viterbi", "path_score"]

FORMAT = "lexiflow-hmm"
VERSION = 1


def viterbi(log_pi: np.ndarray, log_A: np.ndarray, log_B_seq: np.ndarray) -> tuple[list[int], float]:
    """Most probable state path of a log-space HMM and its log joint probability.

    ``log_pi`` [N], ``log_A`` [N, N] (from row to column), ``log_B_seq`` [T, N] (emission
    log-prob of each observation under each state). O(T * N^2): one [N, N] broadcast per step.
    Ties go to the lowest state index. ``T == 0`` gives ``([], 0.0)``; if every path is
    impossible the score is ``-inf`` (the path is then arbitrary but valid-length)."""
    log_pi = np.asarray(log_pi, dtype=np.float64)
    log_A = np.asarray(log_A, dtype=np.float64)
    log_B_seq = np.asarray(log_B_seq, dtype=np.float64)
    T = log_B_seq.shape[0]
    if T == 0:
        return [], 0.0
    N = log_pi.shape[0]
    if log_A.shape != (N, N) or log_B_seq.shape != (T, N):
        raise ValueError(f"shapes disagree: pi {log_pi.shape}, A {log_A.shape}, B {log_B_seq.shape}")
    back = np.empty((T, N), dtype=np.intp)
    delta = log_pi + log_B_seq[0]
    for t in range(1, T):
        scores = delta[:, None] + log_A  # [from, to]
        back[t] = np.argmax(scores, axis=0)
        delta = scores[back[t], np.arange(N)] + log_B_seq[t]
    best = int(np.argmax(delta))
    score = float(delta[best])
    path = [best]
    for t in range(T - 1, 0, -1):
        best = int(back[t, best])
        path.append(best)
    path.reverse()
    return path, score


def path_score(log_pi: np.ndarray, log_A: np.ndarray, log_B_seq: np.ndarray, path: Sequence[int]) -> float:
    """Log joint probability of one state path (reference for :func:`viterbi`)."""
    if len(path) == 0:
        return 0.0
    s = float(log_pi[path[0]]) + float(log_B_seq[0, path[0]])
    for t in range(1, len(path)):
        s += float(log_A[path[t - 1], path[t]]) + float(log_B_seq[t, path[t]])
    return s


def _pairs(sentences: Iterable[Any]) -> Iterable[tuple[Sequence[str], Sequence[str]]]:
    for s in sentences:
        if isinstance(s, dict):
            yield s["chars"], s["tags"]
        else:
            yield s[0], s[1]


def _log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x)


class HMM:
    """Supervised HMM; see the module docstring for the estimates and constraints."""

    def __init__(self, k_init: float = 1.0, k_trans: float = 1.0, k_emit: float = 0.01, constrain: bool = True):
        if min(k_init, k_trans, k_emit) <= 0:
            raise ValueError("smoothing constants must be > 0")
        self.k_init, self.k_trans, self.k_emit = float(k_init), float(k_trans), float(k_emit)
        self.constrain = bool(constrain)
        self.states: list[str] = []
        self.vocab: list[str] = []
        self.c_init = self.c_trans = self.c_emit = None

    # ------------------------------------------------------------------------- training

    def fit(self, sentences: Iterable[Any]) -> "HMM":
        """Train on sentences: ``{"chars": [...], "tags": [...]}`` dicts (as from
        :func:`tasks.ner.data.read_ner`) or ``(chars, tags)`` pairs. Empty sentences are skipped."""
        all_chars: list[str] = []
        all_tags: list[str] = []
        lengths: list[int] = []
        for chars, tags in _pairs(sentences):
            if len(chars) != len(tags):
                raise ValueError(f"sentence with {len(chars)} chars but {len(tags)} tags")
            if not chars:
                continue
            all_chars.extend(chars)
            all_tags.extend(to_bio(tags))
            lengths.append(len(chars))
        if not lengths:
            raise ValueError("no non-empty training sentences")
        kinds = sorted({t[2:] for t in set(all_tags) if t != "O"})
        self.states = ["O"] + [f"{p}-{k}" for k in kinds for p in "BI"]
        self.vocab = sorted(set(all_chars))
        s_idx = {s: i for i, s in enumerate(self.states)}
        c_idx = {c: i for i, c in enumerate(self.vocab)}
        N, V = len(self.states), len(self.vocab)
        t = np.fromiter((s_idx[x] for x in all_tags), dtype=np.int64, count=len(all_tags))
        c = np.fromiter((c_idx[x] for x in all_chars), dtype=np.int64, count=len(all_chars))
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        is_start = np.zeros(len(t), dtype=bool)
        is_start[starts] = True
        cont = ~is_start[1:]  # position i -> i+1 inside one sentence
        self.c_init = np.bincount(t[starts], minlength=N).astype(np.int64)
        self.c_trans = np.bincount(t[:-1][cont] * N + t[1:][cont], minlength=N * N).reshape(N, N).astype(np.int64)
        self.c_emit = np.bincount(t * V + c, minlength=N * V).reshape(N, V).astype(np.int64)
        self._estimate()
        return self

    def allowed(self) -> np.ndarray:
        """[N, N] bool: transitions permitted by BIO (``I-X`` only after ``B-X``/``I-X``)."""
        N = len(self.states)
        ok = np.ones((N, N), dtype=bool)
        for j, sj in enumerate(self.states):
            if sj.startswith("I-"):
                kind = sj[2:]
                ok[:, j] = [si in (f"B-{kind}", f"I-{kind}") for si in self.states]
        return ok

    def _estimate(self) -> None:
        N, V = self.c_emit.shape
        pi = (self.c_init + self.k_init) / (self.c_init.sum() + self.k_init * N)
        A = (self.c_trans + self.k_trans) / (self.c_trans.sum(axis=1, keepdims=True) + self.k_trans * N)
        if self.constrain:
            pi = np.where([s.startswith("I-") for s in self.states], 0.0, pi)
            pi = pi / pi.sum()
            A = np.where(self.allowed(), A, 0.0)
            A = A / A.sum(axis=1, keepdims=True)
        B = (self.c_emit + self.k_emit) / (self.c_emit.sum(axis=1, keepdims=True) + self.k_emit * V)
        self.log_pi = _log(pi)
        self.log_A = _log(A)
        self.log_B = np.log(B)  # [N, V]
        self.log_unk = float(np.log(1.0 / (V + 1)))
        # [V + 1, N]: row w = emission log-probs of character w; row V = unknown character
        self._emit_rows = np.ascontiguousarray(np.vstack([self.log_B.T, np.full((1, N), self.log_unk)]))
        self._c_idx = {ch: i for i, ch in enumerate(self.vocab)}

    # ------------------------------------------------------------------------- inference

    def emissions(self, chars: Sequence[str]) -> np.ndarray:
        """[T, N] emission log-probs of a character sequence (unknowns -> ``log_unk``)."""
        V = len(self.vocab)
        idx = np.fromiter((self._c_idx.get(ch, V) for ch in chars), dtype=np.intp, count=len(chars))
        return self._emit_rows[idx]

    def predict_with_score(self, chars: Sequence[str]) -> tuple[list[str], float]:
        """The Viterbi tag sequence of one sentence and its log-probability."""
        if self.c_emit is None:
            raise RuntimeError("HMM is not fitted")
        path, score = viterbi(self.log_pi, self.log_A, self.emissions(chars))
        return [self.states[i] for i in path], score

    def predict(self, chars: Sequence[str]) -> list[str]:
        """Most probable BIO tag sequence for one sentence."""
        return self.predict_with_score(chars)[0]

    def predict_many(self, sentences: Iterable[Sequence[str]]) -> list[list[str]]:
        """The most probable tag sequence of each sentence."""
        return [self.predict(chars) for chars in sentences]

    # ------------------------------------------------------------------------- persistence

    def to_dict(self) -> dict[str, Any]:
        """The fitted counts and settings as plain JSON-able data (the estimates are recomputed on load)."""
        if self.c_emit is None:
            raise RuntimeError("HMM is not fitted")
        emit = {}
        for i, s in enumerate(self.states):
            (nz,) = np.nonzero(self.c_emit[i])
            emit[s] = [[int(j), int(self.c_emit[i, j])] for j in nz]
        return {
            "format": FORMAT,
            "version": VERSION,
            "smoothing": {"k_init": self.k_init, "k_trans": self.k_trans, "k_emit": self.k_emit},
            "constrain": self.constrain,
            "states": self.states,
            "vocab": self.vocab,
            "init": self.c_init.tolist(),
            "trans": self.c_trans.tolist(),
            "emit": emit,  # state -> [[vocab index, count], ...] (non-zero counts only)
        }

    def to_json(self) -> str:
        """Deterministic JSON text (counts + settings); ``.encode()`` for bytes."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "HMM":
        """The model that :meth:`to_json` wrote; ValueError for another format or version."""
        d = json.loads(text)
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} model")
        m = cls(**d["smoothing"], constrain=d["constrain"])
        m.states, m.vocab = list(d["states"]), list(d["vocab"])
        N, V = len(m.states), len(m.vocab)
        m.c_init = np.asarray(d["init"], dtype=np.int64).reshape(N)
        m.c_trans = np.asarray(d["trans"], dtype=np.int64).reshape(N, N)
        m.c_emit = np.zeros((N, V), dtype=np.int64)
        for i, s in enumerate(m.states):
            for j, n in d["emit"][s]:
                m.c_emit[i, j] = n
        m._estimate()
        return m
