"""read_labelled: a committed label output directory (part-*/rejected-* Parquet) as one DataFrame."""

from __future__ import annotations

import io
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

SHARD_FILE = re.compile(r"^(part|rejected)-(\d+)\.parquet$")


def read_labelled(uri: str) -> pd.DataFrame:
    """Every input row of a committed ``lexiflow label`` output: labelled rows (the part columns,
    ``reason`` None) and rejected rows (``reason``; ``source``, ``line``, ``text`` snippet). Each file
    is checked against the manifest's sha256. Rows come in input order when the row ids are the
    default ``{file}:{record}``; with an id column, in shard order, a shard's labelled rows first.
    An uncommitted directory (no ``_manifest.json``: running, crashed) is refused."""
    from storage.artifacts import open_artifact  # noqa: PLC0415  (pydantic: `import lexiflow` stays light)

    try:
        art = open_artifact(uri)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{uri} is not a committed label output (no _manifest.json: the run is unfinished, crashed or "
            "elsewhere); rerun `lexiflow label` with the same arguments to complete it"
        ) from e
    tables = []
    shards = sorted((int(m[2]), m[1] == "rejected", rel) for rel in art.files() if (m := SHARD_FILE.match(rel)))
    for _, rejected, rel in shards:  # shard by shard, its labelled rows first
        table = pq.read_table(io.BytesIO(art.read_verified(rel)))
        if rejected:
            table = table.rename_columns(["row_id" if c == "id" else c for c in table.column_names])
        tables.append(table)
    if not tables:
        raise ValueError(f"{uri}: the manifest lists no part-*.parquet file; not a label output")
    frame = pa.concat_tables(tables, promote_options="default").to_pandas()
    return _tidy(frame, art.manifest.config, art.manifest.metrics)


def _tidy(frame: pd.DataFrame, config: dict, metrics: dict) -> pd.DataFrame:
    """Typed columns (prob float32, label Int8, text as objects, None when missing), constants filled in,
    input order."""
    types = {"prob": "float32", "label": "Int8", "line": "Int64", "no_cjk": "boolean", "truncated_at": "Int32"}
    if "label" in frame and not pd.api.types.is_numeric_dtype(frame["label"]):  # K > 2 classes: class names
        types.pop("label")
    frame = frame.astype({c: t for c, t in types.items() if c in frame})
    for col in ("threshold", "bundle_version"):  # the same for every row of a run
        if col in frame and metrics.get(col) is not None:
            frame[col] = frame[col].where(frame[col].notna(), metrics[col])
    if "reason" not in frame:  # no rejects at all
        frame["reason"] = None
    for col in frame.columns:  # text as Python objects, missing as None, as label_dataframe gives them
        if isinstance(frame[col].dtype, pd.StringDtype) or frame[col].dtype == object:
            frame[col] = frame[col].astype(object).where(frame[col].notna(), None)
    rank = {inp.get("name"): i for i, inp in enumerate(config.get("inputs", []))}
    parts = frame["row_id"].astype(str).str.rpartition(":")
    src, record = parts[0].tolist(), parts[2].tolist()
    if config.get("id_column") is None and all(s in rank for s in src) and all(r.isdigit() for r in record):
        key = pd.DataFrame({"file": [rank[s] for s in src], "record": [int(r) for r in record]})
        frame = frame.iloc[key.sort_values(["file", "record"], kind="stable").index]
    first = ["row_id", *(c for c in frame.columns if c not in ("row_id", "reason", "source", "line", "text"))]
    return frame[[*first, "reason", *(c for c in ("source", "line", "text") if c in frame)]].reset_index(drop=True)
