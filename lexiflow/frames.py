"""label_dataframe: label a pandas DataFrame with a bundle, streamed in chunks, one output row per input row."""

from __future__ import annotations

from typing import Any

import pandas as pd

from lexiflow.scoring import DEFAULT_SHARD_ROWS, RowScorer, as_model, collect, missing_to_none


def check_text_dtype(column: pd.Series, name: str) -> None:
    """ValueError when ``column`` holds numbers or booleans (not text, whatever a cast would make of it); a
    column of only missing values passes (its rows are ``missing_text``)."""
    dtype = column.dtype
    if (pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)) and not column.isna().all():
        raise ValueError(f"text column {name!r} holds {dtype}, not text; name a column of strings")


def label_dataframe(
    df: pd.DataFrame,
    bundle: Any,
    text_column: str = "review",
    id_column: str | None = None,
    batch_size: int = 32,
    chunk_rows: int = 10_000,
    shard_rows: int = DEFAULT_SHARD_ROWS,
) -> pd.DataFrame:
    """Label every row of ``df`` with ``bundle`` (a URI, ``lexiflow.load_bundle``'s model or a
    ``tasks.inference.bundle.Bundle``); the result keeps ``df``'s index and order, so ``df.join(result)`` works.

    Columns: ``row_id`` (the ``id_column`` value, else the index value, as a string), ``prob``
    (float32), ``label`` (Int8: ``prob >= threshold``), ``threshold``, ``bundle_version``,
    ``no_cjk`` (the text holds no CJK ideograph), ``truncated_at`` (the token offset where a text longer than the
    model's length was cut, else null) and ``reason``: None when scored, else why not, in the labeller's words
    (``missing_id``, ``duplicate_id``: an ``id_column`` value an earlier row has, ``invalid_unicode``: a lone
    surrogate in the text or id, ``missing_text``, ``not_a_string``, ``empty_text``, ``empty_after_normalization``;
    ``prob``/``label``/flags are then null). NaN/None texts are ``missing_text``. A text column of numbers or
    booleans is refused (ValueError) before anything is scored. A K-class bundle (``finetune.classes: any``) gives
    ``label`` as the class name, ``prob`` its probability and one ``prob_<class>`` column per class, no ``threshold``.

    ``df`` is read ``chunk_rows`` rows at a time; the probabilities equal
    ``lexiflow label``'s for the same texts at the default ``--threads`` (any ``batch_size`` and ``shard_rows``: on
    CPU a text's bits do not depend on its batch)."""
    from tasks.label.config import LabelOptions  # noqa: PLC0415  (pydantic: `import lexiflow` stays light)
    from tasks.label.run import id_string  # noqa: PLC0415  (torch: `import lexiflow` stays light)

    LabelOptions(text_column=text_column, id_column=id_column, batch_size=batch_size, shard_rows=shard_rows)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if id_column is not None and id_column == text_column:
        raise ValueError(f"id_column and text_column are both {text_column!r}")
    missing = [c for c in (text_column, id_column) if c is not None and c not in df.columns]
    if missing:
        raise KeyError(f"no column(s) {missing} in the DataFrame; it has {list(df.columns)}")
    check_text_dtype(df[text_column], text_column)
    rows = RowScorer(as_model(bundle).bundle, batch_size, shard_rows)
    frames: list[pd.DataFrame] = []
    for start in range(0, len(df), chunk_rows):
        chunk = df.iloc[start : start + chunk_rows]
        ids = [id_string(missing_to_none(v)) for v in chunk.index.tolist()]
        given = chunk[id_column].tolist() if id_column is not None else None
        frames.extend(rows.feed(ids, chunk[text_column].tolist(), given))
    frames.extend(rows.finish())
    out = collect(frames)
    out.index = df.index
    return out
