"""The prepared GPU check (run through ``benchmarks/gpu_check.sh``): one short pass over what a GPU machine is for.

1. ``bench_pretrain.py`` at the seed size, B=128: T=128 eager and T=512 compiled (ours, HF, ours+adapter; MFU,
   first-step latency).
2. The ChnSentiCorp GPU profile (``configs/chnsenticorp_gpu.yaml``) with ``--steps`` pretraining steps (default
   1500, warm-up a tenth: what fits the 5 minutes after the bench on one H100), through fine-tuning and the bundle:
   the first step's latency, tokens/s and MFU from the pretrain manifest, GPU busy fraction (nvidia-smi sampled
   every 0.5 s while the stage runs), test accuracy of the shipped classifier and of the encoder alone.
3. bf16 labelling of the ChnSentiCorp test texts with that bundle at batch 32 and 256 (rows/s).

Each part writes its JSON under ``--out`` as soon as it ends (``gpu_bench.json``, ``gpu_profile.json``,
``gpu_label.json``; default ``docs/results``), so a run cut short keeps what it measured; ``docs/gen.py`` builds the
GPU guide's table from them. The last line: ``gpu_check mfu_t512=<x> mfu_t128=<y> ours_vs_hf=<z>x
first_step_s=<s> busy=<f> chnsenticorp_test_acc=<a>``.

``--dry-run``: the same parts on CPU at toy size (a tiny model, 2 timed steps, ``aot_eager`` instead of inductor,
``--config`` a small profile), written to a temporary directory unless ``--out`` is given; the bench runs beside the
profile and labelling (on CPU nothing it measures is a figure to keep).
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
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


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


def _f(v, digits=3) -> str:
    return "na" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="everything on CPU at toy size, into a temporary dir")
    ap.add_argument("--out", help="where the gpu_*.json go (default docs/results; dry run: a temporary directory)")
    ap.add_argument("--config", default="configs/chnsenticorp_gpu.yaml", help="the profile to run")
    ap.add_argument("--steps", type=int, default=PROFILE_STEPS, help="pretraining steps of the profile run")
    ap.add_argument("--store", help="artifact store of the profile run (default: a temporary directory)")
    ap.add_argument("--label-input", help="texts to label (default: the profile's finetune test file)")
    ap.add_argument("--text-column", default="text_a")
    args = ap.parse_args(argv)
    out = Path(args.out or (tempfile.mkdtemp(prefix="gpu-check-") if args.dry_run else REPO / "docs" / "results"))
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
    print(f"gpu_check mfu_t512={_f(t512['mfu']['ours'])} mfu_t128={_f(t128['mfu']['ours'])} ours_vs_hf={ratio:.2f}x "
          f"first_step_s={_f(p['first_step_s'], 1)} busy={_f(p['busy'], 2)} "
          f"chnsenticorp_test_acc={_f(p['test_accuracy'], 4)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
