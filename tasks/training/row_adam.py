"""A word table trained sparsely: each step touches only the rows its batch used, with AdamW state kept per row.

The LEBERT adapter's word table grows with the lexicon (millions of rows at full size), yet a batch uses a few
thousand of them. Trained densely, every step clears, clips and AdamW-updates the whole table (and DDP all-reduces
it). :class:`SparseRows` makes a step cost what the batch touched:

- :meth:`SparseRows.gather` takes the distinct word ids of the batch, copies those rows into a small leaf tensor
  (row 0 the [PAD] word) and renumbers the batch's ids into it; the model looks words up there
  (``LexiconAdapter``'s ``word_rows``), so the backward pass yields the gradient of those rows only. The table
  itself is not a trainable parameter: the main optimizer and DDP never see it. The ids are made distinct on the
  host from the batch's host copy, so no step reads the device for them (the GPU contract: no device read between
  log rows).
- :meth:`SparseRows.reduce` (under DDP) sums the ranks' row gradients over the union of their ids, divided by the
  world size, as DDP averages the other gradients. The ids leave for the other ranks as soon as :meth:`index` has
  them (an all-gather on the model's device, padded to a capacity the batch shape gives, so it overlaps the forward
  and backward passes); the union is found on the device and its rows all-reduced there
  (:func:`tasks.training.collectives.average_rows`): no host collective, no device read.
- :meth:`SparseRows.clip_tensors` gives the tensor whose gradient is those rows, for the global clipping norm. The
  rows the batch did not touch have a zero gradient in the dense form, which adds nothing to the norm: dense and
  sparse clip alike.
- :class:`RowAdamW` updates the touched rows: AdamW with the moments and the step count of each row its own
  ("lazy" AdamW). A row's bias correction uses its own step count; weight decay is applied to a row when it is
  updated. A row the batch did not touch keeps its bytes and its state; so the weights differ from dense AdamW's,
  which moves every row on every step once it has momentum. :meth:`RowAdamW.step_static` is the same update in a
  form a CUDA graph can hold (static shapes, [PAD] padding, no host read).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tasks.training import collectives


class RowAdamW:
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) over rows of one 2-D ``table``, a row at a time:
    :meth:`step` updates the rows ``ids`` from their gradients and leaves every other row and its state as it was.

    State: ``exp_avg`` and ``exp_avg_sq`` [rows, dim] (the table's dtype and device) and ``step`` [rows] (int64),
    each row's count of updates. For a row updated on every step the arithmetic is ``torch.optim.AdamW``'s
    (single-tensor form) on that row."""

    def __init__(self, table: Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if table.ndim != 2:
            raise ValueError(f"RowAdamW updates a 2-D table, got shape {tuple(table.shape)}")
        self.table = table
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.exp_avg = torch.zeros_like(table, memory_format=torch.contiguous_format)
        self.exp_avg_sq = torch.zeros_like(table, memory_format=torch.contiguous_format)
        self.step_count = torch.zeros(table.shape[0], dtype=torch.int64, device=table.device)

    @torch.no_grad()
    def step(self, ids: Tensor, grad: Tensor, lr: float | Tensor | None = None) -> None:
        """One AdamW update of the rows ``ids`` [U] (distinct) with their gradients ``grad`` [U, dim], at ``lr``
        (default the one given at construction: a schedule passes the step's)."""
        if ids.numel() == 0:
            return
        p, m, v, t = self._update(ids, grad, lr)
        self.table.index_copy_(0, ids, p)
        self.exp_avg.index_copy_(0, ids, m)
        self.exp_avg_sq.index_copy_(0, ids, v)
        self.step_count.index_copy_(0, ids, t)

    @torch.no_grad()
    def step_static(self, ids: Tensor, grad: Tensor, lr: float | Tensor | None = None) -> None:
        """:meth:`step` with static shapes and no host read (what a CUDA graph can hold): ``ids`` [R] may repeat
        and hold 0, the [PAD] row, as padding. Every entry is computed; an entry whose id is 0 writes back the row's
        own values and state, so row 0 never changes and the padding's repeated writes are all the same bytes.
        ``lr`` may be a 0-dim tensor (a capturable optimizer's LR, filled in place by the schedule). Each real row
        (distinct, non-zero ids) gets :meth:`step`'s update."""
        p, m, v, t = self._update(ids, grad, lr)
        valid = ids != 0
        rows = valid[:, None]
        self.table.index_copy_(0, ids, torch.where(rows, p, self.table.index_select(0, ids)))
        self.exp_avg.index_copy_(0, ids, torch.where(rows, m, self.exp_avg.index_select(0, ids)))
        self.exp_avg_sq.index_copy_(0, ids, torch.where(rows, v, self.exp_avg_sq.index_select(0, ids)))
        self.step_count.index_copy_(0, ids, torch.where(valid, t, self.step_count.index_select(0, ids)))

    def _update(self, ids: Tensor, grad: Tensor, lr: float | Tensor | None) -> tuple[Tensor, ...]:
        """The rows ``ids`` after one AdamW update (new rows, moments and step counts; nothing written)."""
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        p = self.table.index_select(0, ids)
        m = self.exp_avg.index_select(0, ids)
        v = self.exp_avg_sq.index_select(0, ids)
        t = self.step_count.index_select(0, ids) + 1  # [U] each row's own step
        g = grad.to(p.dtype)
        p.mul_(1 - lr * self.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        td = t.to(torch.float64)  # bias corrections in double, as torch computes them from a Python float
        step_size = (lr / (1 - beta1 ** td)).to(p.dtype)[:, None]  # [U,1]
        bc2_sqrt = (1 - beta2 ** td).sqrt().to(p.dtype)[:, None]
        denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
        p.sub_(step_size * m / denom)
        return p, m, v, t

    def state_dict(self) -> dict[str, Any]:
        """The per-row state (CPU tensors) and the hyper-parameters it was made with."""
        return {"exp_avg": self.exp_avg.cpu(), "exp_avg_sq": self.exp_avg_sq.cpu(), "step": self.step_count.cpu(),
                "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def state_tensors(self) -> dict[str, Tensor]:
        """The per-row state tensors themselves (where they live, not copies): what a checkpoint streams out and
        reads back in place."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step_count}

    def hyper_parameters(self) -> dict[str, Any]:
        """The hyper-parameters the state was made with (no tensors)."""
        return {"betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s per-row state (shapes must match the table)."""
        for name, mine in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("step", self.step_count)):
            if tuple(sd[name].shape) != tuple(mine.shape):
                raise ValueError(f"word-table optimizer state {name} has shape {tuple(sd[name].shape)}, the table "
                                 f"needs {tuple(mine.shape)}")
            mine.copy_(sd[name])


class SparseRows:
    """One training step's rows of a word table (the module docstring): gather, (reduce), clip, step.

    ``table`` is the adapter's word table (a parameter with ``requires_grad`` off: only this class updates it).
    With ``fixed_shape`` (a compiled model or a captured step: static shapes) the gathered rows are padded to one
    more than the batch's slots, so a batch shape always gives the same rows shape (padding rows are the [PAD] row,
    never indexed). A captured step (:mod:`tasks.training.graphs`) uses :meth:`index`, :meth:`rows_of` and
    :meth:`step_static` (no host read); an ordinary one :meth:`gather`, :meth:`reduce`, :meth:`clip_tensors` and
    :meth:`step`."""

    def __init__(self, table: Tensor, lr: float, betas: tuple[float, float], weight_decay: float,
                 eps: float = 1e-8, fixed_shape: bool = False, capacity: int | None = None):
        self.table = table
        self.capacity = capacity  # under DDP: the most distinct rows a batch can touch (its slots), on every rank
        self.optimizer = RowAdamW(table.data, lr, betas, eps, weight_decay)
        self.fixed_shape = fixed_shape
        self._ids: Tensor | None = None  # [U] the batch's distinct non-[PAD] word ids (the table's device)
        self._rows: Tensor | None = None  # [1+U(+padding), dim] leaf: row 0 [PAD], then the rows of _ids
        self._grad: Tensor | None = None  # after reduce under DDP: [G, dim] the union's averaged gradients
        self._union: Tensor | None = None  # [S] the ranks' ids, then [PAD] padding
        self._exchange: collectives.RowIds | None = None  # under DDP: the ids' all-gather, in flight

    def gather(self, word_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(local ids [same shape as ``word_ids``], rows [R, dim]), both on the table's device: ``rows[local] ==
        table[word_ids]``, ``rows`` a fresh leaf that requires grad, row 0 the [PAD] row (local id 0 is word id 0).
        Pass the batch's host copy of ``word_ids``: they are made distinct where they are (on a GPU that would be a
        device read)."""
        local, row_ids = self.index(word_ids)
        return local, self.take(row_ids)

    def index(self, word_ids: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`gather` without the rows: (local ids, the ids of the rows [R], row 0 [PAD], then the batch's
        distinct words, then with ``fixed_shape`` [PAD] padding), both on the table's device. A captured step takes
        the rows itself (:meth:`rows_of`); an ordinary one follows with :meth:`take`."""
        flat = word_ids.reshape(-1).to(torch.int64)
        zero = torch.zeros(1, dtype=flat.dtype, device=flat.device)  # [PAD] first, whether the batch has it or not
        uniq, inv = torch.unique(torch.cat([zero, flat]), sorted=True, return_inverse=True)  # [1+U], [1+n]
        local = inv[1:].view_as(word_ids)
        n = uniq.numel()
        if self.fixed_shape:  # static shapes: always 1 + the batch's slots rows, the rest [PAD]
            uniq = torch.cat([uniq, uniq.new_zeros(flat.numel() + 1 - n)])
        device = self.table.device
        uniq, local = _to(uniq, device), _to(local, device)
        self._ids = uniq[1:n]
        self._rows = self._grad = self._union = None
        world = collectives.rank_world()[1]
        if world > 1:  # the ids leave now: the all-gather runs while the model does its forward and backward passes
            self._exchange = collectives.gather_row_ids(self._ids, self._capacity(flat.numel()), world)
        return local, uniq

    def _capacity(self, slots: int) -> int:
        return self.capacity if self.capacity is not None else slots

    def adopt(self, row_ids: Tensor, n: int, slots: int) -> None:
        """:meth:`index` done where the batch was built (:func:`tasks.pretrain.pairpack.with_word_rows`): the batch's
        word ids are already local, ``row_ids`` [R] (the table's device) are the ids of its rows, row 0 [PAD], then
        ``n - 1`` distinct words, then [PAD] padding; ``slots``: the batch's word slots (B x T x W). Nothing is
        computed here; under DDP the ids' exchange is launched, as :meth:`index` does."""
        self._ids = row_ids[1:n]
        self._rows = self._grad = self._union = None
        world = collectives.rank_world()[1]
        if world > 1:  # the ids leave now: the all-gather runs while the model does its forward and backward passes
            self._exchange = collectives.gather_row_ids(self._ids, self._capacity(slots), world)

    def take(self, row_ids: Tensor) -> Tensor:
        """The rows of :meth:`index`'s ``row_ids``: the leaf the model looks words up in, kept for the step."""
        self._rows = self.rows_of(row_ids)
        return self._rows

    def rows_of(self, row_ids: Tensor) -> Tensor:
        """A fresh leaf [R, dim] that requires grad: the table's rows ``row_ids`` (no state kept)."""
        return self.table.detach().index_select(0, row_ids).requires_grad_(True)

    def _local_grad(self) -> Tensor:
        rows = self._rows
        if rows is None or self._ids is None:
            raise RuntimeError("SparseRows: gather() before the backward pass")
        g = rows.grad
        n = self._ids.numel()
        return torch.zeros((n, rows.shape[1]), dtype=rows.dtype, device=rows.device) if g is None else g[1:1 + n]

    def reduce(self) -> None:
        """Under DDP: every rank's row gradients, averaged over the ranks on the union of their ids (a no-op in one
        process). Call after the backward pass, before clipping."""
        if self._exchange is None:
            return
        self._union, self._grad = collectives.average_rows(self._exchange, self._local_grad(), self.table.shape[0])
        self._exchange = None

    def clip_tensors(self) -> list[Tensor]:
        """Tensors whose ``.grad`` is the step's gradient of the table (for ``clip_grad_norm_``, which scales them
        in place): the gathered rows (their [PAD] and padding rows are 0), or under DDP the averaged rows."""
        if self._grad is None:
            return [self._rows] if self._rows is not None and self._rows.grad is not None else []
        holder = torch.empty_like(self._grad).requires_grad_(True)  # uninitialised: only its .grad is read
        holder.grad = self._grad
        return [holder]

    def step(self, lr: float) -> None:
        """The rows' AdamW update at ``lr`` (the step's scheduled LR)."""
        if self._grad is not None:  # the union's rows: static shape, [PAD] padding that writes nothing new
            self.optimizer.step_static(self._union, self._grad, lr)
        else:
            self.optimizer.step(self._ids, self._local_grad(), lr)
        self._rows = self._grad = self._union = None

    def step_static(self, row_ids: Tensor, rows: Tensor, lr: float | Tensor) -> None:
        """The rows' AdamW update inside a captured step (one process): ``row_ids`` [R] the static ids the leaf
        ``rows`` (from :meth:`rows_of`, its gradient clipped) was taken at, [PAD] padding included; every entry is
        computed and padding writes nothing new (:meth:`RowAdamW.step_static`). No host read, static shapes."""
        grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        self.optimizer.step_static(row_ids, grad, lr)

    def state_dict(self) -> dict[str, Any]:
        """The per-row optimizer state (:meth:`RowAdamW.state_dict`), for the checkpoint."""
        return self.optimizer.state_dict()

    def state_tensors(self) -> dict[str, Tensor]:
        """:meth:`RowAdamW.state_tensors`: the per-row state, in place."""
        return self.optimizer.state_tensors()

    def hyper_parameters(self) -> dict[str, Any]:
        """:meth:`RowAdamW.hyper_parameters`."""
        return self.optimizer.hyper_parameters()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.optimizer.load_state_dict(sd)


def _to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``: from the host to a GPU through pinned memory, without waiting (no device read)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
