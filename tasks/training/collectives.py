"""The collectives of a training run, each on a backend that can carry it; every one the pretraining path makes.

NCCL carries CUDA tensors only: a CPU tensor all-reduced on an NCCL default group fails at once ("No backend type
associated with device type cpu"). So the values that steer a run (step counts, stop flags, per-rank infos and RNG
states: the control plane) travel as CPU tensors and pickled objects over one gloo side group, made once per process
group (:func:`control_group`; the default group itself when it is gloo). Values that live on the model's device (the
data plane: DDP's gradient all-reduce, inside DDP) stay on the default group. With no process group (one process)
every function here is the identity.

One data-plane collective is made outside DDP: :func:`average_rows`, the gradients of the word-table rows a batch
touched (:mod:`tasks.training.row_adam`), whose ids differ from rank to rank (the ids, host tensors, go over the
control group; the gradients over the default group, on the model's device).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_control: tuple[Any, Any] | None = None  # (the default group it was made for, its gloo side group)


def init(backend: str) -> None:
    """Join the process group (torchrun's environment gives rank, world size and rendezvous) on ``backend``, and
    make its control group at once (a collective call: every rank makes it at the same point)."""
    dist.init_process_group(backend=backend)
    control_group()


def shutdown() -> None:
    """Leave the process group (a no-op when there is none); its control group goes with it."""
    global _control
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _control = None


def rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def control_group():
    """The gloo group of the current default group: made on first use (every rank must first use it at the same
    point; :func:`init` makes it right away), again after the default group changed."""
    global _control
    world = dist.group.WORLD
    if _control is None or _control[0] is not world:
        _control = (world, world if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))
    return _control[1]


def _reduce(value: int, op) -> int:
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)  # CPU: the control group is gloo
    dist.all_reduce(t, op=op, group=control_group())
    return int(t[0])


def min_int(value: int) -> int:
    """The smallest ``value`` over the ranks (e.g. batches per epoch: every rank takes the same number of steps)."""
    return _reduce(int(value), dist.ReduceOp.MIN)


def max_int(value: int) -> int:
    """The largest ``value`` over the ranks (e.g. a stop flag: raised on one rank, raised on all)."""
    return _reduce(int(value), dist.ReduceOp.MAX)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    world = rank_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=control_group())
    return out


def average_rows(ids: torch.Tensor, grads: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(union [G], averaged [G, dim]): the sorted union of every rank's distinct row ``ids`` [U] and, for each, the sum
    of the ranks' ``grads`` [U, dim] rows for it divided by ``world`` (a rank that did not touch a row adds 0), as
    DDP averages a dense gradient. ``ids`` are host (CPU) tensors, made from the batch on the host: they and their
    counts travel over the gloo control group (a rank's ids padded to the longest with -1), so nothing is read from
    the device; the gradients are the data plane, one all-reduce on the default group where they live (NCCL carries
    them). ``union`` is on the host, ``averaged`` on the gradients' device."""
    group = control_group()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([ids.numel()], dtype=torch.int64), group=group)
    longest = max(int(n) for n in sizes)
    padded = torch.full((longest,), -1, dtype=torch.int64)
    padded[: ids.numel()] = ids.cpu()
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    allids = torch.cat(every)
    union = torch.unique(allids[allids >= 0], sorted=True)  # [G]
    where = torch.searchsorted(union, ids.cpu())  # this rank's rows in their union places
    if grads.device.type == "cuda":  # through pinned memory, without waiting: a plain copy would wait for the GPU
        where = where.pin_memory().to(grads.device, non_blocking=True)
    else:
        where = where.to(grads.device)
    out = torch.zeros((union.numel(), grads.shape[1]), dtype=grads.dtype, device=grads.device)
    out.index_copy_(0, where, grads)
    dist.all_reduce(out)
    return union, out.div_(world)
