"""Attention routes that let CUDA use its flash kernel, checked on CPU in float64.

On CUDA the encoder runs SDPA without a mask where a batch has no padding and over jagged tensors of the real
tokens where it has (:func:`models.bert.attention_route`); on CPU it always runs the masked kernel. The routes are
called directly here (and the CUDA decision simulated) and compared with the masked kernel on the real tokens,
within a tolerance: they are different computations of the same function.
"""

from __future__ import annotations

import logging

import pytest
import torch

from models import bert
from models.bert import NO_PADDING, SelfAttention, Unpadded, attention_route
from tests.test_models import batch, tiny

TOL = dict(rtol=1e-10, atol=1e-12)
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts with jagged attention on and nothing logged yet (module state restored afterwards)."""
    monkeypatch.setattr(bert, "_jagged_state", {"on": bert.jagged_available(), "why": "test"})
    monkeypatch.setattr(bert, "_logged", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build raises here
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _attention(seed=0):
    torch.manual_seed(seed)
    return SelfAttention(tiny()).double().eval()


def _ragged(B=3, T=12):
    lengths = torch.tensor([T, T - 4, 1][:B])
    return torch.arange(T)[None, :] < lengths[:, None]  # [B,T]


def test_unpadded_index_logic():
    mask = _ragged()
    u = Unpadded.of(mask)
    assert u.rows.tolist() == mask.reshape(-1).nonzero().squeeze(1).tolist()
    assert u.offsets.tolist() == [0, 12, 20, 21] and (u.min_len, u.max_len) == (1, 12)
    x = torch.arange(3 * 12, dtype=torch.float64).view(3, 12, 1)
    real = x.reshape(-1, 1).index_select(0, u.rows)  # gather the real tokens, then scatter them back
    back = real.new_zeros(36, 1).index_copy(0, u.rows, real).view(3, 12, 1)
    assert torch.equal(back, x * mask[..., None])  # values only moved (and times 0 or 1): exact by design


def test_no_mask_route_equals_the_masked_kernel_without_padding():
    attn = _attention()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    key_mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    torch.testing.assert_close(attn(x, key_mask, NO_PADDING), attn(x, key_mask), **TOL)


@pytest.mark.skipif(not bert.jagged_available(), reason="this torch has no jagged nested tensors")
def test_unpadded_route_equals_the_masked_kernel_on_real_tokens_forward_and_backward():
    attn = _attention()
    mask = _ragged()
    x = torch.randn(3, 12, 32, dtype=torch.float64, requires_grad=True)
    key_mask = mask[:, None, None, :]
    ref = attn(x, key_mask)
    got = attn(x, key_mask, Unpadded.of(mask))
    torch.testing.assert_close(got[mask], ref[mask], **TOL)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))  # padding positions: 0, read by nothing
    assert bert._jagged_state["on"]
    g = torch.randn_like(ref[mask])
    grads_ref = torch.autograd.grad((ref[mask] * g).sum(), [x, *attn.parameters()])
    grads = torch.autograd.grad((got[mask] * g).sum(), [x, *attn.parameters()])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **TOL)


def test_route_decision():
    mask = _ragged()
    assert attention_route(mask, None, torch.device("cpu")) is None  # CPU: always the masked kernel
    assert attention_route(mask, True, torch.device("cpu")) is None
    assert attention_route(None, None, CUDA) == NO_PADDING
    assert attention_route(mask, False, CUDA) == NO_PADDING  # the caller knows: no device read
    assert attention_route(torch.ones(2, 5, dtype=torch.bool), None, CUDA) == NO_PADDING  # read once per batch
    u = attention_route(mask, True, CUDA)
    assert isinstance(u, Unpadded) and u.offsets.tolist() == [0, 12, 20, 21]
    assert isinstance(attention_route(mask, None, CUDA), Unpadded)
    found = Unpadded.of(mask)  # by the caller, on the host: taken as it is
    assert attention_route(mask, found, CUDA) is found
    with bert.static_attention():
        assert attention_route(mask, found, CUDA) is None


def test_no_device_read_while_compiling_or_capturing(monkeypatch):
    mask = _ragged()
    with bert.static_attention():  # a CUDA graph's warm-up step: the route its capture will take
        assert attention_route(mask, True, CUDA) is None
        assert attention_route(mask, False, CUDA) == NO_PADDING
    assert isinstance(attention_route(mask, True, CUDA), Unpadded)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert attention_route(mask, True, CUDA) is None
    assert attention_route(mask, False, CUDA) == NO_PADDING
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert attention_route(mask, None, CUDA) is None


def test_without_jagged_tensors_padded_batches_keep_the_masked_kernel(monkeypatch, caplog):
    monkeypatch.setattr(bert, "_jagged_state", {"on": False, "why": "this torch has no jagged nested tensors"})
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        assert attention_route(_ragged(), True, CUDA) is None
        assert attention_route(_ragged(), True, CUDA) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention on CUDA: padded batches run SDPA with the key mask (this torch has no jagged "
                     "nested tensors)"]  # once


def test_a_failing_unpadded_kernel_falls_back_to_the_masked_one_with_one_warning(monkeypatch, caplog):
    attn = _attention()
    mask = _ragged()
    x = torch.randn(3, 12, 32, dtype=torch.float64)

    def boom(self, x, u):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found.\nmore")

    monkeypatch.setattr(SelfAttention, "_unpadded", boom)
    key_mask = mask[:, None, None, :]
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        first = attn(x, key_mask, Unpadded.of(mask))
        second = attn(x, key_mask, Unpadded.of(mask))
    # the fallback is the masked kernel itself: the same computation on the same inputs, so the same bits
    assert torch.equal(first, attn(x, key_mask)) and torch.equal(second, first)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unpadded (jagged) SDPA failed (RuntimeError: No viable backend" in \
        warnings[0].getMessage()
    assert not bert._jagged_state["on"] and attention_route(mask, True, CUDA) is None


@pytest.mark.skipif(not bert.jagged_available(), reason="this torch has no jagged nested tensors")
@pytest.mark.parametrize("padded", [True, None])
def test_encoder_on_the_cuda_routes_equals_the_masked_encoder_on_real_tokens(monkeypatch, padded):
    torch.manual_seed(0)
    from models import LebertForPretraining

    model = LebertForPretraining(tiny()).double().eval()
    ids, seg, mask, words, mlm = batch()
    with torch.no_grad():
        ref = model.encoder(ids, seg, mask, words)
        routes, real = [], bert.attention_route

        def as_on_cuda(attention_mask, padded, device):  # the CUDA decision, on these CPU tensors
            routes.append(real(attention_mask, padded, CUDA))
            return routes[-1]

        monkeypatch.setattr(bert, "attention_route", as_on_cuda)
        got = model.encoder(ids, seg, mask, words, padded=padded)
        full = torch.ones_like(mask)
        got_full = model.encoder(ids, seg, full, words, padded=False)
    assert isinstance(routes[0], Unpadded) and routes[1] == NO_PADDING
    torch.testing.assert_close(got[mask], ref[mask], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(got_full, model.encoder(ids, seg, full, words), **TOL)


@pytest.mark.parametrize("padded", [True, False])
def test_the_cuda_decision_traces_into_one_compiled_graph(monkeypatch, padded):
    """Under torch.compile the route is decided while tracing, reads nothing and logs nothing: one whole graph
    (fullgraph), the same hidden states as the masked encoder on real tokens."""
    torch.manual_seed(0)
    from models import LebertEncoder

    enc = LebertEncoder(tiny()).eval()
    ids, seg, mask, words, _ = batch()
    if not padded:
        mask = torch.ones_like(mask)
    real = bert.attention_route
    monkeypatch.setattr(bert, "attention_route", lambda m, p, d: real(m, p, CUDA))
    # with autograd on (as in training): the adapter's dense form (its inference form reads the device)
    got = torch.compile(enc, backend="eager", fullgraph=True)(ids, seg, mask, words, padded=padded)
    monkeypatch.setattr(bert, "attention_route", real)
    ref = enc(ids, seg, mask, words)
    torch.testing.assert_close(got[mask], ref[mask], rtol=1e-5, atol=1e-6)
    assert not bert._logged  # nothing logged from inside the trace


def test_a_padding_hint_found_on_the_host_reaches_the_classifiers_encoder(monkeypatch):
    """Labelling and fine-tuning on CUDA tell the classifier where a batch's padding is from the host copy of the
    batch (no device read to route attention): False without padding, else the real tokens, which the classifier
    hands to its encoder; on CPU the hint changes nothing (the masked kernel, the same logits)."""
    import numpy as np

    from models import LebertClassifier
    from models.bert import padding_of

    ids = np.array([[2, 7, 8, 3], [2, 9, 3, 0], [2, 3, 0, 0]])
    assert padding_of(torch.from_numpy(ids[:1] != 0), torch.device("cpu")) is False
    hint = padding_of(torch.from_numpy(ids != 0), torch.device("cpu"))
    assert hint.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9] and hint.offsets.tolist() == [0, 4, 7, 9]
    assert (hint.min_len, hint.max_len) == (2, 4)

    seen = []
    real_route = bert.attention_route
    monkeypatch.setattr(bert, "attention_route", lambda m, padded, d: seen.append(padded) or real_route(m, padded, d))
    torch.manual_seed(0)
    model = LebertClassifier(tiny(), use_layers=1).double().eval()
    t = torch.from_numpy(ids)
    with torch.no_grad():
        plain = model(t, t != 0)
        hinted = model(t, t != 0, padded=hint)
    # on CPU the route is the masked kernel with or without the hint: the same computation twice, so the same bits
    assert seen == [None, hint] and torch.equal(plain, hinted)
