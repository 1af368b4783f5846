"""The row-invariant layers (models/rowwise.py): their fast paths give exactly the bits of the reference forms.

Exact equality is the design here: the batched product is used only where it gives each block the bits of that block
multiplied alone, and the int8 layer's fixed quantization parameters are those fbgemm's dynamic path picks for the
range every row is scaled to."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models.rowwise as rw
from models.rowwise import ROWS, RowInt8Linear, RowLinear


def _dynamic_reference(layer: RowInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The int8 layer as first written: rows scaled to [-1, 1], two anchor rows [-1, 0, ...] and [1, 0, ...]
    appended so fbgemm's dynamic quantization measures the range [-1, 1], then the row scale and the bias."""
    s = torch.maximum(x.amax(1, keepdim=True), -x.amin(1, keepdim=True))
    s = torch.where(s > 0, s, torch.ones_like(s))
    anchor = torch.zeros(2, x.shape[1])
    anchor[0, 0], anchor[1, 0] = -1.0, 1.0
    y = torch.ops.quantized.linear_dynamic(torch.cat([x / s, anchor]), layer.packed, True)[: x.shape[0]]
    return torch.addcmul(layer.bias, y, s)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 300), k=st.sampled_from([8, 40, 128, 200]), n=st.sampled_from([3, 64, 130]),
       scale=st.floats(1e-6, 1e6), seed=st.integers(0, 2**31 - 1), exact_edges=st.booleans())
def test_int8_fixed_parameters_give_the_bits_of_the_dynamic_path(m, k, n, scale, seed, exact_edges):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = RowInt8Linear(torch.nn.Linear(k, n))
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * scale
    if exact_edges:  # rows whose values land on quantization steps and ties: the max itself, zeros, halves
        x[:, : min(k, 4)] = torch.tensor([1.0, -1.0, 0.0, 0.5])[: min(k, 4)] * x.abs().amax(1, keepdim=True)
        x[0] = 0.0  # an all-zero row (scale 1)
    with torch.inference_mode():
        # exact on purpose, on any CPU: both ops quantize the input with fbgemm's PackAWithQuantRowOffset under the
        # same scale and zero point, sum int8 products exactly in int32 and dequantize with ReQuantizeForFloat; only
        # where the scale comes from differs (measured on [-1, 1] vs given), and that is what is under test
        assert torch.equal(layer(x), _dynamic_reference(layer, x))


def test_int8_rows_do_not_depend_on_their_batch_and_refuse_non_finite_input():
    torch.manual_seed(0)
    layer = RowInt8Linear(torch.nn.Linear(64, 32))
    x = torch.randn(50, 64) * torch.logspace(-3, 3, 50)[:, None]
    with torch.inference_mode():
        whole = layer(x)
        # exact on purpose: a row's bits alone and in a batch are the promise under test (per-row scales, exact
        # int32 sums, per-element float ops)
        assert all(torch.equal(layer(x[i : i + 1]), whole[i : i + 1]) for i in range(50))
        x[7, 3] = float("nan")
        with pytest.raises(ValueError, match="non-finite activations reach an int8 layer"):
            layer(x)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_gets_the_bits_of_addmm_on_its_zero_padded_block(threads, monkeypatch):
    """The definition, written out: a row's output is ``torch.addmm(b, block, W^T)`` of the 128-row block it sits in
    (zero rows after the last), the bias the product's initial value as in ``nn.Linear``; the batched path, the
    block-by-block path and a row alone all give exactly those bits (a trained layer's bias is not zero: adding it
    after the product would round differently)."""
    from models.numerics import torch_threads

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(300, 200)  # K past the BLAS's inner block: there the bias, added after, rounds otherwise
    with torch.no_grad():
        lin.bias.normal_(0.0, 1.0, generator=g)
    layer = RowLinear(lin.weight, lin.bias)
    x = torch.randn(3 * ROWS + 17, 300, generator=g)
    padded = torch.cat([x, x.new_zeros(-x.shape[0] % ROWS, 300)])
    with torch_threads(threads), torch.inference_mode():
        want = torch.cat([torch.addmm(lin.bias, padded[s : s + ROWS], lin.weight.t())
                          for s in range(0, padded.shape[0], ROWS)])[: x.shape[0]]
        fast = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(0, x.shape[0], 41)])
        monkeypatch.setattr(rw, "block_product", rw._block_loop)  # one addmm per block
        loop = layer(x)
    # exact on purpose, on any CPU: each path runs addmm's kernel on the same 128-row blocks (the batched one only
    # where the probe found it gives those bits, else the loop itself), and a row alone sits in a block of its own
    assert torch.equal(fast, want) and torch.equal(loop, want) and torch.equal(alone, want[::41])


def test_the_bias_added_after_the_product_rounds_otherwise_which_is_why_it_stays_inside():
    """The control for the test above: where the bias is added after the product, the bits differ (K = 300 is past
    MKL's inner block here), so the test above could tell the two forms apart. Where a BLAS happens to give the same
    bits, this control shows nothing and says so."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(300, 200)
    with torch.no_grad():
        lin.bias.normal_(0.0, 1.0, generator=g)
    x = torch.randn(ROWS, 300, generator=g)
    with torch.inference_mode():
        inside, after = torch.addmm(lin.bias, x, lin.weight.t()), x @ lin.weight.t() + lin.bias
    if torch.equal(inside, after):
        pytest.skip("this BLAS gives the same bits either way: the control shows nothing here")
    assert not torch.equal(inside, after)


def test_where_the_probe_finds_batched_products_differ_blocks_run_one_by_one(monkeypatch):
    """A BLAS whose batched product gives a block other bits than that block alone: the probe says so, and the
    layer falls back to the loop (its bits); nothing is assumed about a BLAS that was not measured."""
    def skewed(xp, weight, bias=None, out=None):  # a batched product that rounds differently past one block
        y = rw._block_loop(xp, weight, bias)
        y = y if xp.shape[0] == ROWS else y * (1 + 2**-20)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(rw, "_block_bmm", skewed)
    monkeypatch.setattr(rw, "_BATCHED", {})
    lin = torch.nn.Linear(24, 8)
    assert not rw.batched_is_invariant(lin.weight, lin.bias)
    x = torch.randn(2 * ROWS + 5, 24)
    with torch.inference_mode():
        got = RowLinear(lin.weight, lin.bias)(x)
        padded = torch.cat([x, x.new_zeros(-x.shape[0] % ROWS, x.shape[1])])  # whole blocks, zero rows last
        want = rw._block_loop(padded, lin.weight, lin.bias)[: x.shape[0]]
    assert torch.equal(got, want)
