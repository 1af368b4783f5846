"""Linear-chain CRF: negative log-likelihood by the forward algorithm, Viterbi decoding.

Shapes: B batch, T steps, N tags. ``mask`` [B,T] must be a prefix mask (the real steps of each
sequence come first; a sequence may be empty). Score of a path y over a sequence of length n:

    s(y) = start[y_0] + sum_{t<n} E[t, y_t] + sum_{1<=t<n} trans[y_{t-1}, y_t] + end[y_{n-1}]

``nll = logsumexp_y s(y) - s(gold)``, computed in float32 log space, vectorised over the batch
and over states (one [B,N,N] logsumexp per step). An empty sequence has nll 0 and decodes to [].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class CRF(nn.Module):
    """Linear-chain CRF over N tags: transition, start and end scores (module doc)."""
    def __init__(self, num_tags: int):
        super().__init__()
        self.num_tags = num_tags
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))  # [N,N] from row to column
        self.start = nn.Parameter(torch.empty(num_tags))  # [N]
        self.end = nn.Parameter(torch.empty(num_tags))  # [N]
        for p in (self.transitions, self.start, self.end):
            nn.init.uniform_(p, -0.1, 0.1)

    def _check(self, emissions: Tensor, mask: Tensor, prefix: bool = False) -> Tensor:
        if emissions.dim() != 3 or emissions.size(-1) != self.num_tags:
            raise ValueError(f"emissions must be [B,T,{self.num_tags}], got {tuple(emissions.shape)}")
        mask = mask.bool()
        # reading the mask's values waits for the device: skipped for a mask that is a prefix mask by construction
        if not prefix and mask.size(1) > 1 and (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError("mask must be a prefix mask (real steps first)")
        return mask

    def score(self, emissions: Tensor, tags: Tensor, mask: Tensor, prefix: bool = False) -> Tensor:
        """Path score s(tags) [B]; tags outside the mask are ignored (may be -100). ``prefix``: the caller built
        ``mask`` as a prefix mask (not checked then, so nothing is read from the device)."""
        mask = self._check(emissions, mask, prefix)
        em = emissions.float()
        B, T, _ = em.shape
        y = tags.clamp(min=0)  # [B,T]
        m = mask.float()
        lengths = mask.sum(1)  # [B]
        s = (em.gather(2, y.unsqueeze(-1)).squeeze(-1) * m).sum(1)  # emissions along the path
        s = s + self.start[y[:, 0]] * m[:, 0]
        if T > 1:
            s = s + (self.transitions[y[:, :-1], y[:, 1:]] * m[:, 1:]).sum(1)
        last = y.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # [B]
        return s + self.end[last] * (lengths > 0).float()

    def log_partition(self, emissions: Tensor, mask: Tensor, prefix: bool = False) -> Tensor:
        """log Z [B] by the forward algorithm (``prefix`` as :meth:`score`'s)."""
        mask = self._check(emissions, mask, prefix)
        em = emissions.float()
        alpha = self.start + em[:, 0]  # [B,N]
        for t in range(1, em.size(1)):
            nxt = torch.logsumexp(alpha.unsqueeze(2) + self.transitions, dim=1) + em[:, t]  # [B,N]
            alpha = torch.where(mask[:, t : t + 1], nxt, alpha)
        logz = torch.logsumexp(alpha + self.end, dim=1)
        return torch.where(mask.any(1), logz, torch.zeros_like(logz))

    def nll(self, emissions: Tensor, tags: Tensor, mask: Tensor, prefix: bool = False) -> Tensor:
        """Negative log-likelihood of the gold tags [B] (emissions [B,T,N], tags [B,T], mask [B,T]; ``prefix``
        as :meth:`score`'s)."""
        mask = self._check(emissions, mask, prefix)  # once, not in both halves
        return self.log_partition(emissions, mask, True) - self.score(emissions, tags, mask, True)

    @torch.no_grad()
    def decode(self, emissions: Tensor, mask: Tensor) -> list[list[int]]:
        """Viterbi: the best path per sequence, of length mask[b].sum(). Ties go to the lowest tag."""
        mask = self._check(emissions, mask)
        em = emissions.float()
        B, T, N = em.shape
        if T == 0:
            return [[] for _ in range(B)]
        score = self.start + em[:, 0]  # [B,N]
        back = []
        for t in range(1, T):
            best, idx = (score.unsqueeze(2) + self.transitions).max(dim=1)  # [B,N] over the previous tag
            back.append(idx)
            score = torch.where(mask[:, t : t + 1], best + em[:, t], score)
        score = score + self.end
        lengths = mask.sum(1).tolist()
        last = score.argmax(1).tolist()
        back_np = torch.stack(back, 1).cpu().numpy() if back else None  # [B,T-1,N]
        out = []
        for b in range(B):
            n = lengths[b]
            if n == 0:
                out.append([])
                continue
            path = [last[b]]
            for t in range(n - 1, 0, -1):
                path.append(int(back_np[b, t - 1, path[-1]]))
            out.append(path[::-1])
        return out
