"""Sentence classifier on the LEBERT encoder: first k blocks -> masked mean–max pooling -> one logit or K.

    input_ids [B,T] -> LebertEncoder (blocks 1..use_layers) -> h [B,T,H]
    h -> [mean over real tokens, max over real tokens] [B,2H] -> dropout -> Linear(2H, 1 or K) -> logits [B] or [B,K]

Only the first ``use_layers`` blocks run (the tutorial: upper layers overfit small labelled sets);
the unused blocks stay in the state dict so a pretrained checkpoint loads unchanged. Note that the
lexicon adapter sits after block ``cfg.adapter_layer``: with ``use_layers < adapter_layer`` the
lexicon is never used. Padding never reaches the pooled vector, so extra pads do not change logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .bert import LebertEncoder, Unpadded, init_weights
from .config import ModelConfig


class LebertClassifier(nn.Module):
    """LEBERT encoder (first ``use_layers`` blocks), masked mean-max pooling and a linear head (module doc)."""
    def __init__(self, cfg: ModelConfig, use_layers: int = 3, dropout: float = 0.4, num_labels: int = 1):
        super().__init__()
        self.num_labels = int(num_labels)  # 1: one logit (binary, sigmoid); K > 2: K logits (softmax)
        self.cfg = cfg
        self.use_layers = max(1, min(int(use_layers), cfg.num_layers))  # clamp to 1..num_layers
        self.encoder = LebertEncoder(cfg)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * cfg.hidden_size, self.num_labels)
        init_weights(self.head, cfg.initializer_range)

    @property
    def uses_lexicon(self) -> bool:
        """Whether the lexicon adapter runs within the blocks used."""
        return self.cfg.adapter_within(self.use_layers)

    def forward(
        self,
        input_ids: Tensor,  # [B,T]
        attention_mask: Tensor | None = None,  # [B,T] bool or 0/1, True = real; default all real
        word_ids: Tensor | None = None,  # [B,T,W], 0 = empty slot
        padded: bool | Unpadded | None = None,  # whether attention_mask holds padding, if known (CUDA only)
    ) -> Tensor:  # logits [B] (one label), [B,K] (K labels)
        """Logits of each text: [B] for one label, [B,K] for K. ``padded``: as :meth:`LebertEncoder.forward`'s,
        from the caller's host copy of the batch (spares the device reads that route attention on CUDA)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        mask = attention_mask.bool()
        h = self.encoder(input_ids, None, mask, word_ids, None, use_layers=self.use_layers, padded=padded)  # [B,T,H]
        m = mask.unsqueeze(-1)  # [B,T,1]
        mean = (h * m).sum(1) / m.sum(1).clamp(min=1).to(h.dtype)  # [B,H]: sum over real / count real
        mx = h.masked_fill(~m, torch.finfo(h.dtype).min).amax(1)  # [B,H]: pads can never be the max
        pooled = torch.cat([mean, mx], dim=-1)  # [B,2H]
        z = self.head(self.dropout(pooled))  # [B,1] or [B,K]
        return z.squeeze(-1) if self.num_labels == 1 else z

    @torch.no_grad()
    def load_pretrained_encoder(self, state_dict: dict[str, Tensor]) -> None:
        """Load the ``encoder.*`` entries of a LebertForPretraining state dict (heads are ignored).

        Strict on the encoder: every encoder key must be present and no unknown ``encoder.*`` key
        may appear; shapes must match. Raises ValueError listing the offending keys."""
        prefix = "encoder."
        enc = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        want = self.encoder.state_dict()
        missing = sorted(set(want) - set(enc))
        unexpected = sorted(set(enc) - set(want))
        if not enc or missing or unexpected:
            raise ValueError(
                "pretrained state dict does not match the classifier's encoder: "
                f"{len(enc)} encoder.* keys found; missing {missing or '[]'}; unexpected {unexpected or '[]'}"
            )
        bad = [
            f"{k}: {tuple(enc[k].shape)} vs {tuple(want[k].shape)}"
            for k in want
            if tuple(enc[k].shape) != tuple(want[k].shape)
        ]
        if bad:
            raise ValueError(f"pretrained encoder shapes differ from the model config: {bad}")
        self.encoder.load_state_dict(enc, strict=True)
