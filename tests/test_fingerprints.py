"""Input fingerprints cached beside the store (storage.fingerprints): a re-run reads no unchanged input, a
changed one is hashed again, memory:// is always hashed, ``rehash`` forces it, concurrent writers leave whole
entries, and the version still follows the bytes, never the path or the cache."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

from storage.artifacts import compute_version, fingerprint_uri
from storage.fingerprints import CACHE_DIR, FingerprintCache
from tasks.common.stage import input_source

DATA = "好评 差评\n".encode() * 1000


def _old_file(path: Path, data: bytes = DATA, age_s: float = 600) -> Path:
    """A file last changed ``age_s`` ago (mtime; its ctime is now, see _aged)."""
    path.write_bytes(data)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _aged(store: Path) -> None:
    """Entries as if hashed long after the file changed (a file written by the test is racy otherwise)."""
    for entry in (store / CACHE_DIR).glob("*.json"):
        e = json.loads(entry.read_text())
        e["hashed_at_ns"] = max(e["mtime_ns"], e["ctime_ns"]) + 10**10
        entry.write_text(json.dumps(e))


def _entries(store: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((store / CACHE_DIR).glob("*.json"))]


def test_a_rerun_takes_the_digest_from_the_cache_without_reading_the_file(tmp_path):
    f = _old_file(tmp_path / "corpus.txt")
    store = tmp_path / "store"
    first = FingerprintCache(str(store))
    want = {"size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}
    assert first.fingerprint(str(f)) == want == fingerprint_uri(str(f))
    assert (first.stats.hashed, first.stats.hits, first.stats.bytes_hashed) == (1, 0, len(DATA))
    [entry] = _entries(store)
    assert entry["url"] == f"file://{f}" and entry["size"] == len(DATA) and entry["sha256"] == want["sha256"]
    _aged(store)

    again = FingerprintCache(str(store))  # the next run
    assert again.fingerprint(str(f)) == want
    assert (again.stats.hashed, again.stats.hits, again.stats.bytes_hashed) == (0, 1, 0)
    # proof that the file was not read: a digest planted in the entry comes back as it is
    entry_path = next((store / CACHE_DIR).glob("*.json"))
    planted = {**json.loads(entry_path.read_text()), "sha256": "0" * 64}
    entry_path.write_text(json.dumps(planted))
    assert FingerprintCache(str(store)).fingerprint(str(f))["sha256"] == "0" * 64
    # and the same file by a relative path is the same URL: one entry
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert FingerprintCache(str(store)).fingerprint("corpus.txt")["sha256"] == "0" * 64
    finally:
        os.chdir(cwd)


def test_a_touched_a_resized_and_a_same_size_rewritten_file_are_hashed_again(tmp_path):
    f = _old_file(tmp_path / "in.txt")
    store = tmp_path / "store"
    FingerprintCache(str(store)).fingerprint(str(f))
    _aged(store)

    t = time.time() - 300
    os.utime(f, (t, t))  # touched: same bytes, another mtime
    touched = FingerprintCache(str(store))
    assert touched.fingerprint(str(f))["sha256"] == hashlib.sha256(DATA).hexdigest()
    assert (touched.stats.hashed, touched.stats.hits) == (1, 0)
    _aged(store)

    _old_file(f, DATA + b"x")  # another size
    resized = FingerprintCache(str(store))
    assert resized.fingerprint(str(f)) == {"size": len(DATA) + 1, "sha256": hashlib.sha256(DATA + b"x").hexdigest()}
    assert resized.stats.hashed == 1
    _aged(store)

    st = f.stat()
    other = DATA + b"y"  # same size as DATA + b"x", and the old mtime put back (cp -p, rsync -t): the ctime moved
    f.write_bytes(other)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    rewritten = FingerprintCache(str(store))
    assert rewritten.fingerprint(str(f))["sha256"] == hashlib.sha256(other).hexdigest()
    assert rewritten.stats.hashed == 1
    assert len(_entries(store)) == 1  # one entry per URL, replaced


def test_a_file_hashed_right_after_it_changed_is_hashed_again_next_time(tmp_path):
    f = tmp_path / "fresh.txt"
    f.write_bytes(DATA)  # mtime: now; a same-size rewrite within the timestamp granularity could go unseen
    store = tmp_path / "store"
    FingerprintCache(str(store)).fingerprint(str(f))
    second = FingerprintCache(str(store))
    second.fingerprint(str(f))
    assert (second.stats.hashed, second.stats.hits) == (1, 0)


def test_memory_files_are_hashed_every_time_and_rehash_forces_local_files(tmp_path):
    fsspec.filesystem("memory").pipe("/fp-cache/a.txt", DATA)
    store = tmp_path / "store"
    mem = FingerprintCache(str(store))
    for _ in range(2):
        assert mem.fingerprint("memory://fp-cache/a.txt") == fingerprint_uri("memory://fp-cache/a.txt")
    assert (mem.stats.hashed, mem.stats.hits, mem.stats.bytes_hashed) == (2, 0, 2 * len(DATA))
    assert not (store / CACHE_DIR).exists()  # nothing cached for memory://

    f = _old_file(tmp_path / "in.txt")
    FingerprintCache(str(store)).fingerprint(str(f))
    _aged(store)
    forced = FingerprintCache(str(store), rehash=True)
    assert forced.fingerprint(str(f))["sha256"] == hashlib.sha256(DATA).hexdigest()
    assert (forced.stats.hashed, forced.stats.hits) == (1, 0)

    mem_store = FingerprintCache("memory://fp-cache-store")  # a memory store caches local inputs too
    mem_store.fingerprint(str(f))
    assert fsspec.filesystem("memory").ls("/fp-cache-store/_fingerprints", detail=False)


def test_concurrent_writers_leave_whole_entries(tmp_path):
    f = _old_file(tmp_path / "in.txt")
    store = tmp_path / "store"
    cache = FingerprintCache(str(store))
    cache.fingerprint(str(f))
    entry_path = str(next((store / CACHE_DIR).glob("*.json")))
    base = json.loads(Path(entry_path).read_text())
    stop, torn = threading.Event(), []

    def write(i: int) -> None:
        for j in range(30):
            FingerprintCache(str(store))._write(entry_path, {**base, "writer": i, "n": j, "pad": "x" * (i * 500)})

    def read() -> None:
        while not stop.is_set():
            try:
                json.loads(Path(entry_path).read_text())
            except ValueError as e:
                torn.append(e)

    with ThreadPoolExecutor(10) as pool:
        readers = [pool.submit(read) for _ in range(2)]
        list(pool.map(write, range(8)))
        stop.set()
        [r.result() for r in readers]
    assert torn == []
    assert sorted(p.name for p in (store / CACHE_DIR).iterdir()) == [Path(entry_path).name]  # no temporaries
    assert json.loads(Path(entry_path).read_text())["writer"] in range(8)

    Path(entry_path).write_text('{"url": "file://')  # a torn entry (another tool) is a miss, then replaced
    broken = FingerprintCache(str(store))
    assert broken.fingerprint(str(f))["sha256"] == base["sha256"] and broken.stats.hashed == 1
    assert json.loads(Path(entry_path).read_text())["sha256"] == base["sha256"]


def test_the_version_follows_the_bytes_not_the_cache_or_the_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _old_file(tmp_path / "a" / "r.csv"), _old_file(tmp_path / "b" / "r.csv")
    store = tmp_path / "store"

    def version(uri: str, cache) -> str:
        return compute_version("clean", "c1", {"inputs": [input_source(uri, cache=cache)]}, [])

    plain = version(str(a), None)
    assert version(str(a), FingerprintCache(str(store))) == plain  # hashed, entry written
    _aged(store)
    hit = FingerprintCache(str(store))
    assert version(str(a), hit) == plain and hit.stats.hits == 1  # from the entry
    assert version(str(b), FingerprintCache(str(store))) == plain  # another directory, same bytes


def test_start_run_gives_its_runtime_the_cache_and_the_rehash_option(tmp_path):
    from flows.config import PrepareFlowConfig
    from flows.runner import start_run

    def cache_of(**runner):
        cfg = PrepareFlowConfig(store_uri=str(tmp_path / "s"), prepare={"corpus_uri": "x", "embeddings_uri": "y"},
                                runner=runner)
        cache = start_run(cfg).fingerprints
        return cache.store_uri, cache.rehash

    assert cache_of() == (str(tmp_path / "s"), False)
    assert cache_of(rehash_inputs=True) == (str(tmp_path / "s"), True)


def test_the_cli_rehash_flag_sets_the_option():
    from flows.registry import load_flow_config
    from lexiflow.cli.run import run_settings

    sets = run_settings(["prepare.corpus_uri=x", "prepare.embeddings_uri=y"], store="s", rehash=True)
    assert load_flow_config("prepare", None, sets).runner.rehash_inputs is True
    assert load_flow_config("prepare", None, run_settings(sets[:2], None, False)).runner.rehash_inputs is False
