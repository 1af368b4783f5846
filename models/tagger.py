"""Character tagger (NER) on the LEBERT encoder: per-token softmax, or a linear-chain CRF on top.

    input_ids [B,T] -> LebertEncoder (blocks 1..use_layers, lexicon adapter if cfg.use_adapter)
    -> h [B,T,H] -> dropout -> Linear(H, num_tags) -> emissions [B,T,N]
    softmax: cross-entropy per real character;  CRF: nll of the tag path over real characters

``tag_mask`` [B,T] marks the positions that carry a tag (the characters; not [CLS], [SEP] or
padding). It may have holes anywhere: the tagged positions are packed to the left (in order)
before the CRF, so the CRF always sees a prefix mask. Both losses are means per tagged character
(the CRF's summed path nll is divided by the number of tagged characters in the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bert import LebertEncoder, Unpadded, init_weights
from .classifier import LebertClassifier
from .config import ModelConfig
from .crf import CRF


def pack_left(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move the masked positions of x [B,T,...] to the front, keeping their order.
    Returns (packed [B,T,...], prefix mask [B,T])."""
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.int32), dim=1, stable=True)  # [B,T]: real positions first
    idx = order.view(*order.shape, *([1] * (x.dim() - 2))).expand_as(x)
    n = mask.sum(1, keepdim=True)  # [B,1]
    return x.gather(1, idx), torch.arange(x.size(1), device=x.device)[None] < n


class LebertTagger(nn.Module):
    """LEBERT encoder, a linear emission head and optionally a CRF (module doc)."""
    def __init__(
        self,
        cfg: ModelConfig,
        num_tags: int,
        use_layers: int | None = None,
        dropout: float = 0.1,
        use_crf: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.num_tags = num_tags
        self.use_layers = cfg.num_layers if use_layers is None else max(1, min(int(use_layers), cfg.num_layers))
        self.use_crf = use_crf
        self.encoder = LebertEncoder(cfg)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(cfg.hidden_size, num_tags)
        init_weights(self.head, cfg.initializer_range)
        self.crf = CRF(num_tags) if use_crf else None

    @property
    def uses_lexicon(self) -> bool:
        """Whether the lexicon adapter runs within the blocks used."""
        return self.cfg.adapter_within(self.use_layers)

    def forward(
        self,
        input_ids: Tensor,  # [B,T]
        attention_mask: Tensor | None = None,  # [B,T] True/1 = real token; default all real
        word_ids: Tensor | None = None,  # [B,T,W], 0 = empty slot; None = no lexicon input
        padded: bool | Unpadded | None = None,  # whether attention_mask holds padding, if known (CUDA only)
    ) -> Tensor:  # emissions [B,T,N]
        """Emission scores [B,T,N] of every position. ``padded``: as :meth:`LebertEncoder.forward`'s, from the
        caller's host copy of the batch (spares the device reads that route attention on CUDA)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        h = self.encoder(input_ids, None, attention_mask.bool(), word_ids, None, use_layers=self.use_layers,
                         padded=padded)  # [B,T,H]
        return self.head(self.dropout(h))

    def loss(
        self, input_ids: Tensor, attention_mask: Tensor, word_ids: Tensor | None, tags: Tensor, tag_mask: Tensor,
        padded: bool | Unpadded | None = None,
    ) -> Tensor:
        """Mean loss per tagged character (0-dim). tags [B,T] (any value outside tag_mask), tag_mask [B,T];
        ``padded`` as :meth:`forward`'s."""
        em = self(input_ids, attention_mask, word_ids, padded).float()  # [B,T,N]
        tag_mask = tag_mask.bool()
        if self.crf is None:
            labels = tags.masked_fill(~tag_mask, -100)  # [B,T]; -100 = ignored
            return F.cross_entropy(em.reshape(-1, self.num_tags), labels.reshape(-1), ignore_index=-100)
        em_p, m = pack_left(em, tag_mask)  # [B,T,N], prefix mask [B,T]
        tags_p, _ = pack_left(tags, tag_mask)  # [B,T]
        return self.crf.nll(em_p, tags_p, m, prefix=True).sum() / m.sum().clamp(min=1)  # pack_left: a prefix mask

    @torch.no_grad()
    def decode(
        self, input_ids: Tensor, attention_mask: Tensor, word_ids: Tensor | None, tag_mask: Tensor,
        padded: bool | Unpadded | None = None,
    ) -> list[list[int]]:
        """Best tag ids per sequence, one per tagged position (len = tag_mask[b].sum()); ``padded`` as
        :meth:`forward`'s."""
        em = self(input_ids, attention_mask, word_ids, padded).float()  # [B,T,N]
        em_p, m = pack_left(em, tag_mask)
        if self.crf is not None:
            return self.crf.decode(em_p, m)
        best = em_p.argmax(-1).tolist()  # [B,T]
        return [row[:n] for row, n in zip(best, m.sum(1).tolist())]

    load_pretrained_encoder = LebertClassifier.load_pretrained_encoder  # same strict encoder.* loading
