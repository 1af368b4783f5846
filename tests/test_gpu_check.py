"""``benchmarks/gpu_check.sh --dry-run``: the GPU check on CPU at toy size, its JSON files and its last line: by
default the profile's pretraining and the HF comparison on the same pairs; with ``--full`` every part of the
whole-pipeline check (bench at both shapes, a small profile through the bundle, labelling at two batch sizes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_config_data
from tests.test_e2e import _tiny_reviews

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
PRETRAIN_LINE = (r"gpu_check mfu=na host_ms=[\d.]+ gpu_ms=na syncs_per_step=na graphs=0 fallbacks=0 "
                 r"ours_vs_hf=[\d.]+x fill=[\d.]+")
LAST_LINE = (r"gpu_check mfu_t512=\S+ mfu_t128=\S+ loop_mfu_t512=\S+ loop_mfu_t128=\S+ loop_vs_bench=[\d.]+x "
             r"ours_vs_hf=[\d.]+x first_step_s=[\d.]+ busy=\S+ chnsenticorp_test_acc=[\d.]+")


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_gpu_check_dry_run_writes_every_part_and_the_summary_line(tiny_inputs, prefect_server, tmp_path):
    reviews = tmp_path / "reviews.csv"
    _tiny_reviews(reviews)
    profile = tiny_config_data(tiny_inputs, str(tmp_path / "store"), pretrain={
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
        "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4},
        "log_every": 2, "threads": 1, "device": "cpu"},
        finetune={"data_uri": str(reviews), "max_len": 64, "batch_size": 16, "use_layers": 1, "max_epochs": 1,
                  "patience": 1, "lr": 1e-3, "threads": 1, "device": "cpu"})
    config = tmp_path / "profile.yaml"
    config.write_text(yaml.safe_dump(profile), encoding="utf-8")
    out = tmp_path / "results"
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONHASHSEED": "0"}
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--full", "--out", str(out),
                           "--config", str(config), "--steps", "4", "--label-input", str(reviews), "--text-column",
                           "review"],
                          cwd=REPO, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(LAST_LINE, last), last
    # a non-TTY run: the pretraining progress lines reach stderr, one per log row (log_every 2 of 4 steps), for each
    # of the three runs of the stage's loop: the bench's pipeline-loop rows at T=128 and T=512 (2 warm-up + 2 timed
    # steps each) and the profile's 4 steps
    rows = [ln.split("pretrain step ")[1].split(" |")[0] for ln in proc.stderr.splitlines() if "pretrain step " in ln]
    assert rows == ["2/4", "4/4"] * 3, (rows, proc.stderr[-3000:])
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert set(bench["runs"]) == {"t128", "t512"} and bench["runs"]["t512"]["compile"] is True
    assert bench["runs"]["t128"]["tokens_per_s"]["ours+adapter"] > 0 and "mfu" in bench["runs"]["t128"]
    for shape in ("t128", "t512"):  # the pipeline loop rows: the stage's own loop at the bench's shape
        loop = bench["runs"][shape]["loop"]
        assert loop["tokens_per_s"] > 0 and 0 < loop["wall_tokens_per_s"] <= loop["tokens_per_s"]
        assert loop["mfu"] is None and bench[f"loop_mfu_{shape}"] is None  # on CPU: no peak, no MFU
        assert bench[f"loop_vs_bench_{shape}"] > 0
    assert bench["runs"]["t512"]["loop"]["compile"] is True and bench["runs"]["t512"]["loop"]["buckets"]
    assert bench["dry_run"] is True and bench["torch"] and "git_revision" in bench
    prof = json.loads((out / "gpu_profile.json").read_text())
    assert prof["steps"] == 4 and prof["first_step_s"] > 0 and 0.0 <= prof["test_accuracy"] <= 1.0
    tp = prof["throughput"]  # the pretrain manifest's figures: compute only and over the stage's wall time
    assert tp["tokens"] > 0 and 0 < tp["wall_tokens_per_s"] <= tp["tokens_per_s"] and tp["mfu"] is None
    assert prof["encoder_test_accuracy"] is not None
    lab = json.loads((out / "gpu_label.json").read_text())
    assert sorted(r["batch_size"] for r in lab["runs"].values()) == [32, 256]
    assert all(r["rows"] == 300 and r["rows_per_s"] > 0 for r in lab["runs"].values())


@pytest.mark.heavy  # about 5 minutes on 2 cores (three temporary Prefect servers): make test-heavy and CI run it
def test_gpu_check_dry_run_alone_in_a_bare_checkout_builds_its_own_inputs(tmp_path):
    """``benchmarks/gpu_check.sh --dry-run --full`` and nothing else, in a copy of the checkout without ``.demo/``
    and with no ``../shared`` beside it, on a machine without CUDA: it writes toy inputs and a CPU profile itself
    and ends with its ``gpu_check ...`` line."""
    checkout = tmp_path / "checkout"
    skip = {".git", ".demo", ".eval", ".venv", "data", "site"}  # at the top: inputs, stores, builds

    def ignore(where: str, names: list[str]) -> set[str]:
        top = Path(where) == REPO
        return {n for n in names if (top and n in skip) or n == "__pycache__" or n.endswith("_cache")}

    shutil.copytree(REPO, checkout, ignore=ignore)
    assert not (checkout / ".demo").exists() and not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "PYTHONPATH"}
    proc = subprocess.run([str(checkout / "benchmarks" / "gpu_check.sh"), "--dry-run", "--full"], cwd=tmp_path,
                          env={**env, "PYTHON": sys.executable, "PYTHONHASHSEED": "0"}, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check ") and re.fullmatch(LAST_LINE, last), last
    assert "dry run on toy inputs" in proc.stdout and "Torch not compiled with CUDA" not in proc.stderr


@pytest.mark.heavy  # about a minute on 2 cores (a compiled bench of three tiny models)
def test_gpu_check_dry_run_pretrains_the_profile_and_compares_hf_on_the_same_pairs(tmp_path):
    """The default check at toy size: full.yaml's pretrain section (packed rows, compile, the sparse table) on
    synthetic rows, then the same pairs through HF; one JSON written after each part, and the last line."""
    out = tmp_path / "results"
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONHASHSEED": "0"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(PRETRAIN_LINE, last), last
    assert proc.stdout.count("wrote ") == 2  # after each part
    r = json.loads((out / "gpu_pretrain.json").read_text())
    assert r["config"] == "configs/full.yaml" and r["steps"] == 4 and r["compile"] is True
    assert r["shape"]["packing"] == "pairs" and r["word_table"] == "sparse"
    assert 0.9 < r["fill"] <= 1 and r["host_ms"] > 0 and r["fallbacks"] == [] and r["dynamo"]["graph_breaks"] == 0
    assert r["syncs"] is None and r["gpu_ms"] is None  # CUDA only
    assert r["hf"]["packed"] is True and r["hf"]["tokens_per_s"]["hf"] > 0 and r["ours_vs_hf"] > 0


def test_fallback_lines_are_the_ones_that_say_the_path_changed():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import fallback_lines

    lines = ["INFO lexiflow: pretrain: CUDA graph 1 captured (input_ids [32, 512])",
             "WARNING lexiflow: pretrain: CUDA graph capture failed (RuntimeError: x); the run goes on without CUDA "
             "graphs", "INFO lexiflow: pretrain step 50/300 | loss 7.1"]
    assert fallback_lines(lines) == [lines[1]]


def test_a_profile_with_missing_inputs_stops_the_check_before_any_part_runs(tmp_path):
    """On a GPU machine without the profile's data copied over, the check stops at once (exit 2) with one line
    that names every missing input, before the bench spends minutes of the machine's time: no result file."""
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({"store_uri": str(tmp_path / "store"), "prepare": {
        "corpus_uri": str(tmp_path / "wiki/*"), "embeddings_uri": str(tmp_path / "tencent.txt")}}), encoding="utf-8")
    out = tmp_path / "results"
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--full", "--out", str(out), "--config",
                           str(profile)],
                          cwd=tmp_path, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu_check: ") and "input(s) not found" in last and "docs/gpu.md" in last, last
    assert f"prepare.corpus_uri {tmp_path}/wiki/*" in last, last
    assert f"prepare.embeddings_uri {tmp_path}/tencent.txt" in last, last
    assert not out.exists() and proc.stdout == ""
