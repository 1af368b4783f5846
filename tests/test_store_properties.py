"""Property: whatever manifests, aliases and stray files a store holds, and in whatever order runs write, promote,
list and collect garbage, nothing outside what the store owns is removed or modified: not a sibling directory
(the victim), not a foreign file in a stage directory, not a corrupt artifact. Searched by hypothesis,
derandomized (the same examples on every run)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import aliases
from storage.artifacts import ArtifactStore
from storage.lease import LeaseSettings
from storage.lifecycle import gc, listing
from tests.conftest import abandon
from tests.staging import begin

FAST = LeaseSettings(heartbeat_s=0.05, stale_after_s=5.0, poll_s=0.02)
OK = {"in": 1, "out": 1, "rejected": {}}
STAGES = ["clean", "bundle"]
VERSIONS = ["v1", "v2", "v3"]
# what a manifest or an alias may claim: escapes, absolute paths (VICTIM: the victim's absolute path), odd names
EVIL = st.one_of(
    st.sampled_from(["../../victim", "../victim", "VICTIM", "/", "..", ".", "", "a/b", "../../victim/sub",
                     "v1/../../../victim", "v1", "v2", "clean", " v1", ".hidden", "_aliases"]),
    st.text(alphabet="ab./_-~ \\", max_size=10),
)
STRAY_NAMES = ["NOTES.md", ".DS_Store", "their-dir", "0123456789abcdef", "x y", "v9", "_manifest.json"]

op = st.one_of(
    st.tuples(st.just("commit"), st.sampled_from(STAGES), st.sampled_from(VERSIONS)),
    st.tuples(st.just("dead"), st.sampled_from(STAGES), st.sampled_from(["d1", "d2"])),
    st.tuples(st.just("manifest"), st.sampled_from(STAGES), st.sampled_from(["m1", "m2"]), EVIL, EVIL),
    st.tuples(st.just("alias"), st.sampled_from(STAGES), st.sampled_from(["production", "x"]), EVIL),
    st.tuples(st.just("promote"), st.sampled_from(STAGES), st.one_of(st.sampled_from(VERSIONS), EVIL)),
    st.tuples(st.just("stray"), st.sampled_from([*STAGES, ""]), st.sampled_from(STRAY_NAMES), st.booleans()),
    st.tuples(st.just("gc"), st.integers(1, 3)),
    st.tuples(st.just("ls")),
)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _manifest(stage: str, version: str) -> bytes:
    return json.dumps({"stage": stage, "version": version, "code_version": "c",
                       "created_at": "2000-01-01T00:00:00+00:00", "files": []}).encode()


def _run(base: Path, ops: list[tuple]) -> tuple[dict[Path, bytes], Path]:
    """Apply ``ops`` to a store under ``base``; returns {path: content} of everything not the store's to touch."""
    victim = base / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "precious.txt").write_text("not the store's")
    (victim / "_manifest.json").write_bytes(_manifest("clean", "victim"))  # a look-alike: "following" it works
    (victim / "sub" / "_manifest.json").write_bytes(_manifest("bundle", "sub"))
    store = ArtifactStore(str(base / "store"))
    Path(store.root).mkdir()
    foreign: dict[Path, bytes] = {}

    def evil(v: str) -> str:
        return str(victim) if v == "VICTIM" else v

    for o in ops:
        kind = o[0]
        if kind in ("commit", "dead") and store.is_committed(o[1], o[2]):
            continue  # a run of a committed version adopts it: nothing to write
        if kind == "commit":
            w = begin(store, o[1], o[2], FAST)
            if w is not None:
                w.write_bytes("data.bin", b"d")
                w.commit(code_version="c", config={}, parents=[], stats=OK)
        elif kind == "dead":
            w = begin(store, o[1], o[2], FAST)
            if w is not None:
                w.write_bytes("half.bin", b"h")
                abandon(w)
        elif kind == "manifest":  # a directory whose manifest claims another stage or version: corrupt
            _, stage, name, m_stage, m_version = o
            d = Path(store.root, stage, name)
            if d.exists():
                continue
            d.mkdir(parents=True)
            (d / "_manifest.json").write_bytes(_manifest(evil(m_stage) or stage, evil(m_version)))
            if (m_stage or stage, m_version) != (stage, name):
                foreign[d / "_manifest.json"] = (d / "_manifest.json").read_bytes()
        elif kind == "alias":  # an alias record written by hand
            path = Path(store.root, "_aliases", o[1], f"{o[2]}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"stage": o[1], "alias": o[2], "version": evil(o[3]), "history": []}))
        elif kind == "promote":
            try:
                aliases.promote(store.uri, o[1], evil(o[2]), "production")
            except (aliases.AliasError, ValueError):
                pass  # not committed, or not a plain version: refused, that is the point
        elif kind == "stray":
            _, where, name, as_dir = o
            d = Path(store.root, where)
            target = d / name
            if target.exists() or (where and name in VERSIONS):
                continue
            d.mkdir(parents=True, exist_ok=True)
            if as_dir:
                target.mkdir()
                target = target / "inside.txt"
            target.write_bytes(f"stray {where}/{name}".encode())
            foreign[target] = target.read_bytes()
        elif kind == "gc":
            gc(store, keep=o[1], settings=FAST)
        elif kind == "ls":
            for stage in STAGES:
                listing(store, stage, FAST)
            listing(store)
    gc(store, keep=1, settings=FAST)
    return foreign, victim


VICTIM_FILES = {"precious.txt": b"not the store's", "sub": b"<dir>", "_manifest.json": _manifest("clean", "victim"),
                "sub/_manifest.json": _manifest("bundle", "sub")}


@settings(derandomize=True, max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=10))
def test_nothing_outside_what_the_store_owns_is_touched(ops):
    with tempfile.TemporaryDirectory() as tmp:
        foreign, victim = _run(Path(tmp), ops)
        assert _snapshot(victim) == VICTIM_FILES
        for path, data in foreign.items():
            assert path.exists() and path.read_bytes() == data, path
