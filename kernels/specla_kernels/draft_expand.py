"""Triton kernel: one depth of the drafter's tree expansion after its top-k (:func:`reference.expand_frontier_ref`).

Given each frontier node's ``K`` children (``row_topk`` of its draft log-probs, or draws from them) and their ranks
for the tree's selection, it records the ``F x K`` candidates (frontier score + rank, token, parent candidate),
picks the ``K`` of the best cumulative score (ties to the lower candidate) as the next frontier, and writes their
tree slots (token, parent node). In torch this is a dozen tiny kernels per
depth, each costing more in launch and dependency gaps than in work; here it is one program holding everything in
registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.topk import top_k_slots


@triton.jit
def expand_frontier_kernel(
    top_logp, top_rank, top_token, frontier_score, frontier_cand,   # inputs: [F, K] x 3, [F], [F]
    cand, cand_stride,                                              # output: rows (score, token, parent) of [3, ...]
    tokens, parents, next_score, next_cand,                         # outputs: tree slots n.., next frontier [K]
    n, F, cand_base,
    K: tl.constexpr,
    BC: tl.constexpr,                                               # >= F * K, power of two
    KP: tl.constexpr,                                               # >= K, power of two
):
    c = tl.arange(0, BC)                                            # candidate = frontier row * K + child rank
    m = c < F * K
    row = c // K
    base = tl.load(frontier_score + row, mask=m, other=0.).to(tl.float32)
    score = base + tl.load(top_logp + c, mask=m, other=float("-inf")).to(tl.float32)
    token = tl.load(top_token + c, mask=m, other=0)
    # fp32 sums, as the reference: with ranks at least the log-probs, a child never outranks its parent by rounding
    tl.store(cand + c, (base + tl.load(top_rank + c, mask=m, other=0.).to(tl.float32)).to(tl.float64), mask=m)
    tl.store(cand + cand_stride + c, token.to(tl.float64), mask=m)
    tl.store(cand + 2 * cand_stride + c, tl.load(frontier_cand + row, mask=m, other=-1).to(tl.float64), mask=m)
    # the K best candidates, best first, ties to the lower index (row_topk's selection), and their tokens
    best_score, best = top_k_slots(score, c.to(tl.int64), m, K, KP)
    best_token = tl.sum(tl.where(c[None, :] == best[:, None], token[None, :], 0), 1)
    slot = tl.arange(0, KP)
    m_k = slot < K
    tl.store(tokens + n + slot, best_token, mask=m_k)
    tl.store(parents + n + slot, n - F + best // K, mask=m_k)
    tl.store(next_score + slot, best_score, mask=m_k)
    tl.store(next_cand + slot, cand_base + best, mask=m_k)


def expand_frontier(top_logp: torch.Tensor, top_rank: torch.Tensor, top_token: torch.Tensor,
                    frontier_score: torch.Tensor, frontier_cand: torch.Tensor, cand: torch.Tensor,
                    tokens: torch.Tensor, parents: torch.Tensor, next_score: torch.Tensor, next_cand: torch.Tensor,
                    n: int, cand_base: int) -> None:
    """Triton twin of ``expand_frontier_ref`` (same arguments, same in-place writes)."""
    F, K = top_logp.shape
    if cand.shape[0] != 3 or cand.dtype != torch.float64 or cand.stride(-1) != 1:
        raise ValueError("cand must be the [3, >= F*K] float64 (score, token, parent) rows of one depth")
    if any(not t.is_contiguous() for t in (tokens, parents, next_score, next_cand)):
        raise ValueError("the tree slots and the next frontier must be contiguous")
    expand_frontier_kernel[(1,)](
        top_logp.contiguous(), top_rank.contiguous(), top_token.contiguous(), frontier_score.contiguous(),
        frontier_cand.contiguous(),
        cand, cand.stride(0), tokens, parents, next_score, next_cand, n, F, cand_base,
        K=K, BC=max(16, triton.next_power_of_2(F * K)), KP=max(16, triton.next_power_of_2(K)), num_warps=1,
    )
