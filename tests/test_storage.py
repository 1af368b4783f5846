"""Artifact contract: versions, manifest-last commit, garbage cleanup, checksums, lineage."""

import json
import posixpath
import uuid

import fsspec
import pyarrow as pa
import pytest

from storage.artifacts import ArtifactRef, ArtifactStore, IntegrityError, compute_version, lineage, open_artifact
from storage.lease import OWNER
from storage.parquet import ShardSink, iter_batches, read_table, write_table
from tests.conftest import abandon
from tests.staging import begin


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return ArtifactStore(f"file://{tmp_path}/store")
    return ArtifactStore(f"memory://t-{uuid.uuid4().hex}/store")


def test_version_is_content_addressed():
    p = [ArtifactRef(stage="clean", version="abc", uri="x")]
    v1 = compute_version("numbers", "n-1", {"a": 1, "b": [1, 2]}, p)
    assert v1 == compute_version("numbers", "n-1", {"b": [1, 2], "a": 1}, p)  # key order irrelevant
    assert v1 != compute_version("numbers", "n-2", {"a": 1, "b": [1, 2]}, p)  # code version
    assert v1 != compute_version("numbers", "n-1", {"a": 2, "b": [1, 2]}, p)  # config
    assert v1 != compute_version(
        "numbers", "n-1", {"a": 1, "b": [1, 2]}, [ArtifactRef(stage="clean", version="abd", uri="x")]
    )
    assert len(v1) == 16


def test_commit_writes_manifest_last_with_checksums(store):
    w = begin(store, "demo", "v1")
    w.write_bytes("a.txt", b"hello")
    rows = write_table(w, "t/part-00000.parquet", pa.table({"x": list(range(10))}))
    assert not store.is_committed("demo", "v1")
    assert store.versions("demo") == []  # invisible until the manifest lands
    art = w.commit(
        code_version="d-1",
        config={"k": 1},
        parents=[],
        stats={"in": 10, "out": 10, "rejected": {}},
        rows={"t/part-00000.parquet": rows},
    )
    assert store.versions("demo") == ["v1"]
    m = open_artifact(art.uri).manifest
    assert [f.path for f in m.files] == ["a.txt", "t/part-00000.parquet"]
    assert m.file("a.txt").bytes == 5
    assert m.file("a.txt").sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert m.file("t/part-00000.parquet").rows == 10
    assert m.stats == {"in": 10, "out": 10, "rejected": {}}
    assert read_table(art, "t/part-00000.parquet").column("x").to_pylist() == list(range(10))


def test_no_temporary_files_survive(store):
    w = begin(store, "demo", "v1")
    with pytest.raises(ZeroDivisionError):
        with w.open("broken.bin") as f:
            f.write(b"partial")
            1 / 0
    assert not w.exists("broken.bin")
    assert [posixpath.basename(p) for p in store.fs.find(w.path)] == [OWNER]  # only this run's owner record


def test_uncommitted_directory_is_garbage_and_cleaned(store):
    w = begin(store, "demo", "crashed")
    w.write_bytes("half.bin", b"x")
    assert store.garbage("demo") == []  # its writer is alive: staging, not garbage
    abandon(w)  # the writer dies
    assert store.garbage("demo") and store.versions("demo") == []
    with pytest.raises(FileNotFoundError, match="not a committed artifact"):
        open_artifact(store.artifact_uri("demo", "crashed"))
    begin(store, "demo", "next")  # starting the stage again removes the leftovers
    assert store.garbage("demo") == []


def test_tampered_file_is_refused(store):
    w = begin(store, "demo", "v1")
    w.write_bytes("trie.pkl", b"trusted")
    art = w.commit(code_version="d", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}})
    assert art.read_verified("trie.pkl") == b"trusted"
    with store.fs.open(art.file_path("trie.pkl"), "wb") as f:
        f.write(b"evil")
    with pytest.raises(IntegrityError) as e:
        open_artifact(art.uri).read_verified("trie.pkl")
    import hashlib

    bad, good = hashlib.sha256(b"evil").hexdigest(), hashlib.sha256(b"trusted").hexdigest()
    assert str(e.value) == (f"{art.file_path('trie.pkl')}: sha256 {bad[:12]}… does not match manifest {good[:12]}…; "
                            "the artifact was modified after it was committed")


def test_fingerprint_of_memory_and_local_files_is_size_and_sha256(tmp_path):
    import hashlib

    from storage.artifacts import fingerprint_uri

    data = "好评\n".encode() * 3
    want = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "a.txt").write_bytes(data)
    fsspec.filesystem("memory").pipe("/fp/a.txt", data)
    assert fingerprint_uri(str(tmp_path / "a.txt")) == want == fingerprint_uri("memory://fp/a.txt")


@pytest.mark.parametrize("as_model", [True, False], ids=["Stats", "dict"])
@pytest.mark.parametrize(
    "stats",
    [
        {"in": 3, "out": 1, "rejected": {}},  # rows lost
        {"in": 3, "out": 1, "rejected": {"bad": 1}},  # under-counted rejects
        {"in": 3, "out": 3, "rejected": {"bad": 1}},  # over-counted: a row counted twice
        {"in": 2, "out": 3, "rejected": {}},  # more out than in
    ],
)
def test_unreconciled_stats_refused_and_nothing_committed(store, stats, as_model):
    from storage.artifacts import Stats

    w = begin(store, "demo", "v1")
    w.write_bytes("a.txt", b"x")
    with pytest.raises(RuntimeError, match="do not reconcile"):
        w.commit(code_version="d", config={}, parents=[], stats=Stats.model_validate(stats) if as_model else stats)
    assert not store.is_committed("demo", "v1")


def test_reconciled_dict_stats_are_written_as_given(store):
    stats = {"in": 3, "out": 2, "rejected": {"bad": 1}}
    art = begin(store, "demo", "v1").commit(code_version="d", config={}, parents=[], stats=stats)
    assert open_artifact(art.ref).manifest.stats == stats


def test_committed_version_cannot_be_rewritten(store):
    begin(store, "demo", "v1").commit(code_version="d", config={}, parents=[],
                                      stats={"in": 0, "out": 0, "rejected": {}})
    with pytest.raises(FileExistsError) as err:
        begin(store, "demo", "v1")
    assert str(err.value) == f"{store.artifact_uri('demo', 'v1')} is already committed"


def test_manifest_is_readable_json_with_its_config_and_a_utc_time(store):
    """A person (or a notebook) reads _manifest.json as it is: indented, CJK as written, time in UTC."""
    config = {"note": "中文语料", "k": 1}
    w = begin(store, "demo", "v1")
    w.write_bytes("a.txt", b"x")
    art = w.commit(code_version="d", config=config, parents=[], stats={"in": 1, "out": 1, "rejected": {}})
    raw = store.fs.cat_file(posixpath.join(art.path, "_manifest.json"))
    doc = json.loads(raw)
    assert raw == json.dumps(doc, indent=2, ensure_ascii=False).encode()
    assert "中文语料".encode() in raw
    assert doc["config"] == config and art.manifest.config == config
    assert doc["created_at"].endswith("+00:00")
    with pytest.raises(KeyError) as err:
        art.manifest.file("missing.bin")
    assert err.value.args[0] == "demo/v1 has no file 'missing.bin'"


def test_a_trailing_slash_names_the_same_store_and_artifact(store):
    art = begin(store, "demo", "v1").commit(code_version="d", config={}, parents=[], stats={"in": 0, "out": 0,
                                                                                       "rejected": {}})
    again = ArtifactStore(store.uri + "/")
    assert again.uri == store.uri and again.root == store.root
    assert again.artifact_uri("demo", "v1") == art.uri and again.versions("demo") == ["v1"]
    assert open_artifact(art.uri + "/").manifest.version == "v1"


def test_object_store_commit_copies_then_deletes_each_staged_file(monkeypatch):
    """Object stores have no rename: each finished file is copied into place, then its temporary removed."""
    import storage.writing as writing

    moved = []
    real_move = writing._move

    def move(fs, src, dst):
        moved.append((src.rsplit(".tmp-", 1)[0], dst))
        real_move(fs, src, dst)

    monkeypatch.setattr(writing, "is_object_store", lambda fs: True)
    monkeypatch.setattr(writing, "_move", move)
    store = ArtifactStore(f"memory://objstore-{uuid.uuid4().hex}/store")
    w = begin(store, "demo", "v1")
    w.write_bytes("a.txt", b"hello")
    art = w.commit(code_version="d", config={}, parents=[], stats={"in": 1, "out": 1, "rejected": {}})
    assert [dst for _, dst in moved] == [f"{w.path}/a.txt", f"{w.path}/_manifest.json"]
    assert all(src == dst for src, dst in moved)
    assert not [p for p in store.fs.find(art.path) if ".tmp-" in p]
    assert art.read_verified("a.txt") == b"hello"


def test_lineage_and_shard_sink(store):
    a = begin(store, "a", "1").commit(code_version="a", config={}, parents=[],
                                      stats={"in": 1, "out": 1, "rejected": {}})
    w = begin(store, "b", "2")
    sink = ShardSink(w, "shards/part", pa.schema([("i", pa.int32())]), shard_rows=4)
    sink.extend({"i": i} for i in range(10))
    files = sink.close()
    assert files == {"shards/part-00000.parquet": 4, "shards/part-00001.parquet": 4, "shards/part-00002.parquet": 2}
    b = w.commit(code_version="b", config={}, parents=[a.ref], stats={"in": 10, "out": 10, "rejected": {}}, rows=files)
    got = [r for batch in iter_batches(b, "shards/part-00001.parquet") for r in batch.column("i").to_pylist()]
    assert got == [4, 5, 6, 7]
    tree = lineage(b.uri)
    assert tree["stage"] == "b" and tree["parents"][0]["stage"] == "a"
    json.dumps(tree)


# ----------------------------------------------------------------------------- versions ignore input locations


def _entry(uri: str, digest: str = "d1", name: str = "a.csv") -> dict:
    return {"uri": uri, "name": name, "size": 3, "sha256": digest}


def test_without_locations_drops_fingerprinted_uris_and_keeps_everything_else():
    from storage.artifacts import without_locations

    config = {"lr": 0.1, "data_uri": "/x/a.csv", "train_uri": None, "text_column": "review",
              "inputs": {"data_uri": _entry("/x/a.csv")}}
    got = without_locations(config)
    fp = {"name": "a.csv", "size": 3, "sha256": "d1"}
    # the entry loses its uri; the same string elsewhere becomes the content it points at; no key is dropped
    assert got == {"lr": 0.1, "data_uri": fp, "train_uri": None, "text_column": "review", "inputs": {"data_uri": fp}}
    assert config["inputs"]["data_uri"]["uri"] == "/x/a.csv"  # the caller's config (the manifest's) is untouched
    # lists (clean's inputs, pretrain's extra_texts) and tuples; object stores' digests count as fingerprints
    # a relative path given as is equals the file's name: the name stays, the location goes
    rel = {"data_uri": "a.csv", "inputs": {"data_uri": _entry("a.csv")}}
    assert without_locations(rel) == {"data_uri": fp, "inputs": {"data_uri": fp}}
    s3 = {"uri": "s3://b/k.txt", "size": 5, "ETag": '"e"'}
    assert without_locations({"inputs": [_entry("/x/a.csv"), s3], "pair": ("s3://b/k.txt", 1)}) == {
        "inputs": [fp, {"size": 5, "ETag": '"e"'}], "pair": [{"size": 5, "ETag": '"e"'}, 1]}


def test_without_locations_keeps_what_is_not_a_fingerprinted_location():
    from storage.artifacts import without_locations

    # a location nothing in the payload fingerprints stays: the version still follows it
    assert without_locations({"embeddings_uri": "/x/t.txt", "store_uri": "s3://b/s"}) == {
        "embeddings_uri": "/x/t.txt", "store_uri": "s3://b/s"}
    # a uri with only a size (no digest of the bytes) is not a fingerprint: it stays
    assert without_locations({"src": {"uri": "/x/a", "size": 3}}) == {"src": {"uri": "/x/a", "size": 3}}
    # symbolic values are semantics, not locations, even where an entry names them
    sym = {"input_uri": "@heldout", "extra": [{"data_uri": "@finetune"}], "e": {"uri": "@finetune", "sha256": "d"}}
    assert without_locations(sym) == sym
    # a dict under a location-like key is walked, not dropped; a parent ref's uri is not an input's
    ref = {"inputs": {"data_uri": {"note": "x"}}, "parent": {"stage": "s", "version": "v", "uri": "/store/s/v"}}
    assert without_locations(ref) == ref
    # no input entries: unchanged (the versions of configs without inputs never moved)
    plain = {"a": 1, "中": [1, 2.5], "d": None, "t": (1, 2)}
    assert without_locations(plain) == {"a": 1, "中": [1, 2.5], "d": None, "t": [1, 2]}


def test_version_ignores_where_inputs_are_but_not_their_bytes_names_or_roles():
    def version(uri, digest="d1", name="a.csv", role="data_uri"):
        return compute_version("finetune", "f-1", {role: uri, "inputs": {role: _entry(uri, digest, name)}}, [])

    v = version("/x/a.csv")
    assert v == version("/elsewhere/a.csv") == version("s3://bucket/prefix/a.csv")  # the same bytes, moved
    assert v != version("/x/a.csv", digest="d2")  # new bytes
    assert v != version("/x/a.csv", name="b.csv")  # another name (format and reject rows follow it)
    assert v != version("/x/a.csv", role="train_uri")  # the same file in another role
    # a location that is not fingerprinted still counts
    assert compute_version("s", "c", {"u": "/x/a"}, []) != compute_version("s", "c", {"u": "/y/a"}, [])


def test_manifest_run_section_is_written_and_optional(store):
    w = begin(store, "demo", "v1")
    w.write_bytes("a.txt", b"x")
    art = w.commit(code_version="d", config={}, parents=[], stats={"in": 1, "out": 1, "rejected": {}},
                   metrics={"loss": 0.5}, run={"wall_s": 1.5})
    m = open_artifact(art.uri).manifest
    assert (m.metrics, m.run) == ({"loss": 0.5}, {"wall_s": 1.5})
    raw = json.loads(art.fs.cat(art.file_path("_manifest.json")))
    raw.pop("run")  # a manifest written before the section existed still reads
    assert type(m).model_validate(raw).run == {}
