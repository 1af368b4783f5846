"""The typer CLI: its commands and options, its entry points, lineage output and clear config errors (no traceback,
exit code 2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from lexiflow.cli import app
from storage.artifacts import ArtifactStore
from tests.staging import begin

REPO = Path(__file__).resolve().parents[1]

# Every command in `lexiflow --help`'s order: (its help panel, its arguments, its options). Moving the CLI from
# flows/ to lexiflow/cli/ kept all of them (and their help texts, byte for byte); a change here is a change users see.
# Monitoring added label's --monitor/--no-monitor and --monitor-set, and the monitor command; --fail-on-alert on both,
# and monitor's --labels (realized performance).
STORE = "Inspect and manage a store"
COMMANDS = {
    "": (None, [], ["--debug", "--version"]),
    "sample": ("Get started", [], ["--out"]),
    "run": ("Build and train", ["FLOW"], ["--config -c", "--store", "--set", "--storage-options", "--rehash"]),
    "label": ("Label and explain", [], ["--bundle", "--input", "--output", "--output-root", "--overwrite",
                                        "--text-column", "--id-column", "--shard-rows", "--batch-size", "--precision",
                                        "--threads", "--monitor", "--monitor-set", "--fail-on-alert",
                                        "--storage-options"]),
    "ner-label": ("Label and explain", [], ["--model", "--input", "--output", "--output-root", "--overwrite",
                                            "--text-column", "--id-column", "--shard-rows", "--threads",
                                            "--storage-options"]),
    "lineage": (STORE, ["uri"], ["--storage-options"]),
    "export-hf": ("Build and train", ["uri"], ["--out", "--adapter"]),
    "explain": ("Label and explain", [], ["--bundle", "--text", "--out", "--dpi", "--storage-options"]),
    "promote": (STORE, ["uri"], ["--alias", "--reason", "--storage-options"]),
    "ls": (STORE, ["store"], ["--stage", "--json", "--stale-after", "--storage-options"]),
    "gc": (STORE, ["store"], ["--keep", "--dry-run", "--stale-after", "--storage-options"]),
    "monitor": ("Label and explain", ["uri"], ["--out", "--json", "--fail-on-alert", "--labels", "--label-column",
                                              "--labels-id-column", "--storage-options"]),
}


def command_tree(command, path: tuple[str, ...] = ()) -> dict[str, tuple]:
    """{command path: (help panel, arguments, options)} of a click command and, for a group, every command under it
    (walked as ``--help`` lists them)."""
    params = [p for p in command.params if p.name != "help"]
    tree = {" ".join(path): (getattr(command, "rich_help_panel", None),
                             [p.metavar or p.name for p in params if p.param_type_name == "argument"],
                             [" ".join(p.opts) for p in params if p.param_type_name == "option"])}
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command, info_name="lexiflow")
        for name in command.list_commands(ctx):
            tree.update(command_tree(command.get_command(ctx, name), (*path, name)))
    return tree


def test_every_command_and_option_is_where_it_was():
    tree = command_tree(get_command(app))
    assert list(tree) == list(COMMANDS)  # the commands, in --help's order
    assert tree == COMMANDS


def _cli(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return subprocess.run([sys.executable, "-m", module, *args], env={**base, "COLUMNS": "100", **env},
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_commands_are_registered_from_one_list_and_the_old_module_name_is_gone():
    """Every command comes from ``lexiflow.cli.COMMANDS``, listed by ``lexiflow --help`` in that order under its
    panel; ``python -m flows.cli`` (the module name before the CLI moved to lexiflow/cli/) no longer exists."""
    from lexiflow.cli import COMMANDS

    assert [c.name for c in app.registered_commands] == [name for name, _, _ in COMMANDS]
    assert [c.rich_help_panel for c in app.registered_commands] == [panel for _, _, panel in COMMANDS]
    assert not (REPO / "flows" / "cli.py").exists()
    new = _cli("lexiflow", "--help", PYTHONHASHSEED="0")
    assert new.returncode == 0, new.stderr[-2000:]
    shown = [name for name, _, _ in COMMANDS if f" {name} " in new.stdout]
    assert shown == [name for name, _, _ in COMMANDS] and "Inspect and manage a store" in new.stdout


def test_without_a_hash_seed_main_runs_again_as_python_m_lexiflow(monkeypatch):
    """The ``lexiflow`` console script is ``lexiflow.cli:main``: without PYTHONHASHSEED it re-executes itself as
    ``python -m lexiflow`` with the same arguments and ``PYTHONHASHSEED=0``."""
    from lexiflow import cli

    calls = []

    def execv(path, argv):
        calls.append((path, argv, os.environ.get("PYTHONHASHSEED")))
        raise SystemExit(0)

    monkeypatch.delenv("PYTHONHASHSEED")
    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/lexiflow", "ls", "--json", "store"])
    with pytest.raises(SystemExit):
        cli.main()
    assert calls == [(sys.executable, [sys.executable, "-m", "lexiflow", "ls", "--json", "store"], "0")]


def test_lineage_prints_the_parent_tree_once_per_artifact(tmp_path):
    st = ArtifactStore(str(tmp_path / "store"))
    ok = {"in": 1, "out": 1, "rejected": {}}
    a = begin(st, "clean", "a1").commit(code_version="c", config={}, parents=[], stats=ok)
    b = begin(st, "numbers", "b1").commit(code_version="n", config={}, parents=[a.ref], stats=ok)
    c = begin(st, "lexicon", "c1").commit(
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
    prof.write_text("prepare: {corpus_uri: x, embeddings_uri: y, clean: {min_chars: 0}}\n")
    res = CliRunner().invoke(app, ["run", "prepare", "--config", str(prof)])
    assert res.exit_code == 2
    assert res.output == (f"error: config {prof}: prepare.clean.min_chars: Input should be greater than or equal to "
                          "1 (got 0)\n")
    res = CliRunner().invoke(app, ["run", "nosuchflow", "--config", str(prof)])
    assert res.exit_code != 0 and "unknown flow" in res.output


def test_module_entry_point_has_the_store_commands_and_telemetry_is_off_by_default(monkeypatch):
    """``python -m lexiflow`` (what the CLI re-executes itself as without PYTHONHASHSEED) knows promote/ls/gc; the
    CLI turns a temporary server's usage telemetry off unless the user set it (no ERROR line offline)."""
    from lexiflow import cli

    res = _cli("lexiflow", "promote", "--help")  # no PYTHONHASHSEED: main() re-executes `python -m lexiflow`
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
