"""A bigram model of a token corpus, compact enough to ship inside a drafter checkpoint: for every token its ``topk``
most frequent successors with their smoothed log-probabilities, and one floor log-probability for the others.

The DART drafter (``specla_hf.drafters.dart``) drafts every depth from one pass, each depth's distribution blind to the
tokens drafted before it; the bigram couples consecutive tree levels ("n-gram-enforced continuity"). It is built
from the text the drafter is trained on (``bigram_table``) and read on the device in static shapes
(``bigram_logp``), so a tree's construction stays inside the drafter's CUDA graphs.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def bigram_table(rows: Iterable[torch.Tensor], vocab_size: int, topk: int = 16,
                 smoothing: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(next [V, topk] int32, logp [V, topk] fp32, floor [V] fp32)`` from token ``rows`` (1-D each, counted within
    a row only). With ``c(a, b)`` the bigram counts and ``α = smoothing``,
    ``P(b | a) = (c(a, b) + α) / (c(a) + α V)``; ``next[a]`` holds the ``topk`` most frequent successors of ``a``
    (-1 pads the rest; ties: smaller id first), ``logp`` their log-probabilities and ``floor[a]`` that of an unseen
    successor (``log α / (c(a) + α V)``; a seen successor outside the top ``topk`` is scored as unseen too). A token
    never followed by anything gets the uniform ``log 1/V`` and no entries."""
    if vocab_size < 1 or topk < 1 or smoothing <= 0:
        raise ValueError(f"bigram_table needs vocab_size >= 1, topk >= 1 and smoothing > 0; got {vocab_size}, "
                         f"{topk}, {smoothing}")
    V = vocab_size
    rows = [r.long() for r in rows if r.numel() > 1]
    if any(bool((r < 0).any() or (r >= V).any()) for r in rows):
        raise ValueError(f"token ids must lie in [0, {V})")
    ids = torch.cat([r[:-1] * V + r[1:] for r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    pair, count = torch.unique(ids, return_counts=True)              # sorted by (a, b)
    a, b = pair // V, pair % V
    # within each a, by count descending, ties by b: a stable sort by count of the (a, b)-sorted pairs, then by a
    order = torch.sort(count, descending=True, stable=True).indices
    order = order[torch.sort(a[order], stable=True).indices]
    a, b, count = a[order], b[order], count[order]
    total = torch.zeros(V, dtype=torch.float64).index_add_(0, a, count.double())
    first = torch.searchsorted(a, torch.arange(V))                   # each a's first pair in the sorted order
    rank = torch.arange(a.numel()) - first[a]
    keep = rank < topk
    denom = total + smoothing * V
    nxt = torch.full((V, topk), -1, dtype=torch.int32)
    logp = torch.zeros(V, topk, dtype=torch.float32)
    nxt[a[keep], rank[keep]] = b[keep].int()
    logp[a[keep], rank[keep]] = torch.log((count[keep].double() + smoothing) / denom[a[keep]]).float()
    floor = torch.log(smoothing / denom).float()
    return nxt, logp, floor


def bigram_logp(nxt: torch.Tensor, logp: torch.Tensor, floor: torch.Tensor, prev: torch.Tensor,
                cand: torch.Tensor) -> torch.Tensor:
    """``log P(cand[m] | prev[f])`` as ``[F, M]`` from a ``bigram_table``, in static shapes (no host sync)."""
    rows, lps = nxt[prev].long(), logp[prev]                         # [F, topk]
    hit = rows[:, None, :] == cand[None, :, None]                    # [F, M, topk]: at most one hit per (f, m)
    return torch.where(hit.any(-1), (lps[:, None, :] * hit).sum(-1), floor[prev][:, None])
