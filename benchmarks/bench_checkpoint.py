"""Benchmark: saving and resuming a full-size word table's checkpoint on CPU, streamed against today's whole copies.

The state is what a pretraining checkpoint holds at full size with ``word_table: sparse``: the adapter's word table
(``--rows`` x ``--dim`` float32, 2M x 200 by default: Tencent's vocabulary) in ``model.safetensors`` beside a small
dense layer, and the table's per-row AdamW state (two moments and a step count per row), with an AdamW optimizer,
a scheduler and the train state. Two ways, each in a fresh process so their peaks do not mix:

- ``streamed``: :func:`tasks.training.checkpoint.save_checkpoint` and :func:`load_checkpoint` as the pretraining
  loop calls them: each tensor streamed to its file and hashed as it goes; the resume hashes the files in pieces,
  then reads each tensor into the model's and the optimizer's own memory.
- ``reference``: the way before it, kept here: the optimizer state ``torch.save``-d into a ``BytesIO`` and copied
  out (``getvalue``), the weights serialised whole (``safetensors.torch.save``), each file hashed and written; the
  resume reads each file whole, hashes it, deserialises it and copies it into the model.

Peak extra memory: the process's resident set sampled every 2 ms (psutil) during the save and the resume, less its
size before them (the state itself), as a fraction of the state's bytes. Seconds: wall time of each. Files go to a
temporary directory on the local disk (``--dir``). When the machine cannot hold the reference's copies at full
size, the reference runs at fewer rows (said in the output and the results file): its fraction does not depend on
the size.

    python benchmarks/bench_checkpoint.py [--rows 2000000] [--dim 200] [--results docs/results/bench_checkpoint.json]

The last line: ``bench_checkpoint save <s> s (reference <s> s), resume <s> s (reference <s> s); peak extra memory
<f> of the state (reference <f>); goal <= 0.2``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy and torch load, as the CLI)

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks._numerics_ab import write_results  # noqa: E402

GOAL = 0.2


class Peak:
    """The resident set's peak above its size at the start, sampled on a thread every ``every_s``."""

    def __init__(self, every_s: float = 0.002):
        self.proc, self.every_s = psutil.Process(), every_s
        self.base = self.top = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.top = max(self.top, self.proc.memory_info().rss)
            time.sleep(self.every_s)

    def __enter__(self) -> "Peak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.top = max(self.top, self.proc.memory_info().rss)

    @property
    def extra(self) -> int:
        """Bytes above the start."""
        return self.top - self.base


def make_state(rows: int, dim: int):
    """(model, opt, sched, state, sparse rows, state bytes): a word table and its per-row AdamW state, filled."""
    from tasks.training.checkpoint import TrainState
    from tasks.training.row_adam import SparseRows

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.empty(rows, dim), requires_grad=False)
            self.dense = torch.nn.Linear(dim, dim)

    torch.manual_seed(0)
    model = Model()
    model.table.data.uniform_(-0.1, 0.1)
    opt = torch.optim.AdamW(model.dense.parameters(), lr=1e-3)
    model.dense(torch.randn(4, dim)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sparse = SparseRows(model.table, 1e-3, (0.9, 0.98), 0.01)
    st = sparse.state_tensors()
    st["exp_avg"].normal_(0, 1e-3)
    st["exp_avg_sq"].uniform_(0, 1e-6)
    st["step"].random_(0, 100)
    state = TrainState(step=200, epoch=1, batch_in_epoch=17)
    nbytes = sum(t.numel() * t.element_size() for t in (model.table, *st.values()))
    return model, opt, sched, state, sparse, nbytes


# ------------------------------------------------------------------------------------- the way before: whole copies


def reference_save(dir_path: str, model, opt, sched, state, rows) -> None:
    """The save before streaming: every file built whole in memory, hashed, then written."""
    from safetensors.torch import save as st_save

    from tasks.training.checkpoint import rng_state, weights

    blob = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **rng_state(), "rng_by_rank": [],
                "state": state.__dict__, "word_table": rows.state_dict()}, blob)
    files = {"model.safetensors": st_save(weights(model)), "trainer.pt": blob.getvalue()}
    digests = {}
    os.makedirs(f"{dir_path}/step", exist_ok=True)
    for name, data in files.items():
        digests[name] = hashlib.sha256(data).hexdigest()
        with open(f"{dir_path}/step/{name}", "wb") as f:
            f.write(data)
    with open(f"{dir_path}/latest.json", "w") as f:
        json.dump(digests, f)


def reference_resume(dir_path: str, model, opt, sched, rows) -> None:
    """The resume before streaming: each file read whole and hashed, then deserialised and copied in."""
    from safetensors.torch import load as st_load

    with open(f"{dir_path}/latest.json") as f:
        digests = json.load(f)
    files = {}
    for name, want in digests.items():
        with open(f"{dir_path}/step/{name}", "rb") as f:
            files[name] = f.read()
        assert hashlib.sha256(files[name]).hexdigest() == want
    model.load_state_dict(st_load(files["model.safetensors"]), strict=False)
    ck = torch.load(io.BytesIO(files["trainer.pt"]), weights_only=True, map_location="cpu")
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    rows.load_state_dict(ck["word_table"])


# ------------------------------------------------------------------------------------------------- one way, measured


def one(way: str, rows: int, dim: int, dir_path: str) -> dict:
    """Save then resume ``way`` in this process: seconds and peak extra bytes of each, and the state's bytes."""
    import fsspec

    from tasks.training.checkpoint import load_checkpoint, save_checkpoint

    model, opt, sched, state, sparse, nbytes = make_state(rows, dim)
    fs = fsspec.filesystem("file")
    t = time.perf_counter()
    with Peak() as save_peak:
        if way == "streamed":
            save_checkpoint(fs, dir_path, model, opt, sched, state, None, sparse)
        else:
            reference_save(dir_path, model, opt, sched, state, sparse)
    save_s = time.perf_counter() - t
    want = sparse.state_tensors()["exp_avg"][:1000].clone()
    with torch.no_grad():  # the resume must really write the state back
        model.table.zero_()
        for v in sparse.state_tensors().values():
            v.zero_()
    t = time.perf_counter()
    with Peak() as resume_peak:
        if way == "streamed":
            load_checkpoint(fs, dir_path, model, opt, sched, 0, sparse)
        else:
            reference_resume(dir_path, model, opt, sched, sparse)
    resume_s = time.perf_counter() - t
    assert torch.equal(sparse.state_tensors()["exp_avg"][:1000], want), "the resume did not restore the state"
    return {"rows": rows, "dim": dim, "state_bytes": nbytes, "save_s": round(save_s, 2), "resume_s": round(resume_s, 2),
            "save_peak_extra": save_peak.extra, "resume_peak_extra": resume_peak.extra,
            "peak_extra_fraction": round(max(save_peak.extra, resume_peak.extra) / nbytes, 3)}


def run_one(way: str, rows: int, dim: int, where: str) -> dict:
    """:func:`one` in a fresh process (its own peak), its result read back as the last line of its output."""
    with tempfile.TemporaryDirectory(prefix=f"bench-ckpt-{way}-", dir=where) as d:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", way, "--rows", str(rows),
                              "--dim", str(dim), "--dir", d], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{way} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="word-table rows (Tencent's 2M by default)")
    ap.add_argument("--dim", type=int, default=200, help="word-vector dimensions")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint files go (a local disk)")
    ap.add_argument("--results", help="write the figures as JSON here (e.g. docs/results/bench_checkpoint.json)")
    ap.add_argument("--one", choices=("streamed", "reference"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(one(args.one, args.rows, args.dim, args.dir)))
        return
    state_gb = args.rows * args.dim * 4 * 3 / 1e9
    print(f"state: {args.rows:,} x {args.dim} word table and its two AdamW moments, {state_gb:.2f} GB")
    ours = run_one("streamed", args.rows, args.dim, args.dir)
    print(f"streamed:  save {ours['save_s']:.1f} s, resume {ours['resume_s']:.1f} s, peak extra "
          f"{ours['save_peak_extra'] / 1e9:.2f} / {ours['resume_peak_extra'] / 1e9:.2f} GB "
          f"({ours['peak_extra_fraction']:.2f} of the state)")
    # the reference holds about three copies beside the state: at fewer rows when the machine has no room for them
    room = psutil.virtual_memory().available * 0.8
    ref_rows = args.rows if 4 * state_gb * 1e9 <= room else int(args.rows * room / (4 * state_gb * 1e9))
    if ref_rows != args.rows:
        print(f"reference at {ref_rows:,} rows: its copies of the full state do not fit in this machine's memory")
    ref = run_one("reference", ref_rows, args.dim, args.dir)
    print(f"reference: save {ref['save_s']:.1f} s, resume {ref['resume_s']:.1f} s, peak extra "
          f"{ref['save_peak_extra'] / 1e9:.2f} / {ref['resume_peak_extra'] / 1e9:.2f} GB "
          f"({ref['peak_extra_fraction']:.2f} of the state)")
    met = ours["peak_extra_fraction"] <= GOAL
    write_results(args.results, "bench_checkpoint", {
        "streamed": ours, "reference": ref, "goal_peak_extra_fraction": GOAL, "met": met,
        "load_average_1m": round(os.getloadavg()[0], 2),
    })
    print(f"bench_checkpoint save {ours['save_s']:.1f} s (reference {ref['save_s']:.1f} s), resume "
          f"{ours['resume_s']:.1f} s (reference {ref['resume_s']:.1f} s); peak extra memory "
          f"{ours['peak_extra_fraction']:.2f} of the state (reference {ref['peak_extra_fraction']:.2f}); "
          f"goal <= {GOAL}")


if __name__ == "__main__":
    main()
