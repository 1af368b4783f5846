"""What a user reads is written for the user: the docs site builds with no warning at all, and no page, config
profile or ``--help`` text carries our own bookkeeping (issue numbers, machine paths, dated notes on who measured
what on which machine). Every option of every command says what it does in one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from lexiflow.cli import app

ROOT = Path(__file__).resolve().parents[1]

# example roots the guides use on purpose (a reader's own paths are theirs)
EXAMPLE_TMP = ("/tmp/labelled", "/tmp/why", "/tmp/lexiflow")

PATTERNS = [
    ("issue number", re.compile(r"\bissues?\s+#?\d+|\bissue\s+\d+'s\b", re.I)),
    ("issue reference", re.compile(r"(?<![\w&/#`'\"])#\d{1,4}\b(?![\w#])")),
    ("machine path", re.compile(r"/(?:work|home|Users)/")),
    ("machine path", re.compile(r"/tmp/[\w.-]+")),
    ("session wording", re.compile(r"\b(?:this|no|one|another|a later|an earlier|the last) session\b(?!-)", re.I)),
    ("this machine", re.compile(r"\bthis (?:shared )?(?:\d+-core |\d+-CPU )?(?:machine|vm|box|host)\b(?!'s)", re.I)),
    ("not tried here", re.compile(r"\b(?:not tried|not yet tried|measured|ran|run) here\b", re.I)),
]
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
_GEN = re.compile(r"<!-- gen:(?P<name>[a-z0-9-]+) -->\n.*?<!-- /gen:(?P=name) -->", re.S)


def internal_wording(text: str, markdown: bool = True) -> list[str]:
    """``line: kind: match`` for every piece of internal wording in ``text``. In Markdown a date is fine in a table
    row, a fenced code block (an example output path) and a generated block (a measurement's own date); in prose it
    is a dated note."""
    found = []
    dated_ok: set[int] = set()
    if markdown:
        for m in _GEN.finditer(text):
            first = text.count("\n", 0, m.start()) + 1
            dated_ok.update(range(first, first + m.group(0).count("\n") + 1))
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if markdown and line.lstrip().startswith("```"):
            fenced = not fenced
            dated_ok.add(no)
        if markdown and (fenced or line.lstrip().startswith("|")):
            dated_ok.add(no)
        for kind, pattern in PATTERNS:
            for m in pattern.finditer(line):
                if kind == "machine path" and m.group(0).startswith(EXAMPLE_TMP):
                    continue
                found.append(f"{no}: {kind}: {m.group(0)!r}")
        if no not in dated_ok:
            found.extend(f"{no}: dated note: {m.group(0)!r}" for m in DATE.finditer(line))
    return found


def user_files() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", *docs, *sorted((ROOT / "configs").glob("*.yaml"))]


def commands(group=None, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(argv prefix, command) for the app and every command under it."""
    group = group or get_command(app)
    out = [(prefix, group)]
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            out.extend(commands(cmd, prefix + (name,)))
        else:
            out.append((prefix + (name,), cmd))
    return out


def help_text(argv: tuple[str, ...]) -> str:
    res = CliRunner().invoke(app, [*argv, "--help"], prog_name="lexiflow", env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return res.output


def test_the_scanner_finds_each_kind_and_spares_tables_code_and_examples():
    text = "\n".join([
        "See issue 12 and #34; issue 22's tree.",                 # 1
        "Data under /work/shared/data and /home/me/x.",            # 2
        "Built under /tmp/dask_sample/inputs.",                    # 3
        "No session has had a GPU; on this 2-core machine.",       # 4
        "The CUDA build (not tried here).",                        # 5
        "Measured 2026-11-25 in the morning.",                     # 6
        "| bench | 2026-11-25 03:42 |",                           # 7: a table row: fine
        "```", "s3://bucket/labelled/2026-11-24", "```",           # 8-10: code: fine
        "lexiflow label --output /tmp/labelled; #NUM# and [K][2K] and (#eval-demo) and `#3` in code",  # 11: fine
        "<!-- gen:x -->", "measured 2026-11-25", "<!-- /gen:x -->",  # 12-14: generated: fine
    ])
    found = internal_wording(text)
    lines = sorted({int(f.split(":")[0]) for f in found})
    assert lines == [1, 2, 3, 4, 5, 6], found
    assert sum(f.startswith("1:") for f in found) == 3
    assert internal_wording("measured 2026-11-25", markdown=False)


@pytest.mark.parametrize("path", user_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_internal_wording_in_user_pages(path):
    found = internal_wording(path.read_text(encoding="utf-8"), markdown=path.suffix == ".md")
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found)


def test_results_json_records_no_machine_paths():
    bad = {}
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        text = path.read_text(encoding="utf-8")
        hits = [m.group(0) for m in re.finditer(r"/(?:work|home|Users)/[^\"\s]*|/tmp/[^\"\s]*", text)]
        if hits:
            bad[path.name] = hits
    assert not bad, bad


def test_help_texts_are_complete_and_carry_no_internal_wording():
    problems = []
    for argv, cmd in commands():
        name = " ".join(("lexiflow", *argv))
        text = help_text(argv)
        problems += [f"{name} --help: {f}" for f in internal_wording(text, markdown=False)]
        if "``" in text:
            problems.append(f"{name} --help: literal double backticks")
        if not (cmd.help or "").strip():
            problems.append(f"{name}: no help")
        for p in cmd.params:
            if p.name == "help":
                continue
            if not (getattr(p, "help", None) or "").strip():
                problems.append(f"{name}: {p.opts[0] if p.opts else p.name} has no help")
            elif "\n" in p.help.strip() or "``" in p.help:
                problems.append(f"{name}: {p.opts[0]} help is not one plain line")
    assert not problems, "\n".join(problems)


def test_top_level_help_groups_commands_by_task():
    text = help_text(())
    panels = re.findall(r"^[╭+]─+ ([^─]+?) ─", text, re.M)
    assert len(panels) >= 4, text  # options plus at least three task groups
    for argv, cmd in commands():
        if len(argv) == 1:
            assert getattr(cmd, "rich_help_panel", None), f"lexiflow {argv[0]} is in no help panel"


def warning_lines(output: str) -> list[str]:
    """The lines of an mkdocs build's output that report a warning or an error."""
    return [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]


def test_warning_lines_are_recognised():
    out = "INFO    -  Building\nWARNING -  mkdocs_autorefs: model.md: Could not find cross-reference target '2K'\n"
    assert warning_lines(out) == [out.splitlines()[1]]
    assert warning_lines("INFO    -  Documentation built in 2.1 seconds\n") == []


def test_the_docs_site_builds_strictly_without_a_warning(tmp_path):
    """``mkdocs build --strict`` (no --quiet): exit 0 and not one WARNING line (an autorefs warning, for one, used to
    be hidden by --quiet)."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        mkdocs = Path(shutil.which("mkdocs") or "mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and not warning_lines(out), "\n".join(warning_lines(out)) or out[-3000:]



DOCS_PACKAGES = ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python", "mkdocs-autorefs",
                 "pymdown-extensions", "griffelib", "Markdown", "Pygments", "mkdocs-material-extensions")


def test_make_test_builds_the_docs_strictly_and_every_docs_package_is_pinned():
    """``make test``'s docs-check builds with --strict and without --quiet (which hid a warning), and the docs
    packages (plugins and what they pull in) are pinned in constraints.txt to what is installed."""
    from importlib import metadata

    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    check = make.split("\ndocs-check:", 1)[1].split("\n\n", 1)[0]
    assert "mkdocs build --strict" in check and "--quiet" not in check
    assert re.search(r"^test: .*docs-check", make, re.M)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "constraints.txt").read_text(encoding="utf-8"), re.M))
    norm = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    for name in DOCS_PACKAGES:
        assert name.lower() in norm, f"{name} is not pinned in constraints.txt"
        assert norm[name.lower()] == metadata.version(name), (name, norm[name.lower()], metadata.version(name))
