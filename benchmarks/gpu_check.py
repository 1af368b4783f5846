"""The prepared GPU check (run through ``benchmarks/gpu_check.sh``): one short pass over what a GPU machine is for.

1. ``bench_pretrain.py`` at the seed size, B=128: T=128 eager and T=512 compiled (ours, HF, ours+adapter; MFU,
   first-step latency), each with its pipeline loop rows: the pretraining stage's own loop at the same shape (real
   optimizer, clipping, buckets, loader, adapter), tokens/s and MFU compute only and over the wall time, and its
   ratio to the bench (``loop_mfu_t512``, ``loop_mfu_t128``, ``loop_vs_bench_t512``, ``loop_vs_bench_t128`` at the
   top of ``gpu_bench.json``).
2. The ChnSentiCorp GPU profile (``configs/chnsenticorp_gpu.yaml``) with ``--steps`` pretraining steps (default
   1500, warm-up a tenth: what fits the 5 minutes after the bench on one H100), through fine-tuning and the bundle:
   the first step's latency, tokens/s and MFU from the pretrain manifest (compute only and over the stage's wall
   time), GPU busy fraction (nvidia-smi sampled
   every 0.5 s while the stage runs), test accuracy of the shipped classifier and of the encoder alone.
3. bf16 labelling of the ChnSentiCorp test texts with that bundle at batch 32 and 256 (rows/s).

Each part writes its JSON under ``--out`` as soon as it ends (``gpu_bench.json``, ``gpu_profile.json``,
``gpu_label.json``; default ``docs/results``), so a run cut short keeps what it measured; ``docs/gen.py`` builds the
GPU guide's table from them. The last line: ``gpu_check mfu_t512=<x> mfu_t128=<y> loop_mfu_t512=<x>
loop_mfu_t128=<y> loop_vs_bench=<r>x ours_vs_hf=<z>x first_step_s=<s> busy=<f> chnsenticorp_test_acc=<a>``
(``na`` where a figure is not measured: MFU on CPU or on a GPU of unknown peak; ``loop_vs_bench`` at T=512).

``--dry-run``: the same parts on CPU at toy size (a tiny model, 2 timed steps, ``aot_eager`` instead of inductor),
written to a temporary directory unless ``--out`` is given; the bench runs beside the profile and labelling (on CPU
nothing it measures is a figure to keep). Without ``--config`` it needs nothing but the checkout: it writes toy
inputs (a synthetic Chinese corpus, word vectors, labelled reviews) and a CPU profile of 4 pretraining steps into
the temporary directory, and labels the reviews.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--out", help="where the gpu_*.json go (default docs/results; dry run: a temporary directory)")
    ap.add_argument("--config", help=f"the profile to run (default {GPU_PROFILE}; dry run: a CPU profile over toy "
                    "inputs that it writes itself)")
    ap.add_argument("--steps", type=int, help=f"pretraining steps of the profile run (default {PROFILE_STEPS}; dry "
                    f"run with its own profile: {DRY_STEPS})")
    ap.add_argument("--store", help="artifact store of the profile run (default: a temporary directory)")
    ap.add_argument("--label-input", help="texts to label (default: the profile's finetune test file)")
    ap.add_argument("--text-column", default=DEFAULT_TEXT_COLUMN)
    args = ap.parse_args(argv)
    out = Path(args.out or (tempfile.mkdtemp(prefix="gpu-check-") if args.dry_run else REPO / "docs" / "results"))
    toy = args.dry_run and args.config is None  # the dry run's own inputs and profile: nothing outside the checkout
    with tempfile.TemporaryDirectory(prefix="gpu-check-toy-") as toy_dir:
        if toy:
            args.config = str(toy_profile(Path(toy_dir)))
        return check(args, out, toy)


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
