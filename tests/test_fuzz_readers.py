"""Fuzzing the labeller's readers (hypothesis, derandomized): CSV, TSV, JSON lines and Parquet files made of random
rows, random bytes, lone surrogates and texts in other encodings (GBK, UTF-16, Latin-1) never stop a labelling run,
and every input row is accounted for: ``in == out + rejected``, the part and reject files hold exactly that many
rows, and ``in`` is the number of records the file holds wherever that is well defined (JSON lines: its non-blank
lines; TSV: its non-blank lines after the header; Parquet: its rows)."""

from __future__ import annotations

import io
import json
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.artifacts import MANIFEST
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tests.bundle_fixture import make_tiny_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FUZZ = settings(max_examples=20, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ENCODINGS = ["utf-8", "gbk", "utf-16", "latin-1", "utf-8-sig"]
WORDS = ["房间干净", "失望", "great", "😀", "<br>", " ", "", "好\t坏", 'say "hi"', "a,b", "\u3000", "價格便宜",
         "坏\ud800", "\udfff"]  # the last two: lone surrogates

# any code point, lone surrogates included (a JSON "\ud800" escape gives one)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
text = st.one_of(st.sampled_from(WORDS), any_text)


def _encode(s: str, encoding: str) -> bytes:
    try:
        return s.encode(encoding, "surrogatepass" if encoding.startswith("utf-8") else "strict")
    except UnicodeError:
        return s.encode("utf-8", "surrogatepass")


line_bytes = st.one_of(
    st.binary(max_size=24),  # random bytes
    st.builds(_encode, text, st.sampled_from(ENCODINGS)),  # a text in some encoding
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from tasks.inference.bundle import load_bundle

    return load_bundle(make_tiny_bundle(str(tmp_path_factory.mktemp("store"))))


def _run(bundle, name: str, data: bytes, **options) -> dict:
    """Label ``data`` (file ``name``) and check the accounting; returns the stats."""
    root = f"memory://fuzz-{uuid.uuid4().hex[:12]}"
    with fsspec.open(f"{root}/{name}", "wb") as f:
        f.write(data)
    out = f"{root}/out"
    try:
        res = label_stream(bundle, f"{root}/{name}", out, LabelOptions(batch_size=4, shard_rows=5, **options),
                           progress=False)
        st_ = res["stats"]
        assert st_["in"] == st_["out"] + sum(st_["rejected"].values())
        with fsspec.open(f"{out}/{MANIFEST}", "rb") as f:
            files = json.loads(f.read())["files"]
        written = {"part": 0, "rejected": 0}
        for entry in files:
            kind = entry["path"].split("-")[0]
            if kind in written:
                with fsspec.open(f"{out}/{entry['path']}", "rb") as f:
                    written[kind] += pq.read_metadata(f).num_rows
        assert (written["part"], written["rejected"]) == (st_["out"], st_["in"] - st_["out"])
        return st_
    finally:
        fs, path = fsspec.core.url_to_fs(root)
        fs.rm(path, recursive=True)


def _nonblank(lines: list[bytes]) -> int:
    return sum(bool(x.strip()) for x in lines)


@FUZZ
@given(st.lists(st.one_of(line_bytes, st.builds(lambda i, t: json.dumps({"id": i, "review": t}).encode(),
                                                st.one_of(st.none(), st.integers(0, 3), text), text)),
                max_size=12))
def test_jsonl_fuzz(bundle, lines):
    lines = [x.replace(b"\n", b" ") for x in lines]
    first = json.dumps({"id": "first", "review": "房间干净"}).encode()  # names the columns
    data = b"\n".join([first, *lines]) + b"\n"
    st_ = _run(bundle, "in.jsonl", data, id_column="id")
    assert st_["in"] == 1 + _nonblank(lines)


@FUZZ
@given(st.lists(st.one_of(line_bytes, st.builds(lambda i, t: _encode(f"{i}\t{t}", "utf-8"), text, text)),
                max_size=12))
def test_tsv_fuzz(bundle, lines):
    lines = [x.replace(b"\n", b" ") for x in lines]
    data = b"id\treview\n" + b"\n".join(lines) + b"\n"
    st_ = _run(bundle, "in.tsv", data, id_column="id")
    assert st_["in"] == sum(x not in (b"", b"\r") for x in lines)


@FUZZ
@given(st.lists(st.one_of(line_bytes, st.builds(lambda i, t: _csv_row(i, t), text, text)), max_size=12))
def test_csv_fuzz(bundle, lines):
    data = b"id,review\n" + b"\n".join(lines) + b"\n"
    st_ = _run(bundle, "in.csv", data, id_column="id")
    assert st_["in"] <= data.count(b"\n")  # a record is at least one line


def _csv_row(i: str, t: str) -> bytes:
    def q(v: str) -> str:
        return '"' + v.replace('"', '""') + '"'

    return _encode(f"{q(i)},{q(t)}", "utf-8")


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.none(), st.sampled_from(["a", "b", ""]), st.text(max_size=4)),
                          st.one_of(st.none(), st.sampled_from(WORDS[:-2]), st.text(max_size=30))), max_size=12))
def test_parquet_fuzz(bundle, rows):  # Arrow strings are valid UTF-8: no surrogate can be written
    ids, texts = zip(*rows) if rows else ((), ())
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array(list(ids), pa.string()), "review": pa.array(list(texts), pa.string())}),
                   buf)
    st_ = _run(bundle, "in.parquet", buf.getvalue(), id_column="id")
    assert st_["in"] == len(rows)
