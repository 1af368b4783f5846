"""Bundles in Python: load one, score rows exactly as the labeller does, results as DataFrames."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from models.numerics import numerics_record
from tasks.common import rejects

DEFAULT_SHARD_ROWS = 50_000  # tasks.common.config.LabelOptions' default: `lexiflow label` scores shards this long
RESULT_COLUMNS = ("row_id", "prob", "label", "threshold", "bundle_version", "no_cjk", "truncated_at", "reason")
FLAG_TYPES = {"no_cjk": "boolean", "truncated_at": "Int32"}  # null where the row was rejected


def load_bundle(uri: str, device: str | None = None) -> Model:
    """Open a committed bundle (every file checksum-verified); on CUDA when there is one, as ``lexiflow label``."""
    from tasks.inference.bundle import open_bundle  # noqa: PLC0415  (torch: `import lexiflow` stays light)

    return Model(open_bundle(uri, device))


def as_model(bundle: Any) -> Model:
    """A ``Model`` from a bundle URI, a ``Model`` or a ``tasks.inference.bundle.Bundle``."""
    if isinstance(bundle, Model):
        return bundle
    if hasattr(bundle, "featurizer") and hasattr(bundle, "model"):
        return Model(bundle)
    return load_bundle(str(bundle))


class Model:
    """A loaded bundle (binary sentiment, or K classes with ``finetune.classes: any``): ``version``, ``threshold``
    (None for K > 2 classes), ``uri``, ``info`` (bundle.json), ``predict`` and ``explain``."""

    def __init__(self, bundle):  # a tasks.inference.bundle.Bundle
        self.bundle = bundle
        self.version, self.threshold, self.uri, self.info = bundle.version, bundle.threshold, bundle.uri, bundle.info

    def __repr__(self) -> str:
        if self.threshold is None:  # K > 2 classes
            return f"<lexiflow bundle {self.version} classes={self.info.get('classes')} {self.uri}>"
        return f"<lexiflow bundle {self.version} threshold={self.threshold:.4f} {self.uri}>"

    def predict(self, texts: str | Iterable[Any], batch_size: int = 32) -> pd.DataFrame:
        """One row per text, in order: ``text_index, prob, label, threshold, bundle_version, no_cjk, truncated_at,
        reason`` (``reason`` is None when scored, else the labeller's reject reason with ``prob``/``label`` null;
        ``no_cjk``: the text holds no CJK ideograph; ``truncated_at``: the token offset where a text longer than
        the model's length was cut, else null). A K > 2 class bundle gives ``text_index, label`` (class name),
        ``prob`` (its probability), ``prob_<class>`` per class, ``bundle_version, no_cjk, truncated_at, reason``."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = RowScorer(self.bundle, batch_size)
        out = collect([*rows.feed(list(range(len(texts))), texts), *rows.finish()])
        return out.rename(columns={"row_id": "text_index"}).astype({"text_index": "int64"})

    def explain(self, text: str):
        """What the model looks at for ``text`` (``tasks.inference.explain.Explanation``): ``prob``/``label`` as
        ``predict`` gives them, and DataFrames ``attention`` (layer, head, query, key, weight), ``attribution``
        (gradient x input per character, for the predicted label) and ``words`` (lexicon words matched at each
        character, adapter weight); ``.save(dir)`` writes the PNG heatmaps. ValueError for an empty text."""
        from tasks.inference.explain import bundle_words  # noqa: PLC0415  (torch: `import lexiflow` stays light)
        from tasks.inference.explain_bundle import explain  # noqa: PLC0415  (torch: `import lexiflow` stays light)

        if getattr(self, "_words", None) is None:
            self._words = bundle_words(self.uri)
        return explain(self.bundle, text, self._words)


def missing_to_none(value: Any) -> Any:
    """pandas' missing markers (NaN, NA, NaT) as None, so they read as a missing text or id."""
    if value is None or isinstance(value, str):
        return value
    try:
        return None if pd.isna(value) is True else value
    except (TypeError, ValueError):  # pragma: no cover - exotic objects: left to row_reason
        return value


class RowScorer:
    """Rows in, result frames out, scored exactly as the labeller (``tasks.label.run``) scores a shard.

    Reasons come from the labeller's own rules (``row_reason``, ``id_string``, empty after
    normalisation); scorable texts are scored by its ``tasks.inference.sentiment.ClassifierScorer`` in
    windows of ``batch_size * WINDOW_BATCHES``, flushed every ``shard_rows`` input rows. So the
    probabilities are bit-identical to ``lexiflow label`` (default ``--threads``; any ``--batch-size``: a
    text's bits do not depend on its batch), however the rows are fed; at most one window of texts is held."""

    def __init__(self, bundle, batch_size: int = 32, shard_rows: int = DEFAULT_SHARD_ROWS):
        from tasks.common.config import THREADS  # noqa: PLC0415  (pydantic: `import lexiflow` stays light)
        from tasks.inference.sentiment import WINDOW_BATCHES, ClassifierScorer  # noqa: PLC0415  (torch: see load_bundle)
        from tasks.label.run import SeenIds  # noqa: PLC0415  (torch: `import lexiflow` stays light)

        numerics_record()  # refuses a process whose torch computed before lexiflow pinned the CPU kernels

        self.scorer = ClassifierScorer(bundle, batch_size, threads=THREADS)  # as `lexiflow label`: fixed threads
        self.window, self.shard_rows, self.rows = batch_size * WINDOW_BATCHES, shard_rows, 0
        self.seen = SeenIds()  # ids of the whole input: a repeated one is rejected as duplicate_id
        self._reset()

    def _reset(self) -> None:
        self.ids: list[Any] = []
        self.reasons: list[str | None] = []
        self.probs: list[float] = []
        self.flags: list[tuple[bool, int | None] | None] = []
        self.win_pos: list[int] = []
        self.win_texts: list[str] = []

    def feed(
        self, ids: Sequence[Any], texts: Sequence[Any], given: Sequence[Any] | None = None
    ) -> Iterator[pd.DataFrame]:
        """Add rows (default row ids, texts, and the id column's values or None); yields finished frames."""
        from tasks.label.run import given_id_reason, row_reason  # noqa: PLC0415  (torch: see load_bundle)

        for k, (rid, text) in enumerate(zip(ids, texts, strict=True)):
            text = missing_to_none(text)
            reason = None
            if given is not None:  # as the labeller: the id's reason first, then the text's
                gid, reason = given_id_reason(missing_to_none(given[k]), self.seen)
                rid = gid if gid is not None else rid
            reason = reason or row_reason(text)
            self.ids.append(rid)
            self.reasons.append(reason)
            self.probs.append(np.nan)
            self.flags.append(None)
            if reason is None:
                self.win_pos.append(len(self.ids) - 1)
                self.win_texts.append(text)
            self.rows += 1
            if len(self.win_texts) == self.window or self.rows % self.shard_rows == 0:
                yield from self.finish()
        if self.ids and not self.win_texts:  # only rejects pending: nothing to wait for
            yield self._emit()

    def finish(self) -> Iterator[pd.DataFrame]:
        """Score the pending window and yield every pending row (the end of the input, or of a shard)."""
        if self.win_texts:
            outputs, empty, flags = self.scorer.score_rows(self.win_texts)
            scored = [pos for i, pos in enumerate(self.win_pos) if i not in empty]
            for i in empty:
                self.reasons[self.win_pos[i]] = rejects.EMPTY_AFTER_NORMALIZATION
            for pos, p, f in zip(scored, outputs, flags, strict=True):
                self.probs[pos], self.flags[pos] = p, f
        if self.ids:
            yield self._emit()

    def _emit(self) -> pd.DataFrame:
        ok = [i for i, r in enumerate(self.reasons) if r is None]
        part = self.scorer.part_table([""] * len(ok), [self.probs[i] for i in ok],  # the labeller's columns
                                      [self.flags[i] for i in ok])
        n = len(self.ids)
        if getattr(self.scorer, "classes", None) is not None:  # K > 2 classes: label (class name), prob, prob_<c>
            frame = pd.DataFrame({"row_id": pd.Series(self.ids, dtype=object)})
            label = np.full(n, None, dtype=object)
            label[ok] = part.column("label").to_pylist()
            frame["label"] = label
            for col in part.column_names[2 : -1 - len(FLAG_TYPES)]:  # prob, prob_<class> ...
                values = np.full(n, np.nan, dtype=np.float32)
                values[ok] = part.column(col).to_numpy()
                frame[col] = values
            frame["bundle_version"] = pd.Series([self.scorer.bundle.version] * n, dtype=object)
            self._flag_columns(frame, part, ok)
            frame["reason"] = pd.Series(self.reasons, dtype=object)
            self._reset()
            return frame
        prob = np.full(n, np.nan, dtype=np.float32)
        prob[ok] = part.column("prob").to_numpy()
        values, missing = np.zeros(n, dtype=np.int8), np.ones(n, dtype=bool)
        values[ok], missing[ok] = part.column("label").to_numpy(), False
        label = pd.arrays.IntegerArray(values, missing)  # Int8, null where rejected
        frame = pd.DataFrame({"row_id": pd.Series(self.ids, dtype=object), "prob": prob, "label": label})
        frame["threshold"] = float(self.scorer.bundle.threshold)
        frame["bundle_version"] = pd.Series([self.scorer.bundle.version] * n, dtype=object)
        self._flag_columns(frame, part, ok)
        frame["reason"] = pd.Series(self.reasons, dtype=object)
        self._reset()
        return frame

    def _flag_columns(self, frame: pd.DataFrame, part, ok: list[int]) -> None:
        for col, dtype in FLAG_TYPES.items():  # the part file's flags on the scored rows, null elsewhere
            values = np.full(len(frame), None, dtype=object)
            values[ok] = part.column(col).to_pylist()
            frame[col] = pd.array(values, dtype=dtype)


def collect(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The frames one after the other (a typed empty frame when there are none)."""
    if frames:
        return pd.concat(frames, ignore_index=True)
    empty = {c: pd.Series([], dtype=object) for c in RESULT_COLUMNS}
    return pd.DataFrame(empty).astype({"prob": "float32", "label": "Int8", "threshold": "float64", **FLAG_TYPES})
