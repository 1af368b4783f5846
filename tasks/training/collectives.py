"""The collectives of a training run, each on a backend that can carry it; every one the pretraining path makes.

NCCL carries CUDA tensors only: a CPU tensor all-reduced on an NCCL default group fails at once ("No backend type
associated with device type cpu"). So the values that steer a run (step counts, stop flags, per-rank infos and RNG
states: the control plane) travel as CPU tensors and pickled objects over one gloo side group, made once per process
group (:func:`control_group`; the default group itself when it is gloo). Values that live on the model's device (the
data plane: DDP's gradient all-reduce, inside DDP) stay on the default group. With no process group (one process)
every function here is the identity.

The data-plane exchange made outside DDP is the word-table rows a batch touched (:mod:`tasks.training.row_adam`),
whose ids differ from rank to rank: :func:`gather_row_ids` launches, before the forward pass and without waiting,
one all-gather of each rank's ids padded to a capacity every rank knows from the batch shape (no size exchange, so
no host read), and :func:`average_rows` then finds their union on the device (static shapes) and all-reduces the
rows' gradients over it. Both run on the default group with tensors on the model's device (NCCL on GPUs; on CPU
and gloo the same code runs on CPU tensors), so an ordinary step makes no control-plane (host) collective.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

_control: tuple[Any, Any] | None = None  # (the default group it was made for, its gloo side group)


_timeout: datetime.timedelta | None = None  # the run's collective timeout (the control group gets it too)


def init(backend: str, timeout_s: float | None = None, device: torch.device | None = None) -> None:
    """Join the process group (torchrun's environment gives rank, world size and rendezvous) on ``backend``, and
    make its control group at once (a collective call: every rank makes it at the same point). ``timeout_s``: how
    long a collective (the rendezvous included) may wait for a peer before it fails with an error instead of
    hanging; ``device`` (a CUDA device): the rank's GPU, bound at once (NCCL connects eagerly, and a wrong GPU is
    an error at start)."""
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    kwargs: dict[str, Any] = {"timeout": _timeout} if _timeout else {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, **kwargs)
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
        # a group of its own even over a gloo default group: the control plane is told apart from the data plane
        # (what the collective-count test checks), at the cost of one more set of gloo connections
        _control = (world, dist.new_group(backend="gloo", timeout=_timeout))
    return _control[1]


def _reduce(value: int, op) -> int:
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)  # CPU: the control group is gloo
    dist.all_reduce(t, op=op, group=control_group())
    return int(t[0])


def max_ints(values: list[int]) -> list[int]:
    """Each of ``values``' largest value over the ranks, in one control-plane all-reduce (e.g. a stop flag and, as
    a negated number, the smallest of the ranks' proposals)."""
    if rank_world()[1] == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return [int(v) for v in t]


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


class RowIds:
    """One step's exchange of word-table row ids, in flight (:func:`gather_row_ids`): ``padded`` [capacity] this
    rank's ids, 0 ([PAD], never a real row) after them; ``every`` [world x capacity] every rank's, once ``work``
    is waited for."""

    def __init__(self, ids: torch.Tensor, capacity: int, world: int):
        n = ids.numel()
        if n > capacity:
            raise ValueError(f"a batch touched {n} word-table rows, more than the {capacity} its shape allows")
        self.ids, self.capacity, self.world = ids, capacity, world
        self.padded = torch.zeros(capacity, dtype=torch.int64, device=ids.device)
        self.padded[:n] = ids
        self.every = torch.empty(world * capacity, dtype=torch.int64, device=ids.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        self.work = gather(self.every, self.padded, async_op=True)


def gather_row_ids(ids: torch.Tensor, capacity: int, world: int) -> RowIds:
    """Launch (without waiting) the all-gather of this rank's distinct row ``ids`` [U] (on the model's device, none
    of them 0) padded with 0 to ``capacity``, a bound every rank knows without asking (the slots of the largest
    batch): on the default group, so it overlaps the forward and backward passes on the device."""
    return RowIds(ids.to(torch.int64), capacity, world)


def average_rows(rows: RowIds, grads: torch.Tensor, table_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(union [S], averaged [S, dim]) for the exchange ``rows`` (:func:`gather_row_ids`) and this rank's gradients
    ``grads`` [U, dim] of its ids: ``union`` the sorted distinct ids of every rank then 0 ([PAD]) padding, and
    for each the sum of the ranks' gradient rows for it divided by the world size (a rank that did not touch a row
    adds 0; padding rows are 0), as DDP averages a dense gradient. ``S`` = min(world x capacity, ``table_rows``):
    a static shape, so the union is found on the device with no host read (sort, first occurrences, a running
    count); then one all-reduce on the default group. Everything stays on the gradients' device."""
    world = rows.world
    rows.work.wait()
    srt = torch.sort(rows.every).values  # [world*K] every rank's ids and padding, ascending
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    seg = torch.cumsum(first, 0) - 1  # [world*K] the place of each entry's id in the union
    size = min(srt.numel(), max(int(table_rows), 1))
    union = torch.zeros(size, dtype=torch.int64, device=srt.device)
    union.scatter_(0, seg, srt)  # an id's entries all write the same value
    where = seg[torch.searchsorted(srt, rows.ids)]  # [U] this rank's rows in their union places
    out = torch.zeros((size, grads.shape[1]), dtype=grads.dtype, device=grads.device)
    out.index_copy_(0, where, grads)
    dist.all_reduce(out)
    return union, out.div_(world)


def loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address (127.x, ::1), where no other
    machine can reach it; False when it does not resolve here."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return any(info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos)


def check_nodes(nnodes: int, master_addr: str) -> None:
    """Refuse at start, in one line, what would make a run on several machines wait out the rendezvous timeout:
    node 0's address resolving to loopback, or (without ``GLOO_SOCKET_IFNAME``) this machine's host name doing so
    (gloo then offers the other nodes an address they cannot reach). Nodes on one machine (a test) set
    ``GLOO_SOCKET_IFNAME`` to the loopback interface, which says so."""
    if nnodes <= 1:
        return
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if iface.startswith("lo"):
        return  # every node on this machine, on purpose
    if loopback(master_addr):
        raise ValueError(f"pretrain.master_addr {master_addr!r} resolves to loopback, which the other "
                         f"{nnodes - 1} node(s) cannot reach: set it to node 0's address on the network the nodes "
                         "share (and GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to that interface on every node)")
    if not iface and loopback(socket.gethostname()):
        raise ValueError(f"this machine's host name {socket.gethostname()!r} resolves to loopback, so gloo would "
                         "offer the other nodes an address they cannot reach: set GLOO_SOCKET_IFNAME (and "
                         "NCCL_SOCKET_IFNAME) to the interface the nodes share, e.g. eth0, on every node")
