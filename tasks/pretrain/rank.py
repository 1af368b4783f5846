"""One rank of a DDP pretraining run: the module torchrun starts (``python -m tasks.pretrain.rank SPEC.json``)."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.launch import staging_of
from tasks.pretrain.stage import run_pretrain_stage
from tasks.pretrain.train import local_rank
from tasks.training import collectives
from tasks.training.preempt import Preempted
from tasks.training.progress import to_stderr


def main(spec_path: str) -> None:
    """Train as this rank (:func:`tasks.pretrain.stage.run_pretrain_stage`); global rank 0 writes the artifact files
    and the result JSON that :func:`tasks.pretrain.launch.launch_ddp` reads. A stop signal ends the process right
    after the checkpoint, with the signal's exit code."""
    to_stderr()  # rank 0's progress lines reach the launcher's stderr
    with open(spec_path) as f:
        spec = json.load(f)
    cfg = PretrainConfig.model_validate(spec["cfg"])
    # NCCL on GPUs: it carries CUDA tensors only, so control-plane values go over collectives' gloo side group
    gpu = torch.cuda.is_available() and cfg.device != "cpu"
    device = torch.device("cuda", local_rank()) if gpu else None
    if device is not None:
        torch.cuda.set_device(device)
    collectives.init("nccl" if gpu else "gloo", timeout_s=cfg.dist_timeout_s, device=device)
    try:
        staging = staging_of(spec)
        rank0 = collectives.rank_world()[0] == 0
        # only global rank 0 writes, into the staging that the launching run leads (it holds the lease, it commits)
        store = staging.store()
        res = run_pretrain_stage(staging.writer() if rank0 else None, cfg, spec["lexicon_uri"], spec["vocab_uri"],
                                 store.fs, store.checkpoint_path(staging.stage, staging.version), progress=False)
        if rank0:
            with open(spec["result_path"], "w") as f:
                json.dump({"log": res[0], "metrics": res[1], "run": res[2]}, f)
    except Preempted as e:
        collectives.shutdown()
        logging.shutdown()  # the checkpoint is written and the line logged: exit now, without the interpreter's
        os._exit(e.code)  # teardown (seconds of it), so every rank is gone well within a preemption notice
    finally:
        collectives.shutdown()


if __name__ == "__main__":  # torchrun entry point: python -m tasks.pretrain.rank SPEC.json
    main(sys.argv[1])
