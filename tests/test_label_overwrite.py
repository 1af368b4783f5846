"""``--overwrite`` removes exactly the files that the previous label run owns (what its manifest lists; for an
unfinished run, its shards) and refuses, removing nothing, when the output directory holds anything else."""

from __future__ import annotations

import json
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.label.output import OutputConflict
from tests.test_mutation_guards import _label, _texts_csv


@pytest.fixture()
def root() -> str:
    return f"memory://overwrite-{uuid.uuid4().hex}"


def _tree(fs, path: str) -> dict[str, bytes]:
    return {p[len(path) + 1:]: fs.cat_file(p) for p in fs.find(path)}


def _foreign_parquet(fs, path: str, name: str) -> None:
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1, 2]}), buf)
    fs.pipe_file(f"{path}/{name}", buf.getvalue().to_pybytes())


@pytest.mark.parametrize("planted", [
    "part-00007.parquet",          # beside a label run's shards, but not listed in its manifest
    "part-0.parquet",              # pyarrow's dataset writer's name
    "sub/part-00000.parquet.tmp-1f2e3d4c",  # a nested temporary file
    "_manifest.bundle-copy/_manifest.json",  # a bundle copied in
])
def test_overwrite_refuses_a_directory_holding_files_no_label_run_wrote(root, planted):
    inp = _texts_csv(f"{root}/in.csv", ["好", "差", "好的"])
    first, _ = _label(inp, f"{root}/out")
    fs, path = fsspec.core.url_to_fs(f"{root}/out")
    if planted.endswith(".parquet"):
        _foreign_parquet(fs, path, planted)
    else:
        fs.pipe_file(f"{path}/{planted}", b"foreign bytes")
    before = _tree(fs, path)
    with pytest.raises(OutputConflict, match=r"holds files its label run did not write \(1 files, e\.g\. \['"
                       + planted.replace(".", r"\.") + r"'\]\); --overwrite removes a label run's own files only"):
        _label(inp, f"{root}/out", shard_rows=1, overwrite=True)
    assert _tree(fs, path) == before  # nothing removed, nothing written
    assert first["version"] in before["_run.json"].decode()


def test_overwrite_refuses_another_tools_dataset_and_a_bundle_manifest(root):
    inp = _texts_csv(f"{root}/in.csv", ["好"])
    fs, path = fsspec.core.url_to_fs(f"{root}/dataset")
    for i in range(3):
        _foreign_parquet(fs, path, f"part-{i:05d}.parquet")
    before = _tree(fs, path)
    with pytest.raises(OutputConflict, match="holds no label run"):
        _label(inp, f"{root}/dataset", overwrite=True)
    assert _tree(fs, path) == before
    # a bundle's manifest copied in: it lists files (and even shard-like names), but it is not a label run's
    _, bpath = fsspec.core.url_to_fs(f"{root}/bundle")
    manifest = {"stage": "bundle", "version": "b1", "code_version": "x", "created_at": "t",
                "files": [{"path": "part-00000.parquet", "bytes": 1, "sha256": "0"}]}
    fs.pipe_file(f"{bpath}/_manifest.json", json.dumps(manifest).encode())
    _foreign_parquet(fs, bpath, "part-00000.parquet")
    before = _tree(fs, bpath)
    with pytest.raises(OutputConflict, match=r"holds no label run \(2 files"):
        _label(inp, f"{root}/bundle", overwrite=True)
    assert _tree(fs, bpath) == before


def test_a_manifest_listing_paths_outside_its_directory_owns_nothing(root):
    inp = _texts_csv(f"{root}/in.csv", ["好"])
    fs, path = fsspec.core.url_to_fs(f"{root}/out")
    _label(inp, f"{root}/out")
    fs.pipe_file(f"{root.split('://')[1]}/victim.txt", b"keep me")
    m = json.loads(fs.cat_file(f"{path}/_manifest.json"))
    m["files"].append({"path": "../victim.txt", "bytes": 7, "sha256": "0"})
    fs.pipe_file(f"{path}/_manifest.json", json.dumps(m).encode())
    before = _tree(fs, path)
    with pytest.raises(OutputConflict, match="holds no label run"):
        _label(inp, f"{root}/out", shard_rows=1, overwrite=True)
    assert _tree(fs, path) == before and fs.cat_file(f"{root.split('://')[1]}/victim.txt") == b"keep me"


def test_overwrite_replaces_a_committed_and_an_unfinished_run(root):
    inp = _texts_csv(f"{root}/in.csv", ["好", "差", "好的", "差的"])
    fs, path = fsspec.core.url_to_fs(f"{root}/out")
    first, _ = _label(inp, f"{root}/out", shard_rows=1)
    assert len(first["parts"]) == 4
    second, _ = _label(inp, f"{root}/out", shard_rows=3, overwrite=True)
    assert sorted(_tree(fs, path)) == ["_manifest.json", "_run.json", "part-00000.parquet", "part-00001.parquet"]
    # an unfinished run: its manifest gone (killed before the commit), a temporary file left behind
    fs.rm_file(f"{path}/_manifest.json")
    fs.pipe_file(f"{path}/part-00002.parquet.tmp-0a1b2c3d", b"half")
    third, _ = _label(inp, f"{root}/out", shard_rows=2, overwrite=True)
    assert third["version"] not in (first["version"], second["version"])
    assert sorted(_tree(fs, path)) == ["_manifest.json", "_run.json", "part-00000.parquet", "part-00001.parquet"]
    # an unfinished run's part file that is not the labeller's (no shard digests) is not its own
    fs.rm_file(f"{path}/_manifest.json")
    _foreign_parquet(fs, path, "part-00004.parquet")
    with pytest.raises(OutputConflict, match=r"\['part-00004\.parquet'\]"):
        _label(inp, f"{root}/out", shard_rows=1, overwrite=True)


def test_cli_overwrite_into_another_tools_dataset_is_one_line(tmp_path):
    from tests.bundle_fixture import make_tiny_bundle
    from tests.test_cli_errors import cli, one_error

    bundle = make_tiny_bundle(str(tmp_path / "store"))
    data = tmp_path / "reviews.csv"
    data.write_text("id,review\n1,这家酒店服务很好\n", encoding="utf-8")
    out = tmp_path / "dataset"
    out.mkdir()
    pq.write_table(pa.table({"x": [1]}), out / "part-00000.parquet")
    (out / "nested").mkdir()
    (out / "nested" / "x.parquet.tmp-1f2e3d4c").write_bytes(b"x")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    line = one_error(cli("label", "--bundle", bundle, "--input", str(data), "--output", str(out), "--overwrite"),
                     str(out), "holds no label run", "part-00000.parquet")
    assert "--overwrite removes a label run's own files only" in line
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert pq.read_table(out / "part-00000.parquet").to_pydict() == {"x": [1]}
