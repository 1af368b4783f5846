"""The code paths a GPU run takes, exercised on CPU: the FLOP count behind MFU, bf16 autocast, torch.compile,
DDP over gloo through the CLI, SIGKILL and resume under DDP, and two torchrun launchers as two nodes.

Exact byte equality is asserted only where the same computation runs: the same 2-rank world (one node with two
processes, or two nodes with one each: same ranks, same shards, the same gloo all-reduce of two tensors) on this
machine, before and after a kill. Compiled and bf16 runs are compared with eager fp32 within stated tolerances.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.data import rows_of
from tasks.pretrain.train import train
from tests.conftest import tiny_config_data
from tests.test_pretrain import WV, V, W, _cfg, _rows

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- MFU's FLOP count


def _cpu_attention_flops():
    """FlopCounterMode counts the CUDA attention kernels; on CPU, scaled_dot_product_attention runs
    ``_scaled_dot_product_flash_attention_for_cpu``, which it does not know. Count it with torch's own SDPA formulas
    (a mapping passed to this counter only; torch's registry is left as it is)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


CPU_ATTENTION_FLOPS = _cpu_attention_flops()


def test_flops_per_token_agrees_with_torchs_flop_counter():
    """``flops_per_token`` (the MFU numerator) against FlopCounterMode on one real training step (forward and
    backward) of the seed model's shape at a small width, lexicon adapter on: within 5 % (every sequence is full
    length here, so the counter sees no padding). The attention ops must be counted, or the check means little."""
    from torch.utils.flop_counter import FlopCounterMode

    from models import LebertForPretraining, ModelConfig

    B, T, Wn, f = 4, 128, 3, 0.15
    mc = ModelConfig(vocab_size=2000, word_vocab_size=500, word_dim=50, max_word_num=Wn, hidden_size=96,
                     num_layers=3, num_heads=4, ffn_size=384, hidden_dropout=0.0, attention_dropout=0.0, max_len=T,
                     use_adapter=True, adapter_layer=1)
    torch.manual_seed(0)
    model = LebertForPretraining(mc)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 2000, (B, T), generator=g)
    words = torch.randint(1, 500, (B, T, Wn), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    seg = torch.zeros(B, T, dtype=torch.long)
    positions = torch.randperm(B * T, generator=g)[: int(f * B * T)].sort().values
    labels = ids.reshape(-1)[positions]
    nsp = torch.randint(0, 2, (B,), generator=g)
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    with counter:
        out = model(ids, seg, mask, words, positions, labels, nsp)
        out.loss.backward()
    measured = counter.get_total_flops() / (B * T)
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert any("attention" in op for op in ops), ops
    formula = model.flops_per_token(T, positions.numel() / (B * T))
    assert measured == pytest.approx(formula, rel=0.05), (measured, formula)


# ----------------------------------------------------------------------------- bf16 autocast, torch.compile


def _losses(cfg: PretrainConfig) -> list[float]:
    _, log = train(cfg, rows_of(_rows()), V, WV, W, progress=False)
    return [r["mlm_loss"] for r in log]


def test_bf16_autocast_trains_close_to_fp32():
    """The CUDA default (bf16 autocast) forced on CPU: the same steps, losses within 5 % of fp32's yet not equal
    (autocast really ran)."""
    base = dict(steps=6, log_every=2, data={"max_seq_len": 32, "batch_size": 4, "shuffle_buffer": 8,
                                            "bucket_batches": 2, "loader_workers": 0})
    fp32, bf16 = _losses(_cfg(**base, precision="fp32")), _losses(_cfg(**base, precision="bf16"))
    assert all(np.isfinite(bf16)) and fp32 != bf16
    assert bf16 == pytest.approx(fp32, rel=0.05)


COMPILE_BASE = dict(steps=4, log_every=1, data={"max_seq_len": 32, "batch_size": 4, "shuffle_buffer": 8,
                                                "bucket_batches": 2, "loader_workers": 0},
                    model={"hidden_size": 32, "num_layers": 1, "num_heads": 4, "ffn_size": 64, "hidden_dropout": 0.0,
                           "attention_dropout": 0.0, "max_len": 64})


def test_compiled_training_matches_eager():
    """torch.compile through dynamo and AOT autograd (the graphs a GPU run compiles; ``aot_eager`` runs them
    unfused, sparing minutes of C++ builds), over batches of varying length (a shape change recompiles once as
    dynamic): losses within 1e-4 relative of eager."""
    eager = _losses(_cfg(**COMPILE_BASE))
    compiled = _losses(_cfg(**COMPILE_BASE, compile=True, compile_backend="aot_eager"))
    assert compiled == pytest.approx(eager, rel=1e-4)


@pytest.mark.slow
def test_inductor_compiled_training_matches_eager():
    """The same with inductor's fused CPU kernels (about two minutes of C++ builds here): within 1e-4 relative."""
    eager = _losses(_cfg(**COMPILE_BASE))
    compiled = _losses(_cfg(**COMPILE_BASE, compile=True))
    assert compiled == pytest.approx(eager, rel=1e-4)


# ----------------------------------------------------------------------------- DDP through the CLI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ddp(tiny_inputs, tmp_path_factory, prefect_server) -> dict:
    root = tmp_path_factory.mktemp("ddp")  # one store: prepare runs once; each test's pretrain is its own version
    data = tiny_config_data(tiny_inputs, str(root / "store"), pretrain={
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
        "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4},
        "steps": 6, "warmup_steps": 1, "log_every": 2, "checkpoint_every": 3, "threads": 1,
        "device": "cpu", "gpus": 2,
    })
    path = root / "ddp.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return {"root": root, "config": str(path), "api": prefect_server, "runs": {}}


def _run(ddp: dict, store: str, *sets: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "lexiflow", "run", "pretrain", "--config", ddp["config"],
           "--set", f"store_uri={store}", *(a for s in sets for a in ("--set", s))]
    full_env = {**os.environ, "PREFECT_API_URL": ddp["api"], "PYTHONHASHSEED": "0", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


def _manifest(ref_line: str) -> tuple[dict, bytes]:
    uri = json.loads(ref_line)["uri"]  # the CLI's last line: the committed ref as JSON
    return json.loads(Path(uri, "_manifest.json").read_text()), Path(uri, "model.safetensors").read_bytes()


@pytest.mark.flow
@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_ddp_two_ranks_through_the_cli_each_reading_its_own_rows(ddp):
    store = str(ddp["root"] / "store")
    manifest, weights = _manifest(_run(ddp, store))
    ddp["runs"]["one_node"] = weights
    m = manifest["metrics"]
    assert m["world_size"] == 2 and len(m["rows_per_rank"]) == 2
    lexicon = next(p for p in manifest["parents"] if p["stage"] == "lexicon")
    total = json.loads(Path(lexicon["uri"], "_manifest.json").read_text())["stats"]["out"]
    assert sum(m["rows_per_rank"]) <= total and sum(m["rows_per_rank"]) > 0.9 * total  # the held-out slice aside
    assert min(m["rows_per_rank"]) > 0.3 * sum(m["rows_per_rank"])  # each rank read about half, not everything
    run = manifest["run"]
    assert 0.0 <= run["median_data_wait"] <= 1.0 and len(run["log"]["data_wait"]) == 3
    assert manifest["config"]["gpus"] == 2 and "node_rank" not in manifest["config"]


def _kill_tree(pid: int) -> None:
    import psutil

    procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    for p in procs:  # torchrun starts its ranks in sessions of their own: kill every descendant, as a dead box would
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _step(ckpt: Path) -> int:
    """The step of the newest complete checkpoint under ``ckpt``."""
    import fsspec

    from tasks.training.checkpoint import latest_state

    return latest_state(fsspec.filesystem("file"), str(ckpt)).step


def _start_paused(ddp, store: str, every: str, marker: Path) -> subprocess.Popen:
    """A 2-rank run started in the background that pauses after its first checkpoint (rank 0 touches ``marker``
    there); returned once it has paused."""
    proc = _run(ddp, store, every, env={"LEXIFLOW_PAUSE_IN": "pretrain", "LEXIFLOW_PAUSE_MARKER": str(marker)},
                wait=False)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return proc


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
@pytest.mark.flow
def test_sigkill_then_sigterm_under_ddp_each_resume_gives_the_uninterrupted_weights(ddp, tmp_path):
    """One 2-rank training (checkpoints every 2 steps: another version of the same training, as checkpointing draws
    no random numbers) interrupted twice, then finished: the two ways a run dies share its runs.

    1. SIGKILL to every process of the run at the first checkpoint (step 2), as a dead box would: the rerun
       resumes from it.
    2. That rerun pauses in its next checkpoint save (step 4) and gets SIGTERM, to the ``lexiflow run`` process only
       (as ``timeout`` or a spot notice sends it), inside a Prefect flow run: torchrun passes it to both ranks; the
       save publishes, the ranks agree to stop right there and exit within 15 s; the line that says how to resume is
       rank 0's and, after Prefect's crash lines, the last line of the run.
    3. The last run resumes from step 4 and ends on the uninterrupted run's bytes, its progress lines on (non-TTY)
       stderr."""
    if "one_node" not in ddp["runs"]:  # run on its own (make test-heavy): the uninterrupted run first, as above
        ddp["runs"]["one_node"] = _manifest(_run(ddp, str(ddp["root"] / "store")))[1]
    store = str(ddp["root"] / "store")
    every = "pretrain.checkpoint_every=2"
    checkpoints = Path(store, "_checkpoints", "pretrain")

    # 1. SIGKILL at the first checkpoint
    proc = _start_paused(ddp, store, every, tmp_path / "paused-kill")  # rank 0 wrote step 2's checkpoint, waits
    _kill_tree(proc.pid)
    proc.communicate()
    [ckpt] = list(checkpoints.iterdir())
    assert _step(ckpt) == 2

    # 2. the resumed run, SIGTERM at its next checkpoint
    proc = _start_paused(ddp, store, every, tmp_path / "paused-term")  # resumed; wrote step 4's checkpoint, waits
    assert _step(ckpt) == 4  # it resumed from step 2, not from scratch
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t < 15, err[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    line = ("pretrain stopped by SIGTERM at step 4/6; checkpoint written; run the same command again to resume from "
            "this checkpoint")
    assert [ln for ln in err.splitlines() if ln.strip()][-1] == line, err[-3000:]
    assert [p.name for p in checkpoints.iterdir()] == [ckpt.name]
    assert _step(ckpt) == 4

    # 3. the last run finishes on the uninterrupted bytes
    rerun = _run(ddp, store, every, wait=False)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    manifest, weights = _manifest(out.strip().splitlines()[-1])
    assert manifest["version"] == ckpt.name and manifest["config"]["checkpoint_every"] == 2
    assert manifest["metrics"]["world_size"] == 2
    assert weights == ddp["runs"]["one_node"]  # same 2-rank computation on this machine: same bytes
    rows = [ln.split("pretrain step ")[1].split(" |")[0] for ln in err.splitlines() if "pretrain step " in ln]
    assert rows == ["6/6"], err[-3000:]  # the rows before step 4 were logged by the interrupted runs


@pytest.mark.flow
@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_two_launchers_as_two_nodes_train_the_same_weights_as_one_node(ddp, tmp_path):
    """Two ``lexiflow run pretrain`` processes, nodes 0 and 1 of a static rendezvous on loopback, one rank each:
    node 0 commits, node 1 returns the same ref; the weights equal the one-node, two-process run's (same ranks)."""
    if "one_node" not in ddp["runs"]:
        pytest.skip("needs the uninterrupted 2-rank run")
    store, port = str(ddp["root"] / "store"), _free_port()
    sets = ("pretrain.gpus=1", "pretrain.nnodes=2", "pretrain.master_addr=127.0.0.1", f"pretrain.master_port={port}")
    lines: dict[int, str] = {}

    def node(rank: int) -> None:  # GLOO_SOCKET_IFNAME=lo: both "nodes" on this machine on purpose (else refused)
        lines[rank] = _run(ddp, store, *sets, f"pretrain.node_rank={rank}", env={"GLOO_SOCKET_IFNAME": "lo"})

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    assert set(lines) == {0, 1} and json.loads(lines[0]) == json.loads(lines[1]), lines
    manifest, weights = _manifest(lines[0])
    assert manifest["metrics"]["world_size"] == 2 and manifest["config"]["nnodes"] == 2
    assert weights == ddp["runs"]["one_node"]
