"""Labelling as a schedule uses it: one directory per label version under an output root, re-runs that
resume or find their output complete, ``--overwrite``, and a bundle given as ``<store>/bundle@<alias>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from storage.aliases import promote
from tasks.label.run import OutputConflict, label_stream
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
    from tasks.inference.bundle import load_bundle

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
    from tasks.inference.bundle import load_bundle

    bundle = load_bundle(f"{store}/bundle@production")
    out = str(tmp_path / "out")
    label_stream(bundle, _csv(tmp_path / "a.csv", GOOD[:3]), out, progress=False)
    with pytest.raises(OutputConflict) as err:
        label_stream(bundle, _csv(tmp_path / "b.csv", GOOD[3:]), out, progress=False)
    assert "--overwrite" in str(err.value) and "--output-root" in str(err.value)
    cmd = [sys.executable, "-m", "lexiflow", "label", "--bundle", f"{store}/bundle@production",
           "--input", str(tmp_path / "b.csv"), "--output", out]
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 2 and "--overwrite" in first.stderr and "Traceback" not in first.stderr
    second = subprocess.run([*cmd, "--overwrite"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["stats"]["in"] == len(GOOD[3:]) and summary["uri"] == out
    neither = subprocess.run(cmd[:-2], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert neither.returncode == 2 and "exactly one of --output" in neither.stderr


def test_cli_labels_without_a_server_when_no_api_is_configured(store, tmp_path, prefect_server):
    """No Prefect API configured: the CLI runs the labeller directly (no temporary server, Prefect not even
    imported); with one configured, the same command is a recorded flow run. Both write the same bytes."""
    inp = _csv(tmp_path / "one.csv", GOOD[:1])
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    quiet = {**base, "PREFECT_HOME": str(tmp_path / "empty-prefect-home")}
    probe = ("import runpy, sys; sys.argv = sys.argv[1:]; "
             "exec('try:\\n runpy.run_module(\"lexiflow\", run_name=\"__main__\")\\n'"
             "     'finally:\\n print(\"PREFECT_IMPORTED\" if \"prefect\" in sys.modules else \"NO_PREFECT\")')")
    args = ["lexiflow", "label", "--bundle", f"{store}/bundle@production", "--input", inp]
    direct_cmd = [sys.executable, "-c", probe, *args, "--output", str(tmp_path / "direct")]
    served_cmd = [sys.executable, "-m", *args, "--output", str(tmp_path / "served")]
    served_env = {**base, "PREFECT_API_URL": prefect_server}
    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent processes, at once
        jobs = [pool.submit(subprocess.run, cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
                for cmd, env in ((direct_cmd, quiet), (served_cmd, served_env))]
        direct, served = (job.result() for job in jobs)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert direct.stdout.strip().splitlines()[-1] == "NO_PREFECT"
    assert "temporary server" not in direct.stderr + direct.stdout
    assert served.returncode == 0, served.stderr[-2000:]
    for name in ("part-00000.parquet", "_run.json", "_manifest.json"):
        a, b = (Path(tmp_path, d, name).read_bytes() for d in ("direct", "served"))
        assert a == b or name == "_manifest.json", name  # the manifest differs only by created_at
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["label"])))
    assert any(r.parameters.get("output_uri") == str(tmp_path / "served") for r in runs)
