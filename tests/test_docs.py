"""The generated documentation pages match what docs/gen.py produces now, and a stale page is caught."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from pydantic import Field

from flows.config import PipelineConfig
from tasks.pretrain.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _load("lexiflow_docs_gen", ROOT / "docs" / "gen.py")


def test_generated_pages_on_disk_are_current():
    diffs = gen.stale_diffs()
    assert not diffs, "generated docs pages are stale; run `make docs`:\n" + "\n".join(diffs)


def _copy_docs(tmp_path: Path) -> tuple[Path, Path]:
    docs = tmp_path / "docs"
    for rel in [*gen.generators(), *gen.generated_files()]:
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "docs" / rel, docs / rel)
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", results)
    return docs, results


def test_a_new_config_field_makes_the_reference_stale(tmp_path):
    docs, results = _copy_docs(tmp_path)
    assert gen.stale_diffs(docs, results_dir=results) == []  # the copy is current

    class Pretrain(PretrainConfig):
        warmup_ratio: float = Field(0.25, description="a field added on another branch")

    class Pipeline(PipelineConfig):
        pretrain: Pretrain = Pretrain()

    diffs = gen.stale_diffs(docs, results_dir=results, model=Pipeline)
    assert len(diffs) == 1 and "reference/configuration.md" in diffs[0]
    assert "+| `pretrain.warmup_ratio` | float | `0.25` | a field added on another branch |" in diffs[0]


def test_a_changed_or_new_results_file_makes_the_benchmark_page_stale(tmp_path):
    docs, results = _copy_docs(tmp_path)
    record = json.loads((results / "bench_label.json").read_text(encoding="utf-8"))
    record["last_line"] = "ratio texts_per_s fp32 ours/ref=9.99x"
    (results / "bench_label.json").write_text(json.dumps(record), encoding="utf-8")
    (results / "bench_scale.json").write_text(json.dumps({
        "bench": "bench_scale", "measured_at": "2026-11-26T01:02:03+00:00", "git": "abc1234",
        "command": "python benchmarks/bench_scale.py --results docs/results/bench_scale.json",
        "host": {"cpu": "GenuineIntel avx2", "cores": 2}, "rows_per_s": {"ours": 1234.5}, "last_line": "ratio 2.00x"}))
    (results / "bench_unknown.json").write_text(json.dumps({"bench": "bench_unknown"}))
    with pytest.raises(ValueError, match=r"no row in docs/gen.py BENCHMARKS: \['bench_unknown'\]"):
        gen.stale_diffs(docs, results_dir=results)
    (results / "bench_unknown.json").unlink()
    (results / "eval_dump_clean.json").write_text(json.dumps({"bench": "eval_dump_clean", "kept": 10}))

    diffs = {d.split("\n", 1)[0]: d for d in gen.stale_diffs(docs, results_dir=results)}
    bench = next(d for k, d in diffs.items() if "benchmarks.md" in k)
    # bench_label: ours / reference is the ratio, judged against the target (>= 4x)
    record["texts_per_s"]["int8"] = record["texts_per_s"]["ref"] * 3
    (results / "bench_label.json").write_text(json.dumps(record), encoding="utf-8")
    bench = next(d for d in gen.stale_diffs(docs, results_dir=results) if "benchmarks.md" in d.split("\n", 1)[0])
    host = record["host"]  # the committed file's own host and date (rewritten by each run of the bench)
    assert (f"| 3.00× | ≥ 4× (int8, 384 × 6 model) | **not met** | {host['cpu']}, {host['cores']} cores, "
            f"{record['device']} | {record['measured_at'][:10]} |") in bench
    # bench_scale: a new file replaces the old row, with its revision and command
    assert ("| [`bench_scale`](results/bench_scale.json) | `prepare` on growing corpora: log-log growth of peak RSS "
            "with the corpus | n/a | n/a | n/a |") in bench and "| 2026-11-26 | abc1234 |" in bench
    assert "+python benchmarks/bench_scale.py --results docs/results/bench_scale.json" in bench
    quality = next(d for k, d in diffs.items() if "quality.md" in k)  # not bench_*: the quality page's table
    assert "+| [`eval_dump_clean`]" in quality and "+| `kept` | 10 |" in quality

    for path, (_, want) in gen.expected_pages(docs, results_dir=results).items():
        path.write_text(want, encoding="utf-8")
    assert gen.stale_diffs(docs, results_dir=results) == []  # regenerating makes it current again


# The modified-tree results files when the provenance check arrived (docs/results/modified-trees.txt may only lose
# lines): name -> the revision recorded in the file then.
MODIFIED_TREES_AT_START = {
    "bench_contention.json": "df5e988+dirty", "bench_label.json": "ec34b0d+dirty",
    "eval_chnsenticorp.json": "ba579fc+dirty", "eval_kclass.json": "8f42b92+dirty",
    "eval_monitor.json": "4bc9736+dirty", "eval_ner.json": "1168abf+dirty", "eval_sentiment.json": "ba579fc+dirty",
}


def test_the_modified_tree_list_only_shrinks_and_every_other_results_file_is_clean():
    listed = gen.modified_tree_allowlist()
    assert {k: v[0] for k, v in listed.items()}.items() <= MODIFIED_TREES_AT_START.items(), (
        "docs/results/modified-trees.txt may only lose lines: rerun a results file from a clean commit instead")
    assert all(reason for _, reason in listed.values())  # each says what a rerun needs
    assert gen.provenance_problems() == []


def _plant(results: Path, name: str, revision: str) -> None:
    (results / name).write_text(json.dumps({
        "bench": name.removesuffix(".json"), "measured_at": "2026-11-28T01:02:03+00:00", "git": revision,
        "command": f"python benchmarks/{name.removesuffix('.json')}.py --results docs/results/{name}",
        "host": {"cpu": "GenuineIntel avx2", "cores": 2}, "figure": 1.0, "last_line": "ratio 1.00x"}), encoding="utf-8")


def test_the_docs_check_fails_on_a_results_file_from_a_modified_tree(tmp_path, monkeypatch, capsys):
    """A new results file measured on a modified tree (``+dirty``), or at a revision the history does not hold,
    fails ``docs/gen.py --check`` even with every page regenerated; so does an allowlisted one rerun dirty again.
    From a clean commit of the history it passes."""
    docs, results = _copy_docs(tmp_path)
    monkeypatch.setattr(gen, "RESULTS", results)
    monkeypatch.setattr(gen, "stale_diffs", lambda: [])  # the pages are regenerated below: only provenance counts
    head = gen._git("rev-parse", "--short", "HEAD").stdout.strip()

    _plant(results, "eval_planted.json", f"{head}+dirty")
    assert gen.main(["--check"]) == 1
    assert "eval_planted.json: measured on a modified tree" in capsys.readouterr().err
    _plant(results, "eval_planted.json", "0123456789abcdef0123456789abcdef01234567")
    assert gen.main(["--check"]) == 1
    assert "eval_planted.json: a revision that is not in the history" in capsys.readouterr().err
    _plant(results, "eval_planted.json", head)
    assert gen.main(["--check"]) == 0

    _plant(results, "eval_kclass.json", f"{head}+dirty")  # listed, but rerun on a modified tree again
    assert gen.main(["--check"]) == 1
    assert "eval_kclass.json: revision" in capsys.readouterr().err
    _plant(results, "eval_kclass.json", head)  # rerun clean: its line must go
    assert gen.main(["--check"]) == 1
    assert "remove its line from modified-trees.txt" in capsys.readouterr().err
    lines = (results / "modified-trees.txt").read_text(encoding="utf-8").splitlines()
    (results / "modified-trees.txt").write_text("\n".join(x for x in lines if "eval_kclass" not in x) + "\n")
    assert gen.main(["--check"]) == 0


def test_a_page_without_its_generated_block_is_refused():
    with pytest.raises(ValueError, match=r"missing generated block\(s\) \['config'\]"):
        gen.fill_blocks("# Configuration\n", {"config": "x"}, where="configuration.md")


def test_the_error_list_holds_the_clis_own_messages():
    messages = {(m, f, msg) for m, f, msg in gen.error_messages()}
    assert ("lexiflow/cli/run.py", "_label_with", "give exactly one of --output DIR and --output-root ROOT") in messages
    assert any(m == "tasks/common/config.py" and msg.startswith("--set {item!r}: expected key=value")
               for m, _, msg in messages)


def test_write_results_records_the_revision_and_the_command(tmp_path, monkeypatch):
    ab = _load("lexiflow_numerics_ab", ROOT / "benchmarks" / "_numerics_ab.py")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "bench_x.py"), "--n", "3"])
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bench_x.json"
    ab.write_results(str(out), "bench_x", {"last_line": "ratio 1.00x"})
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["command"] == "python benchmarks/bench_x.py --n 3"
    if shutil.which("git") and (ROOT / ".git").exists():
        assert record["git"] and len(record["git"].split("+")[0]) >= 7
    else:
        assert record["git"] is None


def test_the_readme_is_short_and_its_links_resolve():
    """The README gets a person running in ten minutes and points into docs/: at most about 250 lines, and every
    relative link names a file that exists (mkdocs --strict checks the site's own links)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    links = [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text) if not m.startswith(("http", "#"))]
    assert links and all((root / link).exists() for link in links), [x for x in links if not (root / x).exists()]
    assert "make test" in text and "make demo" in text


def test_write_results_records_paths_relative_to_the_repository(tmp_path, monkeypatch):
    ab = _load("lexiflow_numerics_ab", ROOT / "benchmarks" / "_numerics_ab.py")
    shared = ROOT.parent / "shared" / "data" / "x.csv"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "bench_x.py"), "--sample", str(ROOT / ".demo"),
                                      "--data", str(shared), "--out", "/tmp/elsewhere"])
    out = tmp_path / "bench_x.json"
    ab.write_results(str(out), "bench_x", {})
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["command"] == ("python benchmarks/bench_x.py --sample .demo --data ../shared/data/x.csv "
                                 "--out /tmp/elsewhere")
    assert record["argv"] == ["--sample", ".demo", "--data", "../shared/data/x.csv", "--out", "/tmp/elsewhere"]


def test_the_cli_reference_lists_every_command_and_option():
    from typer.main import get_command

    from lexiflow.cli import app

    page = gen.render_cli()
    group = get_command(app)
    for name, cmd in group.commands.items():
        assert f"#### `lexiflow {name}`" in page
        for p in cmd.params:
            if p.name != "help" and p.param_type_name == "option":
                assert f"| `{', '.join(p.opts)}` |" in page, (name, p.opts)
    assert "#### `lexiflow explain`" in page and "### Label and explain" in page


def test_the_gpu_page_shows_the_loop_rows_and_names_what_is_not_measured(tmp_path):
    """The GPU guide's figures: nothing measured is a list of what is to measure; a bench with its pipeline loop rows
    shows them beside today's rows (compute only and over the wall time); a part not measured (an older bench
    without loop rows, no profile, no labelling) is named as not measured yet, never left out; dry runs never
    count."""
    full = ROOT / "configs" / "full.yaml"
    assert gen.render_gpu(tmp_path, full).startswith("Not measured yet (`benchmarks/gpu_check.sh` has not run")
    run = {"shape": {"T": 512}, "compile": True, "tokens_per_s": {"ours": 2.0e6, "hf": 1.0e6, "ours+adapter": 1.8e6},
           "mfu": {"ours": 0.41, "ours+adapter": 0.4}, "first_step_s": {"ours": 40.0}, "real_tokens_per_batch": 60000,
           "loop": {"tokens_per_s": 1.7e6, "wall_tokens_per_s": 1.5e6, "mfu": 0.38, "wall_mfu": 0.33,
                    "loop_vs_bench": 0.944}}
    bench = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "runs": {"t512": run}}
    (tmp_path / "gpu_bench.json").write_text(json.dumps(bench), encoding="utf-8")
    page = gen.render_gpu(tmp_path, full)
    assert "| T=512 compiled | 1,700,000 | 1,500,000 | 38.0% | 33.0% | 0.94× |" in page
    assert "| T=512 compiled | 2,000,000 | 1,000,000 | 1,800,000 | 2.00× | 41.0% | 40.0% | 40.0 |" in page
    todo = page.split("Not measured yet:")[1]
    assert "first-step latency" in todo and "bf16 labelling" in todo and "pipeline loop" not in todo
    del run["loop"]  # a bench from before the loop rows
    (tmp_path / "gpu_bench.json").write_text(json.dumps(bench), encoding="utf-8")
    page = gen.render_gpu(tmp_path, full)
    assert "| T=512 compiled | not measured yet | not measured yet |" in page
    assert "the pipeline loop rows" in page.split("Not measured yet:")[1]
    (tmp_path / "gpu_bench.json").write_text(json.dumps({**bench, "dry_run": True}), encoding="utf-8")
    assert gen.render_gpu(tmp_path, full).startswith("Not measured yet (")
    assert "the pretraining check" in gen.render_gpu(tmp_path, full)  # named as not measured
    pre = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "config": "configs/full.yaml", "steps": 300,
           "shape": {"rows": 32, "max_seq_len": 512}, "corpus": "the demo store", "mfu": 0.42, "tokens_per_s": 2.5e6,
           "host_ms": 0.8, "gpu_ms": 6.5, "syncs_per_step": 0.0, "graphs_captured": 1, "fallbacks": [],
           "fill": 0.996, "ours_vs_hf": 2.4}
    (tmp_path / "gpu_pretrain.json").write_text(json.dumps(pre), encoding="utf-8")
    page = gen.render_gpu(tmp_path, full)
    assert "32 packed rows × 512 tokens" in page and "MFU 42.0% (attention over pair lengths)" in page
    assert "0 fallback line(s)" in page and "ours / HF on the same pairs 2.4×" in page
    assert "the pretraining check" not in page.split("Not measured yet:")[1]
