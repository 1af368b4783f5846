"""Labelling as a schedule uses it: one directory per label version under an output root, re-runs that
resume or find their output complete, ``--overwrite``, and a bundle given as ``<store>/bundle@<alias>``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from storage.aliases import promote
from tasks.label import OutputConflict, label_stream
from tests.bundle_fixture import make_tiny_bundle
from tests.test_label import GOOD

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("nightly") / "store")
    uri = make_tiny_bundle(root)
    promote(root, "bundle", uri.rstrip("/").rsplit("/", 1)[1], "production")
    return root


def _csv(path: Path, texts: list[str]) -> str:
    path.write_text("review\n" + "".join(f"{t}\n" for t in texts), encoding="utf-8")
    return str(path)


def test_each_night_gets_its_own_directory_and_a_rerun_is_complete(store, tmp_path):
    from tasks.train.bundle import load_bundle

    bundle = load_bundle(f"{store}/bundle@production")  # the alias, as label-nightly ships
    root = str(tmp_path / "labelled")
    monday = label_stream(bundle, _csv(tmp_path / "mon.csv", GOOD[:6]), None, output_root=root, progress=False)
    tuesday = label_stream(bundle, _csv(tmp_path / "tue.csv", GOOD[4:]), None, output_root=root, progress=False)
    assert monday["uri"] == f"{root}/{monday['version']}" and tuesday["uri"] == f"{root}/{tuesday['version']}"
    assert sorted(p.name for p in Path(root).iterdir()) == sorted([monday["version"], tuesday["version"]])
    for night, n in ((monday, 6), (tuesday, 6)):
        st = night["stats"]
        assert st["in"] == n == st["out"] + sum(st["rejected"].values())
    again = label_stream(bundle, str(tmp_path / "tue.csv"), None, output_root=root, progress=False)
    assert again["cached"] is True and again["uri"] == tuesday["uri"]
    run = json.loads(Path(tuesday["uri"], "_run.json").read_text())
    assert run["bundle"]["version"] == bundle.version  # the resolved version, not the alias
    with pytest.raises(ValueError, match="exactly one of output_uri"):
        label_stream(bundle, str(tmp_path / "tue.csv"), str(tmp_path / "x"), output_root=root)


def test_fixed_output_conflict_names_real_options_and_overwrite_replaces(store, tmp_path):
    from tasks.train.bundle import load_bundle

    bundle = load_bundle(f"{store}/bundle@production")
    out = str(tmp_path / "out")
    label_stream(bundle, _csv(tmp_path / "a.csv", GOOD[:3]), out, progress=False)
    with pytest.raises(OutputConflict) as err:
        label_stream(bundle, _csv(tmp_path / "b.csv", GOOD[3:]), out, progress=False)
    assert "--overwrite" in str(err.value) and "--output-root" in str(err.value)
    cmd = [sys.executable, "-m", "flows.cli", "label", "--bundle", f"{store}/bundle@production",
           "--input", str(tmp_path / "b.csv"), "--output", out]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 2 and "--overwrite" in first.stderr and "Traceback" not in first.stderr
    second = subprocess.run([*cmd, "--overwrite"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["stats"]["in"] == len(GOOD[3:]) and summary["uri"] == out
    neither = subprocess.run(cmd[:-2], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert neither.returncode == 2 and "exactly one of --output" in neither.stderr
