"""The prepared GPU check (run through ``benchmarks/gpu_check.sh``): what one lent GPU is for, within its window.

By default (about 300 steps; meant to fit 8 minutes on one H100 with the project installed, start-up included):

1. **The GPU profile's own pretraining** (``configs/full.yaml``'s ``pretrain`` section, or ``--config``'s: packed
   rows, ``compile``, the sparse word table) with CUDA graphs on, ``--steps`` steps (default 300, warm-up a tenth)
   of the pretraining loop (``tasks.pretrain.train.train``, no Prefect) on a corpus sample it carries: ``--lexicon``'s
   matched shards (default: the demo store's, ``.demo/store``, about 40 MB; synthetic demo-like rows without one).
   It runs under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call the steps make is counted
   (``syncs``, ``syncs_per_step``, the most frequent ones by message). Reported from the stage's own figures: host
   milliseconds a step outside the model (``host_ms``), GPU milliseconds a step (CUDA events, ``gpu_ms``), tokens/s,
   MFU with attention counted over each pair's length (``mfu``), ``fill``; the CUDA graphs captured and every log
   line of the run that says something fell back (a failed capture, a recompilation...: ``fallbacks``, which should
   be empty), and dynamo's graph and graph-break counts. Written to ``gpu_pretrain.json`` as soon as it ends.
2. **The same pairs in Hugging Face's BertForPreTraining** (``bench_pretrain.py --packed``: our model on packed
   rows of the corpus's pairs, HF on exactly the same pairs one a row, padded to the batch's longest; both compiled):
   tokens/s, ours/HF and the bench's MFU. Added to ``gpu_pretrain.json`` as ``hf``.

The last line: ``gpu_check mfu=<x> host_ms=<h> gpu_ms=<g> syncs_per_step=<s> graphs=<n> fallbacks=<k>
ours_vs_hf=<r>x fill=<f>`` (``na`` where not measured: MFU on CPU or on a GPU of unknown peak).

``--full``: the whole-pipeline check instead (longer than a lent GPU's window: 20 minutes or more):

1. ``bench_pretrain.py`` at the seed size, B=128: T=128 eager and T=512 compiled (ours, HF, ours+adapter; MFU,
   first-step latency), each with its pipeline loop rows: the pretraining stage's own loop at the same shape (real
   optimizer, clipping, buckets, loader, adapter), tokens/s and MFU compute only and over the wall time, and its
   ratio to the bench (``loop_mfu_t512``, ``loop_mfu_t128``, ``loop_vs_bench_t512``, ``loop_vs_bench_t128`` at the
   top of ``gpu_bench.json``).
2. The ChnSentiCorp GPU profile (``configs/chnsenticorp_gpu.yaml``) with ``--steps`` pretraining steps (default
   1500, warm-up a tenth), through fine-tuning and the bundle: the first step's latency, tokens/s and MFU from the
   pretrain manifest (compute only and over the stage's wall time), GPU busy fraction (nvidia-smi sampled
   every 0.5 s while the stage runs), test accuracy of the shipped classifier and of the encoder alone.
3. bf16 labelling of the ChnSentiCorp test texts with that bundle at batch 32 and 256 (rows/s).

Each part writes its JSON under ``--out`` as soon as it ends (``gpu_bench.json``, ``gpu_profile.json``,
``gpu_label.json``; default ``docs/results``), so a run cut short keeps what it measured; ``docs/gen.py`` builds the
GPU guide's table from them. The last line: ``gpu_check mfu_t512=<x> mfu_t128=<y> loop_mfu_t512=<x>
loop_mfu_t128=<y> loop_vs_bench=<r>x ours_vs_hf=<z>x first_step_s=<s> busy=<f> chnsenticorp_test_acc=<a>``.

``--dry-run``: the same parts on CPU at toy size (a tiny model, a few steps, ``aot_eager`` instead of inductor, no
CUDA graphs or sync counting: CUDA only), written to a temporary directory unless ``--out`` is given; nothing it
measures is a figure to keep. Without ``--lexicon`` (default check) or ``--config`` (``--full``) it needs nothing but
the checkout: synthetic rows, or toy inputs and a CPU profile it writes into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILE_STEPS = 1500
GPU_PROFILE = "configs/chnsenticorp_gpu.yaml"
PRETRAIN_PROFILE = "configs/full.yaml"  # the default check runs its pretrain section
PRETRAIN_STEPS = 300
DRY_PRETRAIN_STEPS = 4
FALLBACK_WORDS = ("fall back", "falls back", "fell back", "fallback", "failed", "without cuda graphs", "recompil",
                  "ignored")  # a log line with one of these says the run did not take the path it was set for
DRY_STEPS = 4  # pretraining steps of the dry run's own profile
DEFAULT_TEXT_COLUMN = "text_a"


def sh(cmd: list[str], **kw) -> str:
    """stdout of a command ('' when it is missing or fails)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or None,
            "torch": torch.__version__,
            "git_revision": sh(["git", "rev-parse", "--short", "HEAD"], cwd=REPO) or None,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


class BusySampler:
    """GPU utilisation from ``nvidia-smi`` every ``every_s`` while the block runs; ``busy`` is the mean
    utilisation as a fraction (None without nvidia-smi)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every_s):
            out = sh(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
            if out:
                self.samples.append(float(out.splitlines()[0]) / 100)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def busy(self) -> float | None:
        return round(statistics.mean(self.samples), 3) if self.samples else None


def write(out: Path, name: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"gpu_check: wrote {out / name}", flush=True)


def env() -> dict:
    """The parts' environment: the checkout on the path; a temporary Prefect server (no PREFECT_API_URL) given
    minutes to start, not Prefect's 20 s (a busy machine: on a dry run the bench runs beside it)."""
    return {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def bench(out: Path, info: dict, dry: bool) -> dict:
    """bench_pretrain at T=128 eager and T=512 compiled."""
    shapes = {"t128": ["--seq-len", "128"], "t512": ["--seq-len", "512", "--compile"]}
    size = ["--batch", "128", "--steps", "20", "--repeats", "3", "--warmup", "3"]
    if dry:
        size = ["--batch", "4", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--vocab", "300",
                "--steps", "2", "--repeats", "1", "--warmup", "2", "--no-numerics-ab", "--no-loader",
                "--compile-backend", "aot_eager"]
        shapes = {"t128": ["--seq-len", "32"], "t512": ["--seq-len", "64", "--compile"]}
    result = {**info, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in shapes.items():
            path = f"{tmp}/{name}.json"
            t = time.perf_counter()
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pretrain.py"), *size, *extra,
                            "--results", path], check=True, cwd=REPO, env=env())
            run = json.loads(Path(path).read_text())
            run["wall_s"] = round(time.perf_counter() - t, 1)
            result["runs"][name] = run
            for key in ("loop_mfu", "loop_wall_mfu", "loop_vs_bench"):  # the pipeline loop's figures, by shape
                result[f"{key}_{name}"] = run.get(key)
            write(out, "gpu_bench.json", result)  # partial results as it goes
    return result


class LogLines(logging.Handler):
    """Every message of the ``lexiflow`` logger (INFO and up) and of ``torch``'s (at its own level: warnings) while
    installed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._loggers = [logging.getLogger(n) for n in ("lexiflow", "torch")]

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    def __enter__(self):
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.addHandler(self)
        self._loggers[0].setLevel(min(self._loggers[0].getEffectiveLevel(), logging.INFO))
        return self

    def __exit__(self, *exc):
        for lg, level in zip(self._loggers, self._levels):
            lg.removeHandler(self)
            lg.setLevel(level)


def fallback_lines(lines: list[str]) -> list[str]:
    """The log lines that say the run left the path it was set for (a failed capture, a recompilation...)."""
    return [ln for ln in lines if any(w in ln.lower() for w in FALLBACK_WORDS)]


def pretrain_config(config: str, steps: int, dry: bool, graphs: bool):
    """``config``'s pretrain section for ``steps`` steps of the check (no checkpoints, one held-out evaluation at
    the end), CUDA graphs on with ``graphs``; a dry run shrinks the model and runs on CPU (aot_eager, no graphs)."""
    import yaml

    from tasks.pretrain.config import PretrainConfig

    section = dict(yaml.safe_load((REPO / config).read_text(encoding="utf-8"))["pretrain"])
    for key in ("extra_texts", "init_from", "gpus", "nnodes"):  # one process on the carried sample only
        section.pop(key, None)
    section.update(steps=steps, warmup_steps=max(1, steps // 10), log_every=max(1, steps // 6), eval_every=steps,
                   checkpoint_every=steps, cuda_graphs=graphs and not dry)
    if dry:
        section["model"] = {**section.get("model", {}), "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                            "ffn_size": 64, "max_len": 64}
        section["data"] = {**section.get("data", {}), "max_seq_len": 64, "batch_size": 4, "pairs_per_row": 8}
        section.update(device="cpu", compile_backend="aot_eager", threads=1)
    return PretrainConfig.model_validate(section)


def corpus_rows(lexicon: str | None, dry: bool) -> tuple:
    """(rows factory, vocabulary, word vectors, W, where from): ``lexicon``'s matched shards; by default the demo
    store's newest lexicon (not in a dry run); else synthetic demo-like rows."""
    import glob

    import numpy as np

    found = [lexicon] if lexicon else [] if dry else sorted(glob.glob(str(REPO / ".demo/store/lexicon/*[0-9a-f]")))
    if found:
        from storage.artifacts import open_artifact
        from tasks.pretrain.stage import lexicon_inputs, rows_from_artifact

        vocab, vectors, W = lexicon_inputs(open_artifact(found[-1]))
        return rows_from_artifact(found[-1]), vocab, vectors, W, found[-1]
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_loader import synthetic_rows

    from tasks.pretrain.data import rows_of

    V, WV, W = 21128, 5000, 3
    vectors = np.random.default_rng(0).normal(0, 0.1, (WV, 16 if dry else 200)).astype(np.float32)
    return rows_of(synthetic_rows(60 if dry else 4000, 0, W, V, WV)), V, vectors, W, "synthetic demo-like rows"


def pretrain_check(out: Path, info: dict, args: argparse.Namespace) -> dict:
    """Part 1 of the default check: the profile's pretraining under the sync debug mode (module docstring)."""
    import warnings

    import torch

    from tasks.pretrain.train import train

    dry = args.dry_run
    cfg = pretrain_config(args.config, args.steps, dry, args.graphs)
    rows, vocab, vectors, W, source = corpus_rows(args.lexicon, dry)
    print(f"gpu_check: pretraining {args.steps} steps of {args.config}'s pretrain section on {source}", flush=True)
    cuda = torch.cuda.is_available() and not dry
    got: dict = {}
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    t = time.perf_counter()
    with LogLines() as logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            _, log = train(cfg, rows, vocab, vectors, W, progress=False, on_data=got.update)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    wall = time.perf_counter() - t
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    tp = got.get("throughput") or {}
    steps = args.steps
    result = {
        **info, "config": args.config, "corpus": source, "steps": steps, "wall_s": round(wall, 1),
        "shape": {"rows": cfg.data.batch_size, "max_seq_len": cfg.data.max_seq_len, "packing": cfg.data.packing,
                  "pairs_per_row": cfg.data.pairs_per_row},
        "compile": cfg.compile, "cuda_graphs": cfg.cuda_graphs, "word_table": cfg.model.word_table,
        "sync_debug_mode": "warn" if cuda else None, "syncs": len(syncs) if cuda else None,
        "syncs_per_step": round(len(syncs) / steps, 3) if cuda else None,
        "sync_messages": {m: syncs.count(m) for m in sorted(set(syncs), key=syncs.count, reverse=True)[:10]},
        "host_ms": got.get("host_ms"), "fill": got.get("fill"),
        "gpu_ms": round(1e3 * tp["compute_s"] / steps, 3) if (cuda and tp.get("compute_s")) else None,
        "tokens_per_s": tp.get("tokens_per_s"), "mfu": tp.get("mfu"), "wall_mfu": tp.get("wall_mfu"),
        "first_step_s": got.get("first_step_s"), "throughput": tp,
        "graphs_captured": sum("CUDA graph" in ln and "captured" in ln for ln in logs.lines),
        "fallbacks": fallback_lines(logs.lines),
        "dynamo": {"unique_graphs": counters["stats"].get("unique_graphs", 0),
                   "graph_breaks": sum(counters["graph_break"].values())},
        "log": log,
    }
    write(out, "gpu_pretrain.json", result)
    return result


def hf_part(out: Path, result: dict, args: argparse.Namespace) -> dict:
    """Part 2 of the default check: ``bench_pretrain.py --packed`` at the profile's shape, ours against HF on the
    same pairs; added to ``gpu_pretrain.json``."""
    shape = result["shape"]
    size = ["--batch", str(shape["rows"]), "--seq-len", str(shape["max_seq_len"]), "--pairs-per-row",
            str(shape["pairs_per_row"]), "--packed", "--compile", "--no-loop", "--no-loader", "--no-numerics-ab",
            "--steps", "20", "--repeats", "3", "--warmup", "3"]
    if args.dry_run:
        size = ["--batch", "4", "--seq-len", "64", "--pairs-per-row", "8", "--packed", "--no-loop", "--no-loader",
                "--no-numerics-ab", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--steps", "2",
                "--repeats", "1", "--warmup", "2", "--compile", "--compile-backend", "aot_eager", "--device", "cpu"]
    if args.lexicon:
        size += ["--lexicon", args.lexicon]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pretrain.py"), *size, "--results",
                        f"{tmp}/hf.json"], check=True, cwd=REPO, env=env())
        run = json.loads(Path(f"{tmp}/hf.json").read_text())
    run["wall_s"] = round(time.perf_counter() - t, 1)
    rates = run["tokens_per_s"]
    result["hf"] = run
    result["ours_vs_hf"] = round(rates["ours"] / rates["hf"], 3)
    write(out, "gpu_pretrain.json", result)
    return result


def cli(*args: str) -> str:
    """``lexiflow`` with these arguments; its last stdout line."""
    proc = subprocess.run([sys.executable, "-m", "lexiflow", *args], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"gpu_check: lexiflow {' '.join(args)} failed with exit code {proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def manifest(uri: str) -> dict:
    from storage.artifacts import open_artifact

    return open_artifact(uri).manifest


def profile(out: Path, info: dict, config: str, steps: int, store: str) -> dict:
    """The profile through the bundle; figures from the manifests."""
    warmup = max(1, steps // 10)
    sets = ["--set", f"pretrain.steps={steps}", "--set", f"pretrain.warmup_steps={warmup}",
            "--set", f"pretrain.checkpoint_every={steps}", "--set", f"store_uri={store}"]
    t = time.perf_counter()
    with BusySampler() as gpu:
        ref = json.loads(cli("run", "pipeline", "--config", config, *sets))
    parents = {p.stage: p for p in manifest(ref["uri"]).parents}  # the pipeline's last line: the bundle's ref
    ft = manifest(parents["finetune"].uri)
    pre = manifest(next(p for p in ft.parents if p.stage == "pretrain").uri)
    m = ft.metrics
    result = {**info, "config": config, "steps": steps, "warmup_steps": warmup, "wall_s": round(time.perf_counter()
                                                                                                   - t, 1),
              "busy": gpu.busy, "first_step_s": pre.run.get("first_step_s"),
              "median_tokens_per_s": pre.run.get("median_tokens_per_s"), "median_mfu": pre.run.get("median_mfu"),
              "throughput": pre.run.get("throughput"),  # the stage's tokens/s and MFU: compute only, and wall
              "pretrain_wall_s": pre.run.get("wall_s"), "heldout_mlm_acc": pre.metrics.get("heldout_mlm_acc"),
              "test_accuracy": m.get("test_accuracy"),
              "encoder_test_accuracy": m.get("encoder_test_accuracy", m.get("test_accuracy")),
              "bundle_uri": ref["uri"],
              "test_uri": (ft.config.get("test_uri") or "")}
    write(out, "gpu_profile.json", result)
    return result


def label(out: Path, info: dict, bundle_uri: str, texts: str, column: str, dry: bool) -> dict:
    """bf16 labelling (the CUDA default) of ``texts`` at batch 32 and 256: rows/s."""
    result = {**info, "input": texts, "runs": {}}
    for batch in (32, 256):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            summary = json.loads(cli("label", "--bundle", bundle_uri, "--input", texts, "--text-column", column,
                                     "--batch-size", str(batch), "--output", f"{tmp}/out"))
            wall = time.perf_counter() - t
        rows = (summary.get("stats") or {}).get("out")
        result["runs"][f"batch{batch}"] = {"batch_size": batch, "rows": rows, "wall_s": round(wall, 2),
                                           "rows_per_s": round(rows / wall, 1) if rows else None,
                                           "precision": "fp32" if dry else "bf16"}
        write(out, "gpu_label.json", result)
    return result


# A synthetic corpus for the dry run: characters from a fixed CJK range, words of 2-3 of them, sentences of words.
TOY_CHARS = [chr(0x4E00 + 37 * i) for i in range(300)]


def toy_inputs(root: Path, seed: int = 0) -> dict[str, str]:
    """Inputs for a dry run that needs nothing outside the checkout: a wiki2019zh JSON-lines corpus of 300 documents
    (3 files), word vectors in the Tencent text format (the corpus's words, 8 dimensions) and 300 labelled reviews
    (label,review; the label follows which words a review uses, so fine-tuning has something to learn). Seeded."""
    import random

    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(TOY_CHARS) for _ in range(rng.choice((2, 3)))) for _ in range(800)})
    good, bad = words[:40], words[40:80]

    def sentence(extra: list[str] = ()) -> str:
        return "".join(rng.choice(words[80:]) for _ in range(rng.randint(4, 12))) + "".join(extra) + "。"

    (root / "corpus").mkdir(parents=True, exist_ok=True)
    for fi in range(3):
        with open(root / "corpus" / f"wiki_{fi:02d}.jsonl", "w", encoding="utf-8") as f:
            for di in range(100):
                text = "\n".join(sentence() for _ in range(rng.randint(3, 12)))
                f.write(json.dumps({"id": f"d{fi}-{di}", "url": "", "title": text[:6], "text": text},
                                   ensure_ascii=False) + "\n")
    with open(root / "tencent.txt", "w", encoding="utf-8") as f:
        f.write(f"{len(words)} 8\n")
        for w in words:
            f.write(w + " " + " ".join(f"{rng.gauss(0, 0.5):.5f}" for _ in range(8)) + "\n")
    with open(root / "reviews.csv", "w", encoding="utf-8") as f:
        f.write("label,review\n")
        for i in range(300):
            label = i % 2
            f.write(f"{label},{sentence([rng.choice(good if label else bad) for _ in range(2)])}\n")
    return {"corpus": str(root / "corpus" / "*.jsonl"), "embeddings": str(root / "tencent.txt"),
            "reviews": str(root / "reviews.csv")}


def toy_profile(root: Path) -> Path:
    """A CPU profile over :func:`toy_inputs` (written under ``root``): a tiny model, no compilation, CPU devices."""
    import yaml

    inputs = toy_inputs(root / "inputs")
    profile = {
        "store_uri": str(root / "store"), "progress": False, "runner": {"kind": "thread", "max_workers": 2},
        "prepare": {"corpus_uri": inputs["corpus"], "embeddings_uri": inputs["embeddings"],
                    "clean": {"shard_rows": 500}},
        "pretrain": {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
                     "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4},
                     "log_every": 2, "threads": 1, "device": "cpu"},
        "finetune": {"data_uri": inputs["reviews"], "text_column": "review", "max_len": 64, "batch_size": 16,
                     "use_layers": 1, "max_epochs": 1, "patience": 1, "lr": 1e-3, "threads": 1, "device": "cpu"},
    }
    path = root / "profile.yaml"
    path.write_text(yaml.safe_dump(profile, allow_unicode=True), encoding="utf-8")
    return path


def _f(v, digits=3) -> str:
    return "na" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="everything on CPU at toy size, into a temporary dir")
    ap.add_argument("--full", action="store_true", help="the whole-pipeline check (bench at two shapes, the "
                    "ChnSentiCorp profile through the bundle, labelling) instead of the pretraining check")
    ap.add_argument("--lexicon", help="the pretraining check's corpus: a lexicon artifact whose matched shards it "
                    "trains on (default: the demo store's; a dry run: synthetic rows)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="the pretraining check with CUDA graphs (default on)")
    ap.add_argument("--out", help="where the gpu_*.json go (default docs/results; dry run: a temporary directory)")
    ap.add_argument("--config", help=f"the profile whose pretrain section the check runs (default "
                    f"{PRETRAIN_PROFILE}); with --full, the profile to run (default {GPU_PROFILE}; dry run: a CPU "
                    "profile over toy inputs that it writes itself)")
    ap.add_argument("--steps", type=int, help=f"pretraining steps (default {PRETRAIN_STEPS}, dry run "
                    f"{DRY_PRETRAIN_STEPS}; with --full {PROFILE_STEPS}, dry run with its own profile {DRY_STEPS})")
    ap.add_argument("--store", help="artifact store of the profile run (default: a temporary directory)")
    ap.add_argument("--label-input", help="texts to label (default: the profile's finetune test file)")
    ap.add_argument("--text-column", default=DEFAULT_TEXT_COLUMN)
    args = ap.parse_args(argv)
    out = Path(args.out or (tempfile.mkdtemp(prefix="gpu-check-") if args.dry_run else REPO / "docs" / "results"))
    if not args.full:
        return check_pretrain(args, out)
    toy = args.dry_run and args.config is None  # the dry run's own inputs and profile: nothing outside the checkout
    with tempfile.TemporaryDirectory(prefix="gpu-check-toy-") as toy_dir:
        if toy:
            args.config = str(toy_profile(Path(toy_dir)))
        return check(args, out, toy)


def check_pretrain(args: argparse.Namespace, out: Path) -> int:
    """The default check's two parts, then its last line."""
    args.config = args.config or PRETRAIN_PROFILE
    args.steps = args.steps or (DRY_PRETRAIN_STEPS if args.dry_run else PRETRAIN_STEPS)
    info = {**machine(), "dry_run": args.dry_run}
    print(f"gpu_check: {info['device']}, torch {info['torch']}, driver {info['driver']}, rev {info['git_revision']}; "
          f"results in {out}", flush=True)
    r = pretrain_check(out, info, args)
    r = hf_part(out, r, args)
    print(f"gpu_check mfu={_f(r['mfu'])} host_ms={_f(r['host_ms'], 2)} gpu_ms={_f(r['gpu_ms'], 2)} "
          f"syncs_per_step={_f(r['syncs_per_step'], 2)} graphs={r['graphs_captured']} "
          f"fallbacks={len(r['fallbacks'])} ours_vs_hf={r['ours_vs_hf']:.2f}x fill={_f(r['fill'])}", flush=True)
    return 0


def missing_inputs(config: str, label_input: str | None) -> str | None:
    """What the profile run and the labelling would miss (every input of ``config`` and ``label_input``, and a
    profile asking for CUDA where torch has none), in one line; None when nothing is missing."""
    import fsspec

    from flows.profiles import load_flow_config, preflight

    try:
        preflight("pipeline", load_flow_config("pipeline", config))
        if label_input and not fsspec.open_files(label_input):
            raise FileNotFoundError(f"--label-input {label_input} not found")
    except (OSError, ValueError) as e:
        return f"{e} (profile {config}; copy the inputs onto this machine first: docs/gpu.md, \"The GPU check\")"
    return None


def check(args: argparse.Namespace, out: Path, toy: bool) -> int:
    """The check's parts, then its last line."""
    if toy:
        args.label_input = args.label_input or str(Path(args.config).parent / "inputs" / "reviews.csv")
        args.text_column = "review" if args.text_column == DEFAULT_TEXT_COLUMN else args.text_column
        print(f"gpu_check: dry run on toy inputs, profile {args.config}", flush=True)
    args.config = args.config or GPU_PROFILE
    args.steps = args.steps or (DRY_STEPS if toy else PROFILE_STEPS)
    missing = missing_inputs(args.config, args.label_input)
    if missing:  # before any part runs: on a GPU machine the bench alone costs minutes of its time
        print(f"gpu_check: {missing}", file=sys.stderr, flush=True)
        return 2
    info = {**machine(), "dry_run": args.dry_run}
    print(f"gpu_check: {info['device']}, torch {info['torch']}, driver {info['driver']}, rev {info['git_revision']}; "
          f"results in {out}", flush=True)

    def profile_and_label() -> dict:
        with tempfile.TemporaryDirectory(prefix="gpu-check-store-") as tmp:
            p = profile(out, info, args.config, args.steps, args.store or f"{tmp}/store")
            texts = args.label_input or p["test_uri"]
            label(out, info, p["bundle_uri"], texts, args.text_column, args.dry_run)
        return p

    if args.dry_run:  # no figure of a dry run is a measurement: the bench runs beside the profile, saving its wall time
        with ThreadPoolExecutor(max_workers=1) as pool:
            benched = pool.submit(bench, out, info, True)
            p = profile_and_label()
            b = benched.result()
    else:  # one part at a time: each has the GPU to itself
        b = bench(out, info, False)
        p = profile_and_label()
    t128, t512 = b["runs"]["t128"], b["runs"]["t512"]
    ratio = t512["tokens_per_s"]["ours"] / t512["tokens_per_s"]["hf"]
    loop_ratio = b.get("loop_vs_bench_t512")
    print(f"gpu_check mfu_t512={_f(t512['mfu']['ours'])} mfu_t128={_f(t128['mfu']['ours'])} "
          f"loop_mfu_t512={_f(b.get('loop_mfu_t512'))} loop_mfu_t128={_f(b.get('loop_mfu_t128'))} "
          f"loop_vs_bench={_f(loop_ratio, 2)}{'x' if loop_ratio is not None else ''} ours_vs_hf={ratio:.2f}x "
          f"first_step_s={_f(p['first_step_s'], 1)} busy={_f(p['busy'], 2)} "
          f"chnsenticorp_test_acc={_f(p['test_accuracy'], 4)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
