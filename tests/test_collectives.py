"""The control-plane collectives of a DDP run work when the default group is NCCL-like (CUDA tensors only).

No GPU here: a backend registered for the ``cuda`` device alone (gloo underneath) stands in for NCCL. On it, a CPU
tensor all-reduced on the default group fails as it does on NCCL ("No backend type associated with device type
cpu"); the pretraining path's control-plane calls (batches per epoch, per-rank infos, the stop flag) must still work,
through :mod:`tasks.training.collectives`' gloo side group.
"""

from __future__ import annotations

import datetime
import json
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gloo_for_cuda(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _rank(rank: int, tmp: str) -> None:
    from tasks.pretrain.train import _min_over_ranks, dist_info, gather_info
    from tasks.training import collectives
    from tasks.training.preempt import StopSignal

    dist.Backend.register_backend("cudaonly", _gloo_for_cuda, devices=["cuda"])
    dist.init_process_group("cudaonly", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    out: dict = {"backend": dist.get_backend(), "rank_world": list(dist_info())}
    try:
        try:  # the stand-in refuses CPU tensors on the default group, as NCCL does
            dist.all_reduce(torch.tensor([1]))
            out["cpu_on_default"] = "accepted"
        except RuntimeError as e:
            out["cpu_on_default"] = str(e)
        out["min"] = _min_over_ranks(10 + rank, 2)  # batches per epoch: the smallest
        out["gathered"] = gather_info({"rank": rank, "rows": 100 * (rank + 1)}, 2)
        stop = StopSignal("pretrain")  # not entered: only its flag and its agreement are exercised
        stop.signum = signal.SIGTERM if rank == 1 else None  # the signal reached rank 1 only, so far
        out["agreed"] = stop.agreed(2)
        out["signum"] = stop.signum
        out["none_stop"] = StopSignal("pretrain").agreed(2)  # no flag anywhere: no stop
        out["max"] = collectives.max_int(7 * rank)
        out["same_group"] = collectives.control_group() is collectives.control_group()
    finally:
        collectives.shutdown()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)


def test_control_plane_collectives_run_when_the_default_group_refuses_cpu_tensors(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, out in enumerate(got):
        assert out["backend"] == "cudaonly" and out["rank_world"] == [r, 2]
        assert "No backend type associated with device type cpu" in out["cpu_on_default"], out
        assert out["min"] == 10
        assert out["gathered"] == [{"rank": 0, "rows": 100}, {"rank": 1, "rows": 200}]
        assert out["agreed"] is True and out["signum"] == signal.SIGTERM  # rank 0 learned it from rank 1
        assert out["none_stop"] is False
        assert out["max"] == 7
        assert out["same_group"] is True  # made once per process group
