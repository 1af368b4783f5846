"""Two torchrun "nodes" on loopback (gloo, CPU, one rank each) through a SIGKILL and a resume.

Each node is its own ``torchrun --nnodes=2`` launcher, as on two machines (``GLOO_SOCKET_IFNAME=lo`` says they share
this one); the ranks run the pretraining loop with a sparse word table (the rows exchanged on the data plane) and
checkpoints every 2 steps. Killed (every process of both nodes) after the first checkpoint, then run again: the
rerun resumes on both nodes from that checkpoint (verified once per node, the ranks agreeing on step and version)
and ends on the uninterrupted two-node run's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest

from tasks.training.checkpoint import latest_state, published

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    import fsspec, torch
    from safetensors.torch import save
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import train
    from tasks.training import collectives
    from tasks.training.checkpoint import weights
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    collectives.init("gloo", timeout_s=60)
    try:
        model, _ = train(_cfg(**spec["cfg"]), rows_of(_rows()), V, WV, W, fsspec.filesystem("file"), spec["ckpt"],
                         progress=False)
        if collectives.rank_world()[0] == 0:
            with open(spec["out"], "wb") as f:
                f.write(save(weights(model)))
    finally:
        collectives.shutdown()
""")
CFG = dict(steps=6, log_every=2, checkpoint_every=2, warmup_steps=1,
           model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "ffn_size": 32, "hidden_dropout": 0.1,
                  "attention_dropout": 0.1, "max_len": 64, "word_table": "sparse"},
           data={"max_seq_len": 32, "batch_size": 4, "loader_workers": 0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp: Path, ckpt: str, out: Path, env: dict | None = None) -> list[subprocess.Popen]:
    """Both nodes' launchers, started."""
    script = tmp / "node_rank.py"
    script.write_text(SCRIPT)
    spec = json.dumps({"cfg": CFG, "ckpt": ckpt, "out": str(out)})
    port = _free_port()
    full = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0", "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", **(env or {})}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={r}",
                              "--master_addr=127.0.0.1", f"--master_port={port}", "--nproc_per_node=1", str(script),
                              spec], cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)]


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in procs:  # torchrun starts its ranks in sessions of their own: every descendant, as a dead box
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.communicate()


@pytest.mark.heavy  # three two-node runs (four launchers and ranks): about 35 s on 2 idle cores, over a minute busy
@pytest.mark.timeout(600)
def test_two_nodes_killed_after_a_checkpoint_resume_to_the_uninterrupted_bytes(tmp_path):
    fs = fsspec.filesystem("file")
    _finish(_nodes(tmp_path, str(tmp_path / "ck-whole"), tmp_path / "whole.safetensors"))
    whole = (tmp_path / "whole.safetensors").read_bytes()

    ck, marker = str(tmp_path / "ck"), tmp_path / "paused"
    procs = _nodes(tmp_path, ck, tmp_path / "resumed.safetensors",
                   {"LEXIFLOW_PAUSE_IN": "pretrain", "LEXIFLOW_PAUSE_MARKER": str(marker)})
    deadline = time.monotonic() + 240
    while not marker.exists():  # rank 0 published step 2's checkpoint and waits there
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)
    for p in procs:
        _kill_tree(p)
    assert latest_state(fs, ck).step == 2

    _finish(_nodes(tmp_path, ck, tmp_path / "resumed.safetensors"))
    assert (tmp_path / "resumed.safetensors").read_bytes() == whole
    assert [e["step"] for e in published(fs, ck)] == [6, 4]
