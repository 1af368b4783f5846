"""The torchrun launcher: start this node's ranks of a DDP pretraining run and collect rank 0's result.

Each rank is a ``python -m tasks.pretrain.rank SPEC.json`` process (:mod:`tasks.pretrain.rank`); the spec file
carries the stage's inputs, and global rank 0 writes the artifact files and a JSON result beside the spec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from storage.artifacts import ArtifactStore, StagingHandle
from tasks.pretrain.config import PretrainConfig
from tasks.training import collectives
from tasks.training.preempt import LINE_FILE_ENV, Preempted, forward_signals

# what torchrun runs in every rank
RANK_MODULE = "tasks.pretrain.rank"


def ddp_spec(staging: StagingHandle, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str) -> dict[str, Any]:
    """What every rank reads from its spec file: the staging (store, stage, version: :func:`staging_of` gives it back),
    the config and the input artifacts."""
    return dict(store_uri=staging.store_uri, stage=staging.stage, version=staging.version,
                cfg=cfg.model_dump(mode="json"), lexicon_uri=lexicon_uri, vocab_uri=vocab_uri)


def staging_of(spec: dict[str, Any]) -> StagingHandle:
    """The staging handle a spec carries (:func:`ddp_spec`)."""
    return StagingHandle(spec["store_uri"], spec["stage"], spec["version"])


def torchrun_command(cfg: PretrainConfig, spec_path: str) -> list[str]:
    """``python -m torch.distributed.run`` for this node: ``--standalone`` on one node; on several, a static
    rendezvous at ``master_addr:master_port`` where this node is ``node_rank`` (global rank = node_rank x gpus +
    local rank, so node 0 holds global rank 0, the one that writes the artifact)."""
    if cfg.nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={cfg.nnodes}", f"--node_rank={cfg.node_rank}", f"--master_addr={cfg.master_addr}",
                 f"--master_port={cfg.master_port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={cfg.gpus}", "-m",
            RANK_MODULE, spec_path]


def launch_ddp(spec: dict[str, Any], cfg: PretrainConfig
               ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]] | None:
    """Run :mod:`tasks.pretrain.rank` under ``torchrun`` as this node's ``cfg.gpus`` processes (NCCL on GPUs, gloo
    on CPU).

    Every rank trains on its own share of the rows; global rank 0 writes the artifact files and returns
    (log rows, metrics, run record) through a JSON file: None on the other nodes. On several nodes an address no
    other node could reach is refused first (:func:`tasks.training.collectives.check_nodes`)."""
    collectives.check_nodes(cfg.nnodes, cfg.master_addr)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = f"{tmp}/spec.json", f"{tmp}/result.json"
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        cmd = torchrun_command(cfg, spec_path)
        line_path = f"{tmp}/stopped.txt"  # rank 0's stop line, when it stops on a signal
        with forward_signals(subprocess.Popen(cmd, env={**os.environ, LINE_FILE_ENV: line_path})) as (proc, got):
            rc = proc.wait()
        if got:  # the ranks stopped (after a step: checkpointed) and rank 0 logged how to go on; the same line here
            line = "pretrain stopped by a signal under torchrun"
            if os.path.exists(line_path):
                with open(line_path, encoding="utf-8") as f:
                    line = f.read().strip() or line
            raise Preempted(line, got[0])
        if rc:
            raise subprocess.CalledProcessError(rc, cmd)
        if not os.path.exists(result_path):
            return None
        with open(result_path) as f:
            res = json.load(f)
        return res["log"], res["metrics"], res["run"]


def join_as_node(staging: StagingHandle, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str,
                 wait_s: float = 600.0):
    """Node ``cfg.node_rank`` > 0 of a run on several machines: take part in the training (this node's processes),
    then wait for node 0 to commit the version and return its ref. The store must be shared by the nodes."""
    store, stage, version = ArtifactStore(staging.store_uri), staging.stage, staging.version
    if not store.is_committed(stage, version):
        launch_ddp(ddp_spec(staging, cfg, lexicon_uri, vocab_uri), cfg)
    deadline = time.monotonic() + wait_s
    while not store.is_committed(stage, version):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stage} {version}: this node's part is done but node 0 has not committed it "
                               f"within {wait_s:.0f} s (is {store.uri} the store node 0 writes to?)")
        time.sleep(1.0)
    return store.ref(stage, version)

