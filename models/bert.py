"""LEBERT-style lexicon-enhanced character BERT, in one file.

Shapes: B batch, T sequence length, H hidden size, nh heads, hd = H / nh, W word slots per
character (max_word_num), Dw word vector size, V character vocabulary, N masked positions.

    input_ids [B,T] -> Embeddings -> Block x k -> LexiconAdapter -> Block x (L-k) -> hidden [B,T,H]
    hidden -> MLMHead (masked positions only) -> [N,V];   hidden[:,0] -> NSPHead -> [B,2]

Padding: `attention_mask` [B,T] (True/1 = real token) masks keys in every attention, so outputs
at real positions never depend on padding. Word id 0 (or `word_mask` False) is an empty slot.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig

_ACTIVATIONS = {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": lambda: nn.ReLU()}


def sinusoidal_table(max_len: int, dim: int) -> Tensor:
    """Fixed Transformer position table [max_len, dim]: sin on even channels, cos on odd ones."""
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]  # [P,1]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))  # [ceil(dim/2)]
    table = torch.zeros(max_len, dim)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)[:, : dim // 2]
    return table


def init_weights(module: nn.Module, std: float) -> None:
    """BERT init: N(0, std) for Linear/Embedding weights, zero biases, LayerNorm = (1, 0)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, LexiconAdapter):
        nn.init.normal_(module.attn_weight, 0.0, std)


class Embeddings(nn.Module):
    """token + segment + position, then LayerNorm and dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_len = cfg.max_len
        self.token = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.segment = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        if cfg.position == "learned":
            self.position = nn.Embedding(cfg.max_len, cfg.hidden_size)
        else:  # fixed, not a parameter, rebuilt from the config (so not saved in the state dict).
            # Scaled to the token embeddings' RMS (initializer_range): unscaled unit-amplitude sinusoids
            # drown N(0, 0.02) token vectors and learning stalls.
            self.position = None
            table = sinusoidal_table(cfg.max_len, cfg.hidden_size) * (cfg.initializer_range * math.sqrt(2.0))
            self.register_buffer("position_table", table, persistent=False)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: Tensor, segment_ids: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Token + segment + position embeddings, LayerNorm and dropout: [B,T] ids -> [B,T,H]. ``position_ids``
        [B,T] (default 0..T-1 on every row) restart per sequence in a packed row."""
        B, T = input_ids.shape
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len {self.max_len}")
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        table = self.position.weight if self.position is not None else self.position_table  # [max_len,H]
        pos = table[:T] if position_ids is None else F.embedding(position_ids, table)  # [T,H] or [B,T,H]
        x = self.token(input_ids) + self.segment(segment_ids) + pos  # [B,T,H]
        return self.dropout(self.ln(x))


log = logging.getLogger("lexiflow")


@dataclass(frozen=True)
class Unpadded:
    """The real tokens of a padded batch, for unpadded (jagged) attention: ``rows`` [N] their flat indices into
    B*T in row-major order, ``offsets`` [B+1] int64 the cumulative real tokens per row (cu_seqlens), ``min_len``
    and ``max_len`` the fewest and most real tokens of a row (given to the jagged tensors, which would otherwise
    read them from the device in every layer)."""
    rows: Tensor
    offsets: Tensor
    min_len: int
    max_len: int

    @classmethod
    def of(cls, attention_mask: Tensor) -> "Unpadded":
        """The real tokens of ``attention_mask`` [B,T] (True/1 = real): on a GPU two device reads (the row
        lengths, the real tokens' indices), none for a mask on the host (then :meth:`to` the device)."""
        mask = attention_mask.bool()
        lengths = mask.sum(1)  # [B]
        low, high = (int(v) for v in torch.aminmax(lengths.cpu()))
        rows = mask.reshape(-1).nonzero().squeeze(1)  # [N]
        offsets = F.pad(lengths.cumsum(0), (1, 0))  # [B+1]
        return cls(rows, offsets, low, high)

    def to(self, device: torch.device) -> "Unpadded":
        """On ``device``; from the host to a GPU through pinned memory, without waiting for the device."""
        if device.type != "cuda" or self.rows.is_cuda:
            return Unpadded(self.rows.to(device), self.offsets.to(device), self.min_len, self.max_len)
        rows, offsets = (t.pin_memory().to(device, non_blocking=True) for t in (self.rows, self.offsets))
        return Unpadded(rows, offsets, self.min_len, self.max_len)


def padding_of(real: Tensor, device: torch.device) -> "bool | Unpadded":
    """What a model is told about a batch's padding (its ``padded`` argument) from the batch's mask on the host
    (``real`` [B,T], True = a real token): False without padding, else its real tokens on ``device``. Found on the
    host, so routing attention on CUDA reads nothing from the device."""
    if bool(real.all()):
        return False
    return Unpadded.of(real).to(device)


NO_PADDING = "no-padding"  # attention route: every key is real, SDPA runs without a mask (flash-capable)
_logged: set[str] = set()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if torch.compiler.is_compiling():  # nothing to log from inside a traced graph (the caller says what it runs)
        return
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def jagged_available() -> bool:
    """Whether this torch has jagged nested tensors (SDPA on them is what the unpadded route runs)."""
    return hasattr(torch.nested, "nested_tensor_from_jagged")


_static = {"depth": 0}


@contextlib.contextmanager
def static_attention():
    """Within it, attention never reads the device (padded batches keep the masked kernel), as in a compiled or
    captured step: a CUDA graph's warm-up step then runs the kernels its capture records."""
    _static["depth"] += 1
    try:
        yield
    finally:
        _static["depth"] -= 1


def jagged_enabled() -> bool:
    """Whether padded batches on CUDA run unpadded attention (jagged tensors exist and have not failed)."""
    return bool(_jagged_state["on"])


def attention_route(attention_mask: Tensor | None, padded: bool | Unpadded | None,
                    device: torch.device) -> str | Unpadded | None:
    """How this batch's attention runs, decided once per batch (every layer follows it): None = SDPA with the
    boolean key mask (always on CPU, so CPU results stay as they were); on CUDA :data:`NO_PADDING` when there is
    no mask or ``padded`` is False (the caller knows it, no device read), else the batch's :class:`Unpadded` real
    tokens: ``padded`` itself when the caller found them on the host (no device read), else found here (a few
    device reads, once per batch; ``padded`` None reads whether the mask is all real first). Under torch.compile,
    a CUDA graph capture or :func:`static_attention` the kernels may not depend on where a batch's real tokens
    are: a padded or unknown batch keeps the masked kernel there."""
    if device.type != "cuda":
        return None
    if attention_mask is None or padded is False:
        _log_once("none", logging.INFO, "attention on CUDA: batches without padding run SDPA without a mask "
                  "(the flash kernel can run)")
        return NO_PADDING
    if _static["depth"] or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        _log_once("masked-static", logging.INFO, "attention on CUDA: padded batches in compiled or captured "
                  "steps run SDPA with the key mask")
        return None
    if not _jagged_state["on"]:
        _log_once("masked", logging.INFO, "attention on CUDA: padded batches run SDPA with the key mask (%s)",
                  _jagged_state["why"])
        return None
    if padded is None and bool(attention_mask.bool().all()):  # device reads once per batch, not per layer
        return attention_route(None, False, device)
    _log_once("jagged", logging.INFO, "attention on CUDA: padded batches run unpadded (jagged) SDPA over their "
              "real tokens")
    return padded if isinstance(padded, Unpadded) else Unpadded.of(attention_mask)


_jagged_state: dict = {"on": jagged_available(), "why": "this torch has no jagged nested tensors"}


class SelfAttention(nn.Module):
    """Multi-head self-attention: fused QKV projection + scaled_dot_product_attention.

    ``route`` (:func:`attention_route`, CUDA only) picks the kernel's inputs: None, the boolean key mask (CPU, and
    the fallback); :data:`NO_PADDING`, no mask; an :class:`Unpadded`, SDPA over jagged tensors of the real tokens
    only (their outputs; a padding position gets 0, which nothing downstream reads at real positions)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.dropout_p = cfg.num_heads, cfg.attention_dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, key_mask: Tensor, route: str | Unpadded | None = None) -> Tensor:
        """Attention of every position over the real keys of its row: [B,T,H] -> [B,T,H]."""
        # x [B,T,H]; key_mask [B,1,1,T] bool, True = attend. Padding query rows still see the
        # real keys ([CLS] at least), so no row is fully masked and nothing becomes NaN.
        if isinstance(route, Unpadded) and not _jagged_state["on"]:
            route = None  # an earlier layer's unpadded attention failed
        if isinstance(route, Unpadded):
            try:
                return self._unpadded(x, route)
            except (RuntimeError, NotImplementedError) as e:  # this torch/GPU cannot: the masked kernel from now on
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                _jagged_state.update(on=False, why=f"unpadded attention failed: {type(e).__name__}")
                _log_once("jagged-failed", logging.WARNING, "attention: unpadded (jagged) SDPA failed (%s: %s); "
                          "padded batches run SDPA with the key mask from now on", type(e).__name__,
                          str(e).splitlines()[0] if str(e) else "")
                route = None
        B, T, H = x.shape
        # [B,T,3H] -> 3 x [B,nh,T,hd]
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, H // self.num_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout_p if self.training else 0.0
        mask = None if route == NO_PADDING else key_mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # [B,nh,T,hd]
        return self.out(y.transpose(1, 2).reshape(B, T, H))  # [B,T,H]

    def _unpadded(self, x: Tensor, u: Unpadded) -> Tensor:
        """Attention over the real tokens only, as jagged tensors (varlen flash/efficient kernels on CUDA)."""
        B, T, H = x.shape
        nh = self.num_heads
        real = x.reshape(B * T, H).index_select(0, u.rows)  # [N,H]
        qkv = self.qkv(real).view(-1, 3, nh, H // nh)  # [N,3,nh,hd]
        q, k, v = (torch.nested.nested_tensor_from_jagged(qkv[:, i].contiguous(), u.offsets, min_seqlen=u.min_len,
                                                          max_seqlen=u.max_len).transpose(1, 2)
                   for i in range(3))  # [B,nh,j,hd] each
        p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # [B,nh,j,hd]
        y = self.out(y.transpose(1, 2).values().reshape(-1, H))  # [N,H]
        return y.new_zeros(B * T, H).index_copy(0, u.rows, y).view(B, T, H)


class Block(nn.Module):
    """Post-LN BERT layer: x = LN(x + drop(attn(x))); x = LN(x + drop(ffn(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.hidden_size, cfg.ffn_size),
            _ACTIVATIONS[cfg.activation](),
            nn.Linear(cfg.ffn_size, cfg.hidden_size),
        )
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: Tensor, key_mask: Tensor, route: str | Unpadded | None = None) -> Tensor:  # [B,T,H]
        """Attention then feed-forward, each with a residual and post-LayerNorm (``route``: SelfAttention's)."""
        x = self.ln1(x + self.dropout(self.attn(x, key_mask) if route is None else self.attn(x, key_mask, route)))
        return self.ln2(x + self.dropout(self.ffn(x)))


class LexiconAdapter(nn.Module):
    """LEBERT lexicon adapter: each character attends over the words that contain it.

    v = W2 tanh(W1 e + b1) + b2 (e = word vector), a = softmax_w(h W_attn v_w^T) over real slots only,
    h' = LN(h + drop(sum_w a_w v_w)). A character with no words gets a = 0, z = 0, so h' = LN(h).
    Without autograd (evaluation, labelling) the same function is computed sparsely: v once per distinct word of
    the batch's real slots, scores and z only on the real slots (about a fifth of the slots in review text) and
    W_attn applied to the distinct words (h W v = h . (W v)); for the int8 seed-size classifier on 2,000 reviews
    the adapter took 0.29 s this way against 0.35-0.40 s dense (of about 4 s in all). Training runs the dense form.
    Set `record_attention = True` to keep the last weights a [B,T,W] in `last_attention`.
    With `word_rows` [U,Dw] given, `word_ids` index those rows instead of the table (sparse training of the table:
    the caller gathers the rows the batch touched, row 0 the [PAD] word, into a leaf tensor, so the gradient is
    those rows only; the values, and so the outputs, are the table's).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.word_vocab_size, cfg.word_dim, padding_idx=0)
        self.word_proj = nn.Sequential(nn.Linear(cfg.word_dim, H), nn.Tanh(), nn.Linear(H, H))
        self.attn_weight = nn.Parameter(torch.empty(H, H))  # bilinear W_attn
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.ln = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.record_attention = False
        self.last_attention: Tensor | None = None
        self.sparse_inference = True  # without autograd, the sparse form: real slots, distinct words (docstring)
        self.attn_keys: nn.Module | None = None  # sparse form: v -> v W_attn^T; models.rowwise sets a row-invariant one

    @torch.no_grad()
    def load_word_vectors(self, vectors: Tensor | np.ndarray, freeze: bool = False) -> None:
        """Copy a [word_vocab_size, word_dim] float matrix into the word table; optionally freeze it."""
        vectors = torch.as_tensor(vectors)
        if tuple(vectors.shape) != tuple(self.word_embeddings.weight.shape):
            want = tuple(self.word_embeddings.weight.shape)
            raise ValueError(f"word vectors have shape {tuple(vectors.shape)}, expected {want}")
        self.word_embeddings.weight.copy_(vectors)
        self.word_embeddings.weight.requires_grad_(not freeze)

    def forward(self, h: Tensor, word_ids: Tensor | None, word_mask: Tensor | None = None,
                word_rows: Tensor | None = None) -> Tensor:
        """Mix each character's matched word vectors into its hidden state (LEBERT's bilinear attention)."""
        # h [B,T,H]; word_ids [B,T,W] (0 = empty slot); word_mask [B,T,W] bool, default word_ids != 0;
        # word_rows [U,Dw]: the rows word_ids index (row 0 the [PAD] word), default the table
        if word_ids is None:  # no lexicon input: same as every slot empty
            return self.ln(h)
        mask = word_ids != 0 if word_mask is None else word_mask.bool()  # [B,T,W]
        if not torch.is_grad_enabled() and self.sparse_inference:
            return self._forward_sparse(h, word_ids, mask, word_rows)
        v = self.word_proj(self._lookup(word_ids, word_rows))  # [B,T,W,H], finite (tanh-bounded)
        scores = torch.einsum("bth,btwh->btw", h @ self.attn_weight, v)  # [B,T,W]
        # Safe masked softmax: a finite fill keeps all-empty rows NaN-free; the second fill makes
        # empty slots exactly 0 (and all-empty rows all 0 instead of uniform).
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)  # [B,T,W]
        if self.record_attention:
            self.last_attention = attn.detach()
        z = torch.einsum("btw,btwh->bth", attn, v)  # [B,T,H]
        return self.ln(h + self.dropout(z))

    def _lookup(self, ids: Tensor, word_rows: Tensor | None) -> Tensor:
        """Word vectors [..., Dw] of ``ids``: from the table, or from ``word_rows`` when given."""
        if word_rows is None:
            return self.word_embeddings(ids)
        return F.embedding(ids, word_rows, padding_idx=0)

    def _forward_sparse(self, h: Tensor, word_ids: Tensor, mask: Tensor, word_rows: Tensor | None = None) -> Tensor:
        """forward() touching only the M real slots: no [B,T,W,H] tensor is built (inference only). Slots are
        addressed by flat index into [B*T*W] (one gather or scatter each, not a two-index lookup)."""
        B, T, W = word_ids.shape
        H = h.shape[-1]
        at = mask.reshape(-1).nonzero().squeeze(1)  # [M] flat slot index, ascending (token-major)
        tok = torch.div(at, W, rounding_mode="floor")  # [M] token index into B*T
        attn = torch.zeros(B * T * W, dtype=h.dtype, device=h.device)  # [N*W], empty slots stay exactly 0
        if at.numel() == 0:  # no character has a word: z = 0
            if self.record_attention:
                self.last_attention = attn.view(B, T, W)
            return self.ln(h)
        uniq, inv = torch.unique(word_ids.reshape(-1).index_select(0, at), return_inverse=True)  # [U], [M]
        v = self.word_proj(self._lookup(uniq, word_rows))  # [U,H]: each distinct word projected once
        # h W v = h . (W v): W applied to the U distinct words, not to every character (U is ~1/3 of them)
        keys = v @ self.attn_weight.T if self.attn_keys is None else self.attn_keys(v)  # [U,H]
        s = (h.reshape(B * T, H).index_select(0, tok) * keys.index_select(0, inv)).sum(-1)  # [M] real slots' scores
        scores = torch.full((B * T * W,), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device)
        scores.index_copy_(0, at, s)
        probs = torch.softmax(scores.view(B * T, W), dim=-1).view(-1)  # softmax over each character's real slots
        attn.index_copy_(0, at, probs.index_select(0, at))
        if self.record_attention:
            self.last_attention = attn.view(B, T, W)
        weighted = (attn.index_select(0, at)[:, None] * v.index_select(0, inv)).to(h.dtype)  # [M,H]
        z = torch.zeros(B * T, H, dtype=h.dtype, device=h.device).index_add_(0, tok, weighted)  # [N,H]
        return self.ln(h + self.dropout(z.view(B, T, H)))  # [B,T,H]


class LebertEncoder(nn.Module):
    """Embeddings + post-LN blocks, with the lexicon adapter after block `adapter_layer` (1-based)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.adapter = LexiconAdapter(cfg) if cfg.use_adapter else None
        self.apply(lambda m: init_weights(m, cfg.initializer_range))

    def load_word_vectors(self, vectors: Tensor | np.ndarray, freeze: bool = False) -> None:
        """Copy a [word_vocab_size, word_dim] matrix into the adapter's word table; optionally freeze it."""
        if self.adapter is None:
            raise ValueError("this model has no lexicon adapter (use_adapter=False)")
        self.adapter.load_word_vectors(vectors, freeze)

    def forward(
        self,
        input_ids: Tensor,  # [B,T]
        segment_ids: Tensor | None = None,  # [B,T], default all 0
        attention_mask: Tensor | None = None,  # [B,T] bool or 0/1, default all real
        word_ids: Tensor | None = None,  # [B,T,W]; ignored without adapter
        word_mask: Tensor | None = None,  # [B,T,W] bool, default word_ids != 0
        use_layers: int | None = None,  # run only the first n blocks
        padded: bool | Unpadded | None = None,  # whether attention_mask holds padding (its real tokens), if known
        word_rows: Tensor | None = None,  # [U,Dw] rows that word_ids index instead of the word table
        position_ids: Tensor | None = None,  # [B,T], default 0..T-1 (a packed row: restarting per pair)
        pair_ids: Tensor | None = None,  # [B,T] a packed row's sequence of each token: attention only within it
    ) -> Tensor:  # [B,T,H]
        """Hidden states [B,T,H] after the first ``use_layers`` blocks, the adapter after its block. On CUDA,
        attention runs without a mask where the batch has no padding and unpadded where it has
        (:func:`attention_route`; ``padded`` from the caller, False or the :class:`Unpadded` real tokens found on
        the host, spares a device read; CUDA only). With ``pair_ids`` (packed rows, several sequences a row) a token
        attends only to the tokens of its own sequence: a block-diagonal boolean mask [B,1,T,T] through SDPA
        (attention dropout kept; padding is a group of its own, so no query row is empty), on every device."""
        n = self.cfg.num_layers if use_layers is None else use_layers
        if not 1 <= n <= self.cfg.num_layers:
            raise ValueError(f"use_layers {n} must be in 1..{self.cfg.num_layers}")
        if pair_ids is not None:  # block-diagonal: the masked kernel, whatever the device
            route = None
            key_mask = pair_ids[:, None, :, None] == pair_ids[:, None, None, :]  # [B,1,T,T]
        else:
            route = attention_route(attention_mask, padded, input_ids.device)  # None on CPU: the masked kernel
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
            key_mask = attention_mask.bool()[:, None, None, :]  # [B,1,1,T]
        x = self.embeddings(input_ids, segment_ids, position_ids)  # [B,T,H]
        for i, block in enumerate(self.blocks[:n], start=1):
            x = block(x, key_mask) if route is None else block(x, key_mask, route)
            if self.adapter is not None and i == self.cfg.adapter_layer:
                x = self.adapter(x, word_ids, word_mask, word_rows)
        return x

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding drops the lookup tables (token, segment, position, word)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        return n


class MLMHead(nn.Module):
    """Sparse masked-LM head: dense + act + LN + decoder, applied to the masked positions only."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.activation]()
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)  # own bias
        if cfg.tie_mlm_decoder:
            self.decoder.weight = token_embedding.weight  # same Parameter [V,H]

    def forward(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """MLM logits [N,V] at the masked positions only."""
        # hidden [B,T,H]; positions: LongTensor [N] of flat indices into B*T, or bool mask [B,T]
        # (row-major order, i.e. the order of mask.nonzero()). Returns logits [N,V], never [B,T,V].
        flat = hidden.reshape(-1, hidden.size(-1))  # [B*T,H]
        pos = positions.reshape(-1)
        x = flat[pos] if positions.dtype == torch.bool else flat.index_select(0, pos)
        return self.decoder(self.ln(self.act(self.dense(x))))  # [N,V]


class NSPHead(nn.Module):
    """Pooler (dense + tanh on [CLS]) then a 2-way classifier."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, 2)

    def forward(self, hidden: Tensor, cls_positions: Tensor | None = None) -> Tensor:  # [B,T,H] -> [B,2] / [P,2]
        """NSP logits [B,2] from the pooled [CLS] state of each row, or [P,2] from the states at ``cls_positions``
        [P] (flat indices into B*T: each packed pair's own [CLS])."""
        cls = hidden[:, 0] if cls_positions is None else hidden.reshape(-1, hidden.size(-1)).index_select(
            0, cls_positions)  # [B,H] or [P,H]
        return self.classifier(torch.tanh(self.pooler(cls)))


@dataclass
class PretrainingOutput:
    """What one pretraining forward returns: logits, and losses and hit counts when labels are given."""
    mlm_logits: Tensor  # [N,V]
    nsp_logits: Tensor  # [B,2]
    loss: Tensor | None = None  # mlm_loss (+ nsp_loss when nsp_labels are given)
    mlm_loss: Tensor | None = None
    nsp_loss: Tensor | None = None
    mlm_correct: Tensor | None = None  # 0-dim count of argmax hits among labels != -100
    nsp_correct: Tensor | None = None  # 0-dim count


class LebertForPretraining(nn.Module):
    """Encoder + sparse MLM head + NSP head; loss = mlm_loss + nsp_loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = LebertEncoder(cfg)
        self.mlm_head = MLMHead(cfg, self.encoder.embeddings.token)
        self.nsp_head = NSPHead(cfg)
        for head in (self.mlm_head, self.nsp_head):  # the encoder initialised itself
            for m in head.modules():
                if not (m is self.mlm_head.decoder and cfg.tie_mlm_decoder):
                    init_weights(m, cfg.initializer_range)
        if cfg.tie_mlm_decoder:
            nn.init.zeros_(self.mlm_head.decoder.bias)

    def load_word_vectors(self, vectors: Tensor | np.ndarray, freeze: bool = False) -> None:
        """Copy a [word_vocab_size, word_dim] matrix into the encoder's word table; optionally freeze it."""
        self.encoder.load_word_vectors(vectors, freeze)

    def forward(
        self,
        input_ids: Tensor,  # [B,T]
        segment_ids: Tensor | None,  # [B,T]
        attention_mask: Tensor | None,  # [B,T] bool or 0/1
        word_ids: Tensor | None,  # [B,T,W] or None
        mlm_positions: Tensor,  # [N] flat indices into B*T, or bool [B,T]
        mlm_labels: Tensor | None = None,  # [N], -100 = ignore
        nsp_labels: Tensor | None = None,  # [B]
        word_mask: Tensor | None = None,  # [B,T,W] bool
        padded: bool | Unpadded | None = None,  # as LebertEncoder.forward's (CUDA only)
        word_rows: Tensor | None = None,  # [U,Dw] rows that word_ids index instead of the word table (sparse)
        position_ids: Tensor | None = None,  # [B,T] packed rows: restarting per pair
        pair_ids: Tensor | None = None,  # [B,T] packed rows: each token's pair (attention within it)
        cls_positions: Tensor | None = None,  # [P] packed rows: flat indices of each pair's [CLS]; nsp_labels [P]
    ) -> PretrainingOutput:
        """Logits of both heads, plus losses and hit counts for the labels given (-100: ignored, as padding
        pairs and masked positions of a packed batch are). A packed batch (several pairs a row: ``pair_ids``,
        ``position_ids``, ``cls_positions``) gives the loss of the same pairs run one a row, to float tolerance."""
        hidden = self.encoder(input_ids, segment_ids, attention_mask, word_ids, word_mask, padded=padded,
                              word_rows=word_rows, position_ids=position_ids, pair_ids=pair_ids)  # [B,T,H]
        out = PretrainingOutput(mlm_logits=self.mlm_head(hidden, mlm_positions),
                                nsp_logits=self.nsp_head(hidden, cls_positions))
        if mlm_labels is not None:
            out.mlm_loss = F.cross_entropy(out.mlm_logits.float(), mlm_labels, ignore_index=-100)
            out.mlm_correct = ((out.mlm_logits.argmax(-1) == mlm_labels) & (mlm_labels != -100)).sum().detach()
            out.loss = out.mlm_loss
        if nsp_labels is not None:
            out.nsp_loss = F.cross_entropy(out.nsp_logits.float(), nsp_labels)
            out.nsp_correct = (out.nsp_logits.argmax(-1) == nsp_labels).sum().detach()
            out.loss = out.nsp_loss if out.loss is None else out.loss + out.nsp_loss
        return out

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (the tied decoder counts once); non_embedding drops the lookup tables
        and an untied decoder weight (it is an output embedding)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
            if not self.cfg.tie_mlm_decoder:
                n -= self.mlm_head.decoder.weight.numel()
        return n

    def flops_per_token(self, seq_len: int, mask_fraction: float = 0.15) -> float:
        """Training FLOPs (forward + backward) per input token, Kaplan-style:

            6*N + 12*L*H*T + 6*f*(H*V + H*H) + 12*W*H

        N = encoder non-embedding parameters that every token goes through (blocks, and the adapter with its
        word projection counted W times: it runs on each of a character's W word slots); 12*L*H*T = attention
        scores and weighted sums (QK^T and AV, 2*T*H multiply-adds each, x3 for backward); 6*f*(H*V + H*H) = the
        sparse MLM head, run on a fraction f of tokens only (decoder H*V, head dense H*H); 12*W*H = the adapter's
        scores and weighted sum over the W slots. The NSP head (one [CLS] per sequence) is ignored.
        Agrees with torch's FlopCounterMode within 5 % (tests/test_gpu_paths.py).
        """
        c = self.cfg
        n = self.encoder.num_params(non_embedding=True)
        adapter = 0.0
        if self.encoder.adapter is not None:
            proj = sum(p.numel() for p in self.encoder.adapter.word_proj.parameters())
            n += (c.max_word_num - 1) * proj
            adapter = 12 * c.max_word_num * c.hidden_size
        head = c.hidden_size * c.vocab_size + c.hidden_size**2
        return 6 * n + 12 * c.num_layers * c.hidden_size * seq_len + 6 * mask_fraction * head + adapter
