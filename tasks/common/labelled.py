"""Labelled sentiment rows for fine-tuning: read (with rejects), split, cap -> :class:`LoadedData`.

One labelled file (``data_uri``, split deterministically) or given ``train_uri``/``dev_uri``
(/``test_uri``) files, each read by the streaming table reader (:mod:`tasks.common.table`: CSV,
TSV, JSON lines, Parquet, any fsspec URL, compression inferred). A header row is required. Every
record is kept or rejected with a reason (:mod:`tasks.common.rejects`), so
``in == out + sum(rejected)`` holds; ``row_id`` is the 1-based line where a record starts
(Parquet: its 1-based row number).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from tasks.common.rejects import BAD_LABEL, EMPTY_TEXT, SNIPPET, reject_schema
from tasks.common.splits import split_rows, subsample
from tasks.common.table import expand_inputs, read_batches

# rejected.parquet: the standard reject columns (``id`` is null: a labelled row's id is its line) + the raw label
REJECT_SCHEMA = reject_schema(extra={"label": pa.string()})



class LabelledSource(Protocol):
    """What reading labelled rows needs of a config section: the files, how the table is read and split, and caps
    (:class:`tasks.finetune.config.FinetuneConfig`; ``pretrain.extra_texts`` entries for :func:`read_labelled`)."""

    data_uri: str | None
    train_uri: str | None
    dev_uri: str | None
    test_uri: str | None
    format: str
    text_column: str
    label_column: str
    split: tuple[float, float, float]
    split_seed: int

def read_labelled(uri: str, cfg: LabelledSource) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read one labelled file -> (rows [{row_id, text, label}], rejects [{source, line, id, reason, text, label}]);
    ``source`` is the file's name (``tasks.common.table.Source.name``).

    Labels must be 0 or 1 after stripping spaces (also int/float/bool 0/1 in JSON/Parquet), else
    ``bad_label``; empty or whitespace-only text -> ``empty_text``; the reader's own reasons
    (``undecodable``, ``bad_columns``, ``invalid_json``) come first. The label is checked before the
    text. Kept texts are stripped of surrounding whitespace. A missing column raises ValueError
    naming the file, the column and the columns that exist; so does a CSV/TSV file without a header.
    Only the kept rows are held, never the file's bytes.
    """
    sources = expand_inputs(uri, cfg.format)
    if len(sources) != 1:
        raise ValueError(f"{uri} names {len(sources)} files; a labelled input is one file (row ids are its lines)")
    (src,) = sources
    rows: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    columns = {"label": cfg.label_column, "text": cfg.text_column}
    for b in read_batches(src, columns, header_required=True):
        for line, raw_label, raw_text, reason, raw in zip(b.lines, b.values["label"], b.values["text"], b.bad, b.raw):
            label = text = None
            if reason is None:
                label = parse_label(raw_label) if _mode(cfg) == "binary" else class_name(raw_label)
                text = None if raw_text is None else (raw_text if isinstance(raw_text, str) else str(raw_text)).strip()
                reason = BAD_LABEL if label is None else (EMPTY_TEXT if not text else None)
            if reason is None:
                rows.append({"row_id": line, "text": text, "label": label})
                continue
            if raw is None:
                raw = raw_text if isinstance(raw_text, str) else ("" if raw_text is None else str(raw_text))
            rejects.append(
                {
                    "source": src.name,  # the file's name, never its directory (not part of the version)
                    "line": line,
                    "id": None,
                    "reason": reason,
                    "text": raw[:SNIPPET],
                    "label": None if raw_label is None else str(raw_label),
                }
            )
    return rows, rejects


def _mode(cfg) -> str:
    """``cfg.classes``; "binary" for a config without it (``pretrain.extra_texts`` entries read labelled files too)."""
    return getattr(cfg, "classes", "binary")


def class_name(v: Any) -> str | None:
    """``classes: any``: a label's class name: an integer (also 2.0 from JSON/Parquet) as its decimal digits, a
    string stripped of spaces; None (``bad_label``) for an empty string, a bool, a non-integral number or null."""
    if isinstance(v, (bool, np.bool_)) or v is None:
        return None
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return str(int(v)) if float(v).is_integer() else None
    s = str(v).strip()
    return s or None


def sorted_classes(names: set[str]) -> list[str]:
    """The class order recorded in the bundle: numeric when every name is an integer (``2`` before ``10``), else
    by code point (Python's ``sorted``)."""
    try:
        return sorted(names, key=int)
    except ValueError:
        return sorted(names)


def parse_label(v: Any) -> int | None:
    """0/1 from ' 1', 1, 1.0, True …; None for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v) if v in (0, 1) else None
    if isinstance(v, (float, np.floating)):
        return int(v) if v in (0.0, 1.0) else None
    if isinstance(v, str):
        s = v.strip()
        return int(s) if s in ("0", "1") else None
    return None


@dataclass
class LoadedData:
    """The labelled rows split into train, dev and test, with rejects, stats and the rows caps left out."""
    train: list[dict[str, Any]]
    dev: list[dict[str, Any]]
    test: list[dict[str, Any]]
    rejects: list[dict[str, Any]]
    stats: dict[str, Any]  # {"in", "out", "rejected": {reason: n}}; out = valid rows (before caps)
    capped: dict[str, int]  # rows left out by max_train_rows / max_eval_rows, per split
    classes: list[str] | None = None  # ``classes: any``: the class names; each row's label is an index into them


def index_classes(cfg: LabelledSource, parts: list[list[dict[str, Any]]]
                  ) -> tuple[list[list[dict[str, Any]]], list[str] | None]:
    """``classes: any``: every row's class name -> its index in :func:`sorted_classes` of all valid rows (before
    any split or cap), and the class names; ``binary``: the rows as they are, None."""
    if _mode(cfg) == "binary":
        return parts, None
    classes = sorted_classes({r["label"] for part in parts for r in part})
    if len(classes) < 2:
        raise ValueError(f"label column {cfg.label_column!r} holds {len(classes)} class(es) {classes}: at least 2 "
                         "are needed")
    index = {c: i for i, c in enumerate(classes)}
    return [[{**r, "label": index[r["label"]]} for r in part] for part in parts], classes


def load_data(cfg: LabelledSource) -> LoadedData:
    """Read, validate, split and cap the labelled data that ``cfg`` names (files or one file split)."""
    rejects: list[dict[str, Any]] = []
    if cfg.data_uri:
        rows, rej = read_labelled(cfg.data_uri, cfg)
        rejects += rej
        n_valid = len(rows)
        (rows,), classes = index_classes(cfg, [rows])
        train, dev, test = split_rows(rows, cfg.split, cfg.split_seed)
    else:
        parts = []
        for uri in (cfg.train_uri, cfg.dev_uri, cfg.test_uri):
            rows, rej = read_labelled(uri, cfg) if uri else ([], [])
            parts.append(rows)
            rejects += rej
        n_valid = sum(map(len, parts))
        (train, dev, test), classes = index_classes(cfg, parts)
    full = {"train": len(train), "dev": len(dev), "test": len(test)}
    train = subsample(train, cfg.max_train_rows, cfg.split_seed + 1)
    dev = subsample(dev, cfg.max_eval_rows, cfg.split_seed + 2)
    test = subsample(test, cfg.max_eval_rows, cfg.split_seed + 3)
    capped = {k: full[k] - len(v) for k, v in (("train", train), ("dev", dev), ("test", test))}
    rejected = dict(sorted(Counter(r["reason"] for r in rejects).items()))
    stats = {"in": n_valid + len(rejects), "out": n_valid, "rejected": rejected}
    return LoadedData(train, dev, test, rejects, stats, capped, classes)


