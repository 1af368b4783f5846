"""What the ranks of a DDP pretraining run say to each other on an ordinary step, counted on gloo (CPU).

Every ``torch.distributed`` collective the training path calls is wrapped in the ranks and counted by the group it
runs on: the control plane (the gloo side group: host round-trips) or the default group (the data plane, on the
model's device; NCCL on GPUs). Two runs of the same training, 3 and 13 steps, differ only by 10 ordinary steps: those
may add no control-plane collective beyond a stop agreement or two (the flag is agreed every few steps, as many as
fit in about 1.5 s), two data-plane ones per step (the sparse rows' ids, then their gradients) and no buffer
broadcast (the position table is constant).
"""

from __future__ import annotations

import datetime
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COUNTED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
           "broadcast", "broadcast_object_list", "barrier", "_broadcast_coalesced", "gather_object", "reduce_scatter")


def _count(counts: Counter) -> None:
    """Wrap the module-level collectives of ``torch.distributed``: each call adds one to ``counts[(plane, name)]``."""
    from tasks.training import collectives

    def wrap(name, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group", args[0] if name == "_broadcast_coalesced" else None)
            control = collectives._control is not None and group is collectives._control[1]
            counts["control" if control else "default", name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in COUNTED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _rank(rank: int, tmp: str) -> None:
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import agree_on_resume, train
    from tasks.training import collectives
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    counts: Counter = Counter()
    out: dict = {}
    try:
        collectives.control_group()
        _count(counts)
        model = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "ffn_size": 64, "max_len": 64,
                 "word_table": "sparse"}
        for steps in (3, 13):
            counts.clear()
            data: dict = {}
            train(_cfg(steps=steps, log_every=100, model=model, data={"max_seq_len": 32, "batch_size": 4,
                                                                       "heldout_frac": 0.0, "loader_workers": 0}),
                  rows_of(_rows()), V, WV, W, progress=False, on_data=data.update)
            out[steps] = {f"{p}:{n}": c for (p, n), c in counts.items()}
            out[f"seeds{steps}"] = data.get("dropout_seeds")
        out["rng"] = torch.get_rng_state().tolist()[:64]
        agree_on_resume(5, "/store/_checkpoints/pretrain/v1", 2)  # the same step of the same version: fine
        try:
            agree_on_resume(5 * rank, "/store/_checkpoints/pretrain/v1", 2)  # rank 1 found step 5, rank 0 none
        except ValueError as e:
            out["mismatch"] = str(e)
    finally:
        collectives.shutdown()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.timeout(180)
def test_an_ordinary_step_makes_no_host_collective_and_exchanges_the_rows_on_the_data_plane(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for out in got:
        short, long = Counter(out["3"]), Counter(out["13"])
        extra = {k: long[k] - short.get(k, 0) for k in long if long[k] != short.get(k, 0)}
        control = sum(v for k, v in extra.items() if k.startswith("control:"))
        assert control <= 2, extra  # today's loop: 3 per step (the stop flag, the rows' ids and their counts)
        assert extra.get("default:all_gather_single", 0) + extra.get("default:all_gather_into_tensor", 0) == 10
        assert extra.get("default:all_reduce") == 10, extra  # the rows' gradients, one all-reduce a step
        assert not any("broadcast" in k for k in extra), extra  # no buffer broadcast before a forward
    assert got[0]["seeds13"] == [1234, 1235] and got[1]["seeds13"] is None  # recorded by rank 0
    assert got[0]["rng"] != got[1]["rng"]  # each rank draws its own dropout masks
    for out in got:  # one clear error on every rank, not a run that diverges and hangs
        assert out["mismatch"] == ("the ranks resumed different checkpoints (rank 0: step 0 of v1, rank 1: step 5 of "
                                   "v1): every node must read the same checkpoint directory (a shared store_uri); "
                                   "fix the store, then run again")


def test_several_nodes_refuse_a_loopback_address_at_start_unless_told_they_share_one_machine(monkeypatch):
    from tasks.training import collectives

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    collectives.check_nodes(1, "127.0.0.1")  # one node: loopback is right
    for addr in ("127.0.0.1", "localhost"):
        with pytest.raises(ValueError, match="resolves to loopback, which the other 1 node"):
            collectives.check_nodes(2, addr)
    monkeypatch.setattr(collectives.socket, "gethostname", lambda: "localhost")  # a host named for 127.0.1.1
    with pytest.raises(ValueError, match="host name 'localhost' resolves to loopback.*set GLOO_SOCKET_IFNAME"):
        collectives.check_nodes(2, "10.1.2.3")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    collectives.check_nodes(2, "10.1.2.3")  # the interface named: gloo takes its address, not the host name's
    with pytest.raises(ValueError, match="master_addr '127.0.0.1' resolves to loopback"):
        collectives.check_nodes(2, "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # every node on this machine, on purpose (the two-node test)
    collectives.check_nodes(2, "127.0.0.1")


def test_the_ddp_code_version_moves_ddp_versions_only():
    """DDP runs train other bytes than before (per-rank dropout, the rows' exchange): their versions move; a
    one-process run's version stays where it was."""
    from tasks.pretrain.config import PretrainConfig
    from tasks.pretrain.stage import DDP_CODE_VERSION, STAGE

    assert "ddp_code" not in STAGE.version_config(PretrainConfig())
    assert STAGE.version_config(PretrainConfig(gpus=2))["ddp_code"] == DDP_CODE_VERSION
    assert STAGE.version_config(PretrainConfig(nnodes=2))["ddp_code"] == DDP_CODE_VERSION
