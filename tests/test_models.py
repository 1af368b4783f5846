"""models/: padding invariance, lexicon-adapter masking, sparse MLM head, tying, overfitting, positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from models import LebertEncoder, LebertForPretraining, LexiconAdapter, ModelConfig, sinusoidal_table

V, WV, W = 50, 20, 3


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention (20x slower on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_len=64,
                word_vocab_size=WV, word_dim=8, max_word_num=W, hidden_dropout=0.1, attention_dropout=0.1)
    return ModelConfig(**{**base, **kw})


def batch(B=3, T=12, seed=0):
    """Random batch with ragged lengths: [CLS]=1 first, padding id 0 / mask 0 / words 0 at the end."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, T - 4, T - 7][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B,T]
    ids = torch.randint(2, V, (B, T), generator=g).masked_fill(~mask, 0)
    ids[:, 0] = 1
    seg = (torch.arange(T)[None, :] >= (lengths[:, None] // 2)).long() * mask
    words = torch.randint(1, WV, (B, T, W), generator=g)
    words = words.masked_fill(torch.rand(B, T, W, generator=g) < 0.4, 0)  # some empty slots
    words[:, 1] = 0  # and a character with no words at all
    words = words.masked_fill(~mask[..., None], 0)
    mlm = torch.zeros(B, T, dtype=torch.bool)
    mlm[:, 2] = mlm[:, 4] = True
    return ids, seg, mask, words, mlm


def pad(x: torch.Tensor, extra: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, extra) if x.dim() == 3 else (0, extra))


# 1. padding invariance ---------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_padding_does_not_change_real_positions(position):
    torch.manual_seed(0)
    model = LebertForPretraining(tiny(position=position)).eval()
    ids, seg, mask, words, mlm = batch()
    B, T = ids.shape
    labels, nsp = torch.randint(2, V, (int(mlm.sum()),)), torch.tensor([0, 1, 0])
    with torch.no_grad():
        h1 = model.encoder(ids, seg, mask, words)
        h2 = model.encoder(pad(ids, 7), pad(seg, 7), pad(mask, 7), pad(words, 7))
        assert h2.shape == (B, T + 7, 32) and torch.isfinite(h2).all()
        torch.testing.assert_close(h1[mask], h2[:, :T][mask], atol=1e-5, rtol=0)
        o1 = model(ids, seg, mask, words, mlm, labels, nsp)
        flat2 = (torch.arange(B)[:, None] * (T + 7) + torch.arange(T)[None, :])[mlm]  # flat indices into B*(T+7)
        o2 = model(pad(ids, 7), pad(seg, 7), pad(mask.long(), 7), pad(words, 7), flat2, labels, nsp)
    for name in ("mlm_logits", "nsp_logits", "mlm_loss", "nsp_loss", "loss"):
        torch.testing.assert_close(getattr(o1, name), getattr(o2, name), atol=1e-5, rtol=0)
    assert o1.mlm_correct == o2.mlm_correct


# 2. lexicon adapter ------------------------------------------------------------------------------


def test_adapter_attention_masks_padded_slots_exactly():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny()).eval()
    model.load_word_vectors(torch.randn(WV, 8))
    ids, seg, mask, words, mlm = batch()
    adapter = model.encoder.adapter
    adapter.record_attention = True
    with torch.no_grad():
        out = model(ids, seg, mask, words, mlm)
    a = adapter.last_attention  # [B,T,W]
    assert a.shape == words.shape and torch.isfinite(a).all()
    assert (a[words == 0] == 0).all()  # exactly zero, not just small
    has_word = (words != 0).any(-1)
    torch.testing.assert_close(a.sum(-1)[has_word], torch.ones(int(has_word.sum())))
    assert (a.sum(-1)[~has_word] == 0).all()
    assert torch.isfinite(out.mlm_logits).all() and torch.isfinite(out.nsp_logits).all()


def test_character_without_words_gets_layernorm_of_itself():
    torch.manual_seed(0)
    adapter = LexiconAdapter(tiny()).eval()
    h = torch.randn(2, 5, 32)
    words = torch.randint(1, WV, (2, 5, W))
    words[0, 1] = 0
    words[1, 3] = 0
    words[1, 4, 1:] = 0  # one word only
    with torch.no_grad():
        out = adapter(h, words)
    empty = (words == 0).all(-1)
    assert torch.equal(out[empty], adapter.ln(h)[empty])
    assert not torch.allclose(out[~empty], adapter.ln(h)[~empty])
    assert torch.equal(adapter(h, None), adapter.ln(h))  # no word_ids == every slot empty


def test_padded_word_vectors_do_not_matter():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny()).eval()
    ids, seg, mask, words, mlm = batch()
    masked_id = WV - 1  # a real id that only ever appears in slots an explicit word_mask switches off
    words = words.masked_fill(words == masked_id, 2)
    words[0, 3, 2] = words[1, 5, 0] = masked_id
    wmask = (words != 0) & (words != masked_id)
    run = lambda: model(ids, seg, mask, words, mlm, word_mask=wmask)  # noqa: E731
    with torch.no_grad():
        ref = run()
        model.encoder.adapter.word_embeddings.weight[0] = 1e4  # the [PAD] word row
        model.encoder.adapter.word_embeddings.weight[masked_id] = -7.0
        new = run()
    assert torch.equal(ref.mlm_logits, new.mlm_logits) and torch.equal(ref.nsp_logits, new.nsp_logits)


def test_adapter_backward_is_finite_and_vectors_load():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny()).train()
    with pytest.raises(ValueError, match=r"\(20, 8\)"):
        model.load_word_vectors(torch.zeros(WV + 1, 8))
    vecs = torch.randn(WV, 8)
    model.load_word_vectors(vecs.numpy(), freeze=True)
    assert torch.equal(model.encoder.adapter.word_embeddings.weight, vecs)
    ids, seg, mask, words, mlm = batch()
    words[:] = 0  # every row of the adapter softmax is empty
    out = model(ids, seg, mask, words, mlm, torch.randint(2, V, (int(mlm.sum()),)), torch.tensor([0, 1, 1]))
    out.loss.backward()
    assert model.encoder.adapter.word_embeddings.weight.grad is None  # frozen
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


def test_adapter_off_has_no_params_and_ignores_words():
    torch.manual_seed(0)
    cfg = tiny(use_adapter=False, word_vocab_size=0)
    model = LebertForPretraining(cfg).eval()
    assert model.encoder.adapter is None
    assert not any("adapter" in n or "word" in n for n, _ in model.named_parameters())
    ids, seg, mask, words, mlm = batch()
    with torch.no_grad():
        a = model(ids, seg, mask, None, mlm).mlm_logits
        b = model(ids, seg, mask, words, mlm).mlm_logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no lexicon adapter"):
        model.load_word_vectors(torch.zeros(WV, 8))
    with pytest.raises(ValidationError, match="word_vocab_size"):
        tiny(word_vocab_size=0)


# 3./4. heads -------------------------------------------------------------------------------------


def test_sparse_mlm_head_matches_dense_reference():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny()).eval()
    ids, seg, mask, words, mlm = batch()
    labels = torch.randint(2, V, (int(mlm.sum()),))
    with torch.no_grad():
        out = model(ids, seg, mask, words, mlm, labels)
        flat = mlm.reshape(-1).nonzero().squeeze(1)
        out_flat = model(ids, seg, mask, words, flat, labels)
        hidden = model.encoder(ids, seg, mask, words)
        head = model.mlm_head
        dense = head.decoder(head.ln(head.act(head.dense(hidden))))  # [B,T,V] reference
        ref_loss = F.cross_entropy(dense[mlm], labels)
    assert out.mlm_logits.shape == (int(mlm.sum()), V)
    torch.testing.assert_close(out.mlm_logits, dense[mlm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.mlm_loss, ref_loss)
    assert torch.equal(out.mlm_logits, out_flat.mlm_logits)
    assert out.mlm_correct == (dense[mlm].argmax(-1) == labels).sum()
    assert out.nsp_loss is None and torch.equal(out.loss, out.mlm_loss)


def test_decoder_is_tied_to_token_embedding():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny())
    tok = model.encoder.embeddings.token.weight
    assert model.mlm_head.decoder.weight is tok
    assert model.mlm_head.decoder.weight.data_ptr() == tok.data_ptr()
    ids, seg, mask, words, mlm = batch()
    unused = sorted(set(range(V)) - set(ids.unique().tolist()))[0]  # gets gradient only via the decoder
    model(ids, seg, mask, words, mlm, torch.randint(2, V, (int(mlm.sum()),))).loss.backward()
    assert tok.grad is not None and tok.grad[unused].abs().sum() > 0
    untied = LebertForPretraining(tiny(tie_mlm_decoder=False))
    assert untied.mlm_head.decoder.weight is not untied.encoder.embeddings.token.weight
    assert untied.num_params() - model.num_params() == V * 32
    assert untied.num_params(non_embedding=True) == model.num_params(non_embedding=True)


# 5. training sanity ------------------------------------------------------------------------------


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = LebertForPretraining(tiny(hidden_dropout=0.0, attention_dropout=0.0)).train()
    B, T = 4, 16
    ids = torch.randint(2, V, (B, T))
    ids[:, 0] = 1
    seg = (torch.arange(T) >= T // 2).long().expand(B, T)
    words = torch.randint(0, WV, (B, T, W))
    mlm = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mlm[b, torch.randperm(T - 1)[:3] + 1] = True
    labels = torch.randint(2, V, (int(mlm.sum()),))
    nsp = torch.tensor([0, 1, 1, 0])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(200):
        out = model(ids, seg, None, words, mlm, labels, nsp)
        first = first if first is not None else (out.mlm_loss.item(), out.nsp_loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert first[0] > 3.0
    assert out.mlm_loss.item() < 0.05 and out.nsp_loss.item() < 0.05, (first, out.mlm_loss.item(), out.nsp_loss.item())
    assert out.mlm_correct == labels.numel()


def test_init_is_deterministic_and_bert_like():
    torch.manual_seed(1)
    a = LebertForPretraining(tiny())
    torch.manual_seed(1)
    b = LebertForPretraining(tiny())
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    blk = a.encoder.blocks[0]
    assert (blk.attn.qkv.bias == 0).all() and (blk.ln1.weight == 1).all()
    assert abs(blk.ffn[0].weight.std().item() - 0.02) < 0.005
    assert (a.encoder.adapter.word_embeddings.weight[0] == 0).all()


# 6. positions, config, encoder options -----------------------------------------------------------


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_position_options_and_max_len(position):
    torch.manual_seed(0)
    enc = LebertEncoder(tiny(position=position, max_len=16)).eval()
    names = dict(enc.named_parameters())
    assert ("embeddings.position.weight" in names) == (position == "learned")
    assert "embeddings.position_table" not in enc.state_dict()  # fixed table: not saved
    ids = torch.randint(1, V, (2, 16))
    assert enc(ids).shape == (2, 16, 32)
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds max_len 16"):
        enc(torch.randint(1, V, (2, 17)))


def test_sinusoidal_table_values():
    t = sinusoidal_table(10, 6)
    assert torch.equal(t[0], torch.tensor([0.0, 1, 0, 1, 0, 1]))
    torch.testing.assert_close(t[3, 2], torch.sin(torch.tensor(3 / 10000 ** (2 / 6))))
    assert sinusoidal_table(4, 5).shape == (4, 5)


def test_encoder_use_layers_and_config_checks():
    torch.manual_seed(0)
    enc = LebertEncoder(tiny()).eval()
    ids, seg, mask, words, _ = batch()
    with torch.no_grad():
        h1 = enc(ids, seg, mask, words, use_layers=1)
        h2 = enc(ids, seg, mask, words)
        x = enc.embeddings(ids, seg)
        ref = enc.adapter(enc.blocks[0](x, mask[:, None, None, :]), words)
    assert torch.equal(h1, ref) and not torch.allclose(h1, h2)
    with pytest.raises(ValueError, match="use_layers 3"):
        enc(ids, use_layers=3)
    # flops_per_token is checked against torch's FLOP counter in tests/test_gpu_paths.py
    with pytest.raises(ValidationError, match="divisible"):
        tiny(num_heads=5)
    with pytest.raises(ValidationError, match="adapter_layer"):
        tiny(adapter_layer=3)


def test_adapter_projects_distinct_words_once_without_autograd_and_gives_the_same_output():
    import torch

    from models import ModelConfig
    from models.bert import LexiconAdapter

    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_len=16,
                      word_vocab_size=30, word_dim=8, max_word_num=3, adapter_layer=1, hidden_dropout=0.0)
    torch.manual_seed(0)
    adapter = LexiconAdapter(cfg).eval()
    torch.nn.init.normal_(adapter.attn_weight, 0.0, 0.2)
    h = torch.randn(4, 10, 16)
    word_ids = torch.randint(0, 30, (4, 10, 3))
    word_ids[0, :, :] = 0  # a row with no words at all
    seen = []
    hook = adapter.word_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:-1].numel()))
    with torch.enable_grad():
        every_slot = adapter(h, word_ids)
    with torch.no_grad():
        distinct = adapter(h, word_ids)
        adapter.sparse_inference = False
        every_slot_no_grad = adapter(h, word_ids)
    hook.remove()
    # rows projected per call: every slot with autograd; without, each distinct word of the real slots once
    assert seen == [4 * 10 * 3, int(word_ids[word_ids != 0].unique().numel()), 4 * 10 * 3]
    assert torch.allclose(distinct, every_slot, atol=1e-6) and torch.allclose(distinct, every_slot_no_grad, atol=1e-6)
    assert torch.allclose(distinct[0], adapter.ln(h[0]), atol=1e-6)  # no words: h' = LN(h)
    with torch.no_grad():  # a batch in which no character has a word: nothing projected, h' = LN(h) exactly
        adapter.sparse_inference, adapter.record_attention = True, True
        none = adapter(h, torch.zeros_like(word_ids))
    assert torch.equal(none, adapter.ln(h)) and torch.equal(adapter.last_attention, torch.zeros(4, 10, 3))
