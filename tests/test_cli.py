"""The typer CLI: lineage output and clear config errors (no traceback, exit code 2)."""

import pytest
from typer.testing import CliRunner

from flows.cli import app
from storage.artifacts import ArtifactStore


def test_lineage_prints_the_parent_tree_once_per_artifact(tmp_path):
    st = ArtifactStore(str(tmp_path / "store"))
    ok = {"in": 1, "out": 1, "rejected": {}}
    a = st.begin("clean", "a1").commit(code_version="c", config={}, parents=[], stats=ok)
    b = st.begin("numbers", "b1").commit(code_version="n", config={}, parents=[a.ref], stats=ok)
    c = st.begin("lexicon", "c1").commit(
        code_version="l", config={}, parents=[b.ref, a.ref], stats={"in": 3, "out": 1, "rejected": {"x": 2}}
    )
    res = CliRunner().invoke(app, ["lineage", c.uri])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("lexicon c1  in=3 out=1 rejected=2")
    assert lines[1].strip().startswith("numbers b1") and lines[2].strip().startswith("clean a1  in=1")
    assert lines[3].strip() == "clean a1  (see above)"


def test_config_errors_are_one_clear_line(tmp_path):
    prof = tmp_path / "bad.yaml"
    prof.write_text("corpus_uri: x\nembeddings_uri: y\nclean: {min_chars: 0}\n")
    res = CliRunner().invoke(app, ["run", "prepare", "--config", str(prof)])
    assert res.exit_code == 2
    assert res.output == f"error: config {prof}: clean.min_chars: Input should be greater than or equal to 1 (got 0)\n"
    res = CliRunner().invoke(app, ["run", "nosuchflow", "--config", str(prof)])
    assert res.exit_code != 0 and "unknown flow" in res.output


def test_module_entry_point_has_the_store_commands_and_telemetry_is_off_by_default(monkeypatch):
    """``python -m flows.cli`` (what the CLI re-executes itself as without PYTHONHASHSEED) knows promote/ls/gc; the
    CLI turns a temporary server's usage telemetry off unless the user set it (no ERROR line offline)."""
    import os
    import subprocess
    import sys

    from flows import cli

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    res = subprocess.run([sys.executable, "-m", "flows.cli", "promote", "--help"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0 and "--alias" in res.stdout, res.stderr[-2000:]
    monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    monkeypatch.setattr(sys, "argv", ["lexiflow", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")  # the user's choice stands
    with pytest.raises(SystemExit):
        cli.main()
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"
