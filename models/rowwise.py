"""Batch-invariant inference: every row's output bits are a function of that row alone.

A BLAS picks its kernel, and so the order of a dot product's additions, from the matrix shape: MKL gives other bits
for a row multiplied alone (M < 8 takes a GEMV path) than for the same row inside a batch. :func:`rowwise` returns a
copy of a model (sharing its weights) whose linear maps always multiply exactly :data:`ROWS` rows at a time (zero
rows pad the last block), so a row's result depends neither on how many rows share the call nor on which they are.
GELU and tanh run as :class:`RowElementwise` (whole vectors only, whatever the thread split). The other ops of the
encoder are per row already (LayerNorm, pooling, the adapter's softmax over a character's words) or per sequence
with a shape set by the sequence's own padded length (attention: the scorer pads each row to a length of its own
and batches equal lengths), and the sigmoid of the logits runs padded (:func:`sigmoid_rows`).

int8 (:class:`RowInt8Linear`): weights int8 per output channel; activations get one scale per row, not one per
call. Each row is divided by its own max-abs (so it lies in [-1, 1], its max at exactly ±1) and quantized with the
fixed parameters of the range [-1, 1] (those fbgemm's dynamic quantization picks for that range: the same bits as
measuring [-1, 1] on every call, without the pass that measures it); the int8 x int8 products accumulate exactly
in int32, and the row's scale multiplies the result back.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn
from torch.ao.quantization.observer import PerChannelMinMaxObserver

ROWS = 128  # rows per matrix product in the row-invariant forms (a shape of its own: the kernel never changes)


class RowLinear(nn.Module):
    """``x W^T + b`` in blocks of exactly :data:`ROWS` rows (fp32; same weights as the layer it replaces).

    Each block is ``torch.addmm(b, block, W^T)`` (the bias enters the product as its initial value, as
    ``nn.Linear`` computes it). The whole blocks run as one batched product (``torch.baddbmm`` over
    ``[blocks, ROWS, K]``: one call, the weights packed once) where this process's BLAS gives each block the bits of
    that block multiplied alone (:func:`batched_is_invariant`, probed once per shape and thread count); else one
    call per block. The last, partial block is padded with zero rows to a block of its own."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias  # the original Parameters, shared

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        """``x W^T + b`` computed row by row, each row's bits independent of the batch."""
        *lead, k = x.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        full = m - m % ROWS  # rows in whole blocks: multiplied in place, no padded copy of the input
        out = x2.new_empty(-(-m // ROWS) * ROWS, self.weight.shape[0])  # [Mp,N]
        if full:
            block_product(x2[:full], self.weight, self.bias, out=out[:full])
        if full < m:  # the last, partial block: padded with zero rows to a block of its own
            tail = x2.new_zeros(ROWS, k)
            tail[: m - full] = x2[full:]
            _block_loop(tail, self.weight, self.bias, out=out[full:])
        return out[:m].view(*lead, -1)


def _block_loop(xp: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``xp W^T + b``, one ``torch.addmm`` (``torch.mm`` without a bias) per :data:`ROWS`-row block (the reference
    form): [Mp,K] -> [Mp,N]."""
    wt = weight.t()
    out = xp.new_empty(xp.shape[0], weight.shape[0]) if out is None else out
    for s in range(0, xp.shape[0], ROWS):
        if bias is None:
            torch.mm(xp[s : s + ROWS], wt, out=out[s : s + ROWS])
        else:
            torch.addmm(bias, xp[s : s + ROWS], wt, out=out[s : s + ROWS])
    return out


def _block_bmm(xp: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``xp W^T + b`` as one batched product of :data:`ROWS`-row blocks (``torch.baddbmm``, the bias the initial
    value of every block, as ``addmm``): [Mp,K] -> [Mp,N]."""
    nb, (n, k) = xp.shape[0] // ROWS, weight.shape
    out = xp.new_empty(xp.shape[0], n) if out is None else out
    blocks, wt = xp.view(nb, ROWS, k), weight.t().expand(nb, k, n)
    if bias is None:
        torch.bmm(blocks, wt, out=out.view(nb, ROWS, n))
    else:
        torch.baddbmm(bias.expand(nb, ROWS, n), blocks, wt, out=out.view(nb, ROWS, n))
    return out


PROBE_BLOCKS = (1, 2, 3, 5, 16, 17, 40)  # block counts the probe multiplies at once: small, odd, and past a
# CPU batch's 2,048 tokens (16 blocks) to the lexicon adapter's thousands of distinct words
_BATCHED: dict[tuple, bool] = {}  # (K, N, dtype, threads, bias) -> the batched product is block-invariant here


def batched_is_invariant(weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the batched product over :data:`ROWS`-row blocks (:func:`_block_bmm`) gives every block exactly the
    bits of that block multiplied alone (:func:`_block_loop`), for ``weight``'s shape, with or without a bias, at
    the current thread count: probed once per (shape, dtype, threads, bias) on seeded data: in a batch of each of
    :data:`PROBE_BLOCKS` block counts, the first, a middle and the last block compared with that block alone. The
    BLAS documents no such promise, so it is measured in this process rather than assumed; where it fails, blocks
    are multiplied one by one (the same bits, slower)."""
    n, k = weight.shape
    key = (k, n, weight.dtype, torch.get_num_threads(), bias is not None)
    if key not in _BATCHED:
        g = torch.Generator().manual_seed(k * 7919 + n)
        w = torch.randn(n, k, generator=g, dtype=weight.dtype)
        b = None if bias is None else torch.randn(n, generator=g, dtype=weight.dtype)
        _BATCHED[key] = all(_probe(nb, w, b, g) for nb in PROBE_BLOCKS)  # stops at the first batch that differs
    return _BATCHED[key]


def _probe(nb: int, w: Tensor, b: Tensor | None, g: torch.Generator) -> bool:
    """One batch of ``nb`` seeded blocks: do its first, a middle and its last block get the bits they get alone?"""
    xp = torch.randn(nb * ROWS, w.shape[1], generator=g, dtype=w.dtype) * torch.rand(nb * ROWS, 1, generator=g)
    got = _block_bmm(xp, w, b)
    blocks = [slice(i * ROWS, (i + 1) * ROWS) for i in sorted({0, nb // 2, nb - 1})]
    return all(torch.equal(got[r], _block_loop(xp[r], w, b)) for r in blocks)


def block_product(xp: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``xp W^T + b`` [Mp,N] for ``xp`` [Mp,K] (Mp a multiple of :data:`ROWS`), each row's bits those of its block
    multiplied alone: batched where :func:`batched_is_invariant`, else block by block; into ``out`` if given."""
    if xp.shape[0] > ROWS and batched_is_invariant(weight, bias):
        return _block_bmm(xp, weight, bias, out)
    return _block_loop(xp, weight, bias, out)


_PLAIN_LINEAR = (nn.Linear, nn.Bilinear, torch.ao.nn.quantized.Linear)  # dynamic int8 Linear derives from the last
_ONE_THREAD: dict[tuple, bool] = {}  # (layer identity, threads) -> one thread gives the bits of `threads`


def one_thread_invariant(model: nn.Module) -> bool:
    """Whether every row-invariant linear map of ``model`` (:class:`RowLinear`, :class:`RowInt8Linear`) gives, on
    one torch thread, exactly the bits it gives on the current thread count: probed once per layer shape and thread
    count (with the weights of the first layer of that shape), on seeded rows of two whole blocks, in the per-block
    reference form (the batched form
    is checked against that per thread count by :func:`batched_is_invariant`). A BLAS may split a product's
    additions by thread; the rest of the row-invariant forward is per row or per (sequence, head) whatever the
    thread split (LayerNorm, attention, :class:`RowElementwise`, the int8 products' exact int32 sums), so where
    this holds, a batch scored on one thread has the bits of the same batch scored on all of them. Run in the
    thread that sets the count (it switches the count to 1 and back). A BLAS picks its kernel by shape, dtype and
    threads, not by values."""
    threads = torch.get_num_threads()
    if any(isinstance(m, _PLAIN_LINEAR) for m in model.modules()):
        return False  # a plain layer's kernel follows the batch and the thread split: never probed, never assumed
    layers = [m for m in model.modules() if isinstance(m, (RowLinear, RowInt8Linear))]
    if not layers:
        return False
    todo = [m for m in layers if (_layer_key(m), threads) not in _ONE_THREAD]
    if todo:
        g = torch.Generator().manual_seed(2024)
        inputs = [torch.randn(2 * ROWS, _in_features(m), generator=g) for m in todo]
        with torch.inference_mode():
            wide = [_per_block(m, x) for m, x in zip(todo, inputs)]
            torch.set_num_threads(1)
            try:
                one = [_per_block(m, x) for m, x in zip(todo, inputs)]
            finally:
                torch.set_num_threads(threads)
        for m, a, b in zip(todo, wide, one):
            _ONE_THREAD[_layer_key(m), threads] = torch.equal(a, b)
    return all(_ONE_THREAD[_layer_key(m), threads] for m in layers)


def _per_block(m: nn.Module, x: Tensor) -> Tensor:
    """The layer's product block by block: fp32 in its reference form (:func:`_block_loop`; that the batched form
    gives the same bits is :func:`batched_is_invariant`'s probe, per thread count), int8 as it runs."""
    return _block_loop(x, m.weight, m.bias) if isinstance(m, RowLinear) else m(x)


def _layer_key(m: nn.Module) -> tuple:
    """What selects a layer's kernels: its form, shape, dtype and bias (as :func:`batched_is_invariant`)."""
    if isinstance(m, RowLinear):
        return ("fp32", *m.weight.shape, m.weight.dtype, m.bias is not None)
    return ("int8", m.in_features, m.out_features, m.bias is not None)


def _in_features(m: nn.Module) -> int:
    return m.weight.shape[1] if isinstance(m, RowLinear) else m.in_features


class RowInt8Linear(nn.Module):
    """int8 ``x W^T + b`` with a per-row activation scale (module doc); weights per-channel symmetric int8."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        obs(w)
        scale, zero = obs.calculate_qparams()
        with warnings.catch_warnings():  # fbgemm's prepack takes a quantized tensor, whose creation warns of
            # a future deprecation; torch is pinned (constraints.txt), the path is what quantize_dynamic runs
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale.to(torch.double), zero.to(torch.int64), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the activation range is [-1, 1] for every row: the quantization parameters fbgemm's dynamic path picks
        # for that range with 7-bit inputs (reduce_range), computed by the same function, once
        self.x_scale, self.x_zero = torch._choose_qparams_per_tensor(torch.tensor([-1.0, 1.0]), True)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        """int8 ``x W^T + b`` with each row's own activation scale."""
        *lead, k = x.shape
        x2 = x.reshape(-1, k)
        s = torch.maximum(x2.amax(1, keepdim=True), -x2.amin(1, keepdim=True))  # [M,1] the row's max-abs (exact;
        # two vectorised reductions: ~10x faster here than vector_norm(inf) or aminmax)
        if not bool(torch.isfinite(s).all()):
            raise ValueError("non-finite activations reach an int8 layer: the model's output is undefined")
        s = torch.where(s > 0, s, 1.0)
        xn = x2 / s  # every row in [-1, 1], its max-abs at exactly 1 (x / x is exact)
        # quantize with the fixed [-1, 1] parameters, int8 x int8 products summed exactly in int32, dequantize
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xn, self.x_scale, self.x_zero,
                                                                              self.packed)  # [M,N]
        y = y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s, out=y)  # in place: no new [M,N]
        return y.view(*lead, -1)


def sigmoid_rows(z: Tensor) -> Tensor:
    """``torch.sigmoid`` of a 1-D tensor, padded to a multiple of :data:`LANES` first: ATen computes a vector's
    remainder with its scalar code, whose bits differ from the vector code's, so unpadded, a logit's probability
    would depend on how many logits share the call."""
    pad = (-z.numel()) % LANES
    return torch.sigmoid(torch.cat([z, z.new_zeros(pad)]) if pad else z)[: z.numel()]


def softmax_rows(z: Tensor) -> Tensor:
    """Softmax over the last dim of ``z`` [N, K], each row's bits a function of that row alone: the max is
    subtracted per row, ``exp`` runs on the flattened values padded like :func:`sigmoid_rows` (vector code only,
    in blocks under ATen's parallel grain), and each row is divided by its own sum."""
    n, k = z.shape
    shifted = (z - z.amax(1, keepdim=True)).reshape(-1)
    e = torch.empty_like(shifted)
    for s in range(0, shifted.numel(), ELEMENTWISE_BLOCK):
        part = shifted[s : s + ELEMENTWISE_BLOCK]
        pad = (-part.numel()) % LANES
        e[s : s + part.numel()] = torch.exp(torch.cat([part, part.new_zeros(pad)]) if pad else part)[: part.numel()]
    e = e.view(n, k)
    return e / e.sum(1, keepdim=True)


LANES = 64  # a multiple of every CPU kernel's vector step (2 x 8 fp32 lanes on AVX2, 2 x 16 on AVX-512)
ELEMENTWISE_BLOCK = 16_384  # elements per call of the blocked form (whole vectors): under ATen's parallel grain
# (32,768 elements), so one thread runs each call


class RowElementwise(nn.Module):
    """An elementwise module (GELU, tanh) whose bits do not depend on the tensor's size or the thread count.

    ATen splits an elementwise op over threads in chunks of ``ceil(numel / threads)`` elements, and computes each
    chunk's remainder (under two vector widths) with its scalar code, whose transcendental functions give other bits
    than the vector code. When every possible chunk is a whole number of :data:`LANES` (``numel`` divisible by
    ``LANES * k`` for every thread count ``k`` up to torch's; true for the default 2 threads and widths that are
    multiples of 64) the op runs as it is; otherwise in blocks of :data:`ELEMENTWISE_BLOCK` elements, each run by
    one thread entirely in vector code (the tensor padded to a multiple of :data:`LANES`)."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        """``fn(x)`` with the tensor padded so every thread's share is whole vector lanes."""
        n = x.numel()
        if all(n % (LANES * k) == 0 for k in range(1, torch.get_num_threads() + 1)):
            return self.fn(x)
        flat = x.reshape(-1)
        pad = (-n) % LANES
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        out = torch.empty_like(flat)
        for s in range(0, flat.numel(), ELEMENTWISE_BLOCK):
            out[s : s + ELEMENTWISE_BLOCK] = self.fn(flat[s : s + ELEMENTWISE_BLOCK])
        return out[:n].view_as(x)


def rowwise(model: nn.Module, precision: str = "fp32") -> nn.Module:
    """A copy of ``model`` (eval mode, weights shared, not copied) whose every ``nn.Linear`` is row-invariant:
    :class:`RowLinear`, or under ``precision="int8"`` :class:`RowInt8Linear` inside the transformer blocks (the
    lexicon adapter's word projection and the heads stay fp32: a few per cent of the compute, most of the int8
    error). The lexicon adapter's bilinear ``W_attn`` becomes a :class:`RowLinear` too. CPU inference only."""
    if precision not in ("fp32", "int8"):
        raise ValueError(f"precision {precision!r}: expected fp32 or int8")
    if getattr(model, "rowwise_precision", None) is not None:
        if model.rowwise_precision != precision:
            raise ValueError(f"model is already row-invariant {model.rowwise_precision}, not {precision}")
        return model
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    out = copy.deepcopy(model, memo=shared).eval()
    for name, module in list(out.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (nn.GELU, nn.Tanh)):
                setattr(module, child_name, RowElementwise(child))
            if not isinstance(child, nn.Linear):
                continue
            full = f"{name}.{child_name}" if name else child_name
            int8 = precision == "int8" and ".blocks." in f".{full}"
            setattr(module, child_name, RowInt8Linear(child) if int8 else RowLinear(child.weight, child.bias))
        if hasattr(module, "attn_weight") and hasattr(module, "attn_keys"):  # LexiconAdapter
            module.attn_keys = RowLinear(module.attn_weight, None)
    out.rowwise_precision = precision  # marks the copy: rowwise() of it is itself
    return out
