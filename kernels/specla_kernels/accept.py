"""Triton kernels: the device loop's acceptance of a verified tree (``specla_hf.loop.acceptance``).

Semantics of :func:`specla_kernels.reference.accept_walk_ref` and :func:`specla_kernels.reference.drawn_hits_ref`.
As torch ops the acceptance is a few dozen tiny launches a step (the walk ~35, the rejection sampling of drawn
children ~15 a sibling rank, each a pass over ``[nodes, vocab]``), queued behind every verify pass.

- ``accept_walk``: one program holds the whole tree (at most 128 nodes): which nodes match, which are accepted (every
  ancestor matches), the deepest, its root path and the emitted tokens, from ``[N, N]`` comparisons in registers.
- ``drawn_hits``: one launch per sibling rank over ``[parents, vocabulary blocks]``, so a 248K row is spread over
  ~120 programs. A rank's residual needs the mass of the one before it, which only a whole row gives, so no row is
  written between ranks: each launch replays the earlier ranks' rejections elementwise from ``p``, ``q`` and the
  per-block masses the earlier launches stored, decides its own rank where its token lies, and stores its blocks'
  masses; a last launch writes the rows. ``p`` is kept as a row and a scale (the residual is left unnormalised: what
  reads it, an exponential race, is invariant to scale), ``q`` as the draft row with the earlier siblings' tokens
  zeroed and its remaining mass. Masses are summed in fp64, as the reference sums them (where ``q`` is close to
  ``p`` the residual is a cancellation, and an fp32 sum over 248K entries misses by more than a drawn token's
  mass).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 128


@triton.jit
def accept_walk_kernel(tokens, parents, ancestors, s_a0, s_a1, argmax, hit, out, N, cap,
                       GREEDY: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    i = tl.arange(0, BN)
    valid = i < N
    tok = tl.load(tokens + i, mask=valid, other=-1)
    par = tl.load(parents + i, mask=valid, other=-2)
    both = valid[:, None] & valid[None, :]
    # [i, s]: s is an earlier sibling of i
    earlier = both & (par[:, None] == par[None, :]) & (i[None, :] < i[:, None])
    if GREEDY:
        choice = tl.load(argmax + tl.maximum(par, 0), mask=valid, other=-1)
        twin = tl.max((earlier & (tok[:, None] == tok[None, :])).to(tl.int32), 1) > 0
        fits = (tok == choice) & ~twin
    else:
        h = tl.load(hit + i, mask=valid, other=0) != 0
        fits = h & ~(tl.max((earlier & h[None, :]).to(tl.int32), 1) > 0)
    match = tl.where(par >= 0, fits, i == 0)
    anc = tl.load(ancestors + i[:, None] * s_a0 + i[None, :] * s_a1, mask=both, other=0) != 0
    accepted = valid & (tl.max((anc & ~match[None, :]).to(tl.int32), 1) == 0)
    depth = tl.sum(anc.to(tl.int32), 1)
    node = tl.argmax(tl.where(accepted, depth, 0), 0, tie_break_left=True)
    length = tl.sum(tl.where(i == node, depth, 0), 0)
    on_path = tl.max((anc & (i == node)[:, None]).to(tl.int32), 0) > 0        # row ``node`` of the mask
    k = tl.arange(0, BC)
    # path[k]: the path node at depth k + 1; after[k]: at depth k + 2 (the node emitted draft k comes from)
    at_k = on_path[None, :] & (depth[None, :] - 1 == k[:, None])
    path = tl.where(tl.max(at_k.to(tl.int32), 1) > 0, tl.sum(tl.where(at_k, i[None, :], 0), 1), node)
    at_next = on_path[None, :] & (depth[None, :] - 2 == k[:, None])
    after = tl.sum(tl.where(at_next, i[None, :], 0), 1)
    drafted = k + 1 < length
    if GREEDY:
        bonus = tl.load(argmax + node)
    else:
        bonus = -1
    emitted = tl.where(drafted, tl.load(tokens + after, mask=drafted & (k < cap), other=0), bonus)
    tl.store(out, length.to(tl.int64))
    tl.store(out + 1 + k, emitted.to(tl.int64), mask=k < cap)
    tl.store(out + 1 + cap + k, path.to(tl.int64), mask=k < cap)
    tl.store(out + 1 + 2 * cap, node.to(tl.int64))


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, cap: int,
                argmax: torch.Tensor | None = None, hit: torch.Tensor | None = None) -> torch.Tensor:
    """``accept_walk_ref`` in one launch (at most ``MAX_NODES`` nodes; ``tokens``, ``parents``, ``argmax``, ``hit``
    contiguous)."""
    N = tokens.shape[0]
    if N > MAX_NODES:
        raise ValueError(f"the walk kernel takes trees of at most {MAX_NODES} nodes, got {N}")
    if (argmax is None) == (hit is None):
        raise ValueError("give either argmax (greedy) or hit (sampling)")
    out = torch.empty(2 + 2 * cap, dtype=torch.long, device=tokens.device)
    greedy = argmax is not None
    if not greedy and hit.dtype == torch.bool:
        hit = hit.view(torch.int8)
    if ancestors.dtype == torch.bool:
        ancestors = ancestors.view(torch.int8)
    accept_walk_kernel[(1,)](tokens, parents, ancestors, ancestors.stride(0), ancestors.stride(1),
                             argmax if greedy else tokens, tokens if greedy else hit, out, N, cap, GREEDY=greedy,
                             BN=max(16, triton.next_power_of_2(N)), BC=max(16, triton.next_power_of_2(cap)),
                             num_warps=4)
    return out


@triton.jit
def _q_scale(k, q_mass):
    """Rank ``k``'s scale of ``q``: rank 0 takes it as given (the reference renormalises it only once a draw is
    removed), a later one renormalises what the earlier draws left (nothing left: zero)."""
    return tl.where(k == 0, 1., tl.where(q_mass > 0, 1 / q_mass, 0.)).to(tl.float32)


@triton.jit(do_not_specialize=["R"])     # one compiled kernel for every rank (a 1 would be specialised apart)
def drawn_rank_kernel(tokens, parents, probs, draft, uniforms, hit, residual, partial, q_partial, N, V, C, R,
                      s_p, s_q, SIBLINGS: tl.constexpr, FINAL: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                      BV: tl.constexpr, BC: tl.constexpr):
    """Program ``(u, c)``: parent ``u``'s row over block ``c`` of the vocabulary. It replays the rejections of ranks
    ``< R`` elementwise from ``p``, ``q`` and the masses the earlier launches summed, then decides rank ``R``'s child
    (the block holding its token) and stores its block's residual mass; ``FINAL`` stores the residual after every
    rank instead."""
    u = tl.program_id(0)
    c = tl.program_id(1)
    i = tl.arange(0, BN)
    valid = i < N
    par = tl.load(parents + i, mask=valid, other=-2)
    child = valid & (par == u)
    rank = tl.cumsum(child.to(tl.int32), 0) - 1
    s = tl.arange(0, BS)
    # the children's nodes and tokens by rank (-1: no child of that rank)
    of_rank = child[None, :] & (rank[None, :] == s[:, None]) & (s < SIBLINGS)[:, None]
    has = tl.max(of_rank.to(tl.int32), 1) > 0
    kid = tl.where(has, tl.sum(tl.where(of_rank, i[None, :], 0), 1), 0)
    kid_tok = tl.where(has, tl.load(tokens + kid, mask=has, other=0), -1)
    n_kids = tl.sum(has.to(tl.int32), 0)
    if FINAL:
        steps = n_kids
        go = n_kids > 0
    else:
        steps = R
        go = n_kids > R
    if go:
        cols = c * BV + tl.arange(0, BV)
        m = cols < V
        cur = tl.load(probs + u.to(tl.int64) * s_p + cols, mask=m, other=0.)
        q = tl.load(draft + u.to(tl.int64) * s_q + cols, mask=m, other=0.)
        b = tl.arange(0, BC)
        q_mass = tl.sum(tl.load(q_partial + u * C + b, mask=(b < C) & (steps > 0), other=0.), 0)
        p_scale = tl.sum(tl.zeros([BV], dtype=tl.float32), 0) + 1
        for k in range(steps):
            x = tl.sum(tl.where(s == k, kid_tok, 0), 0)
            q_scale = _q_scale(k, q_mass)
            total = tl.sum(tl.load(partial + (u * SIBLINGS + k) * C + b, mask=b < C, other=0.), 0)
            # a rejection that leaves nothing (``q == p`` up to rounding) leaves ``p`` as it was
            cur = tl.where(total > 0, tl.maximum(cur * p_scale - q * q_scale, 0.), cur)
            p_scale = tl.where(total > 0, (1 / total).to(tl.float32), p_scale)
            # the next rank draws without this token: its mass leaves q (once, for a repeated token)
            first = tl.max((tl.where(s < k, kid_tok, -1) == x).to(tl.int32), 0) == 0
            q_mass -= tl.where(first, tl.load(draft + u.to(tl.int64) * s_q + x), 0.).to(tl.float64)
            q = tl.where(cols == x, 0., q)
        if FINAL:
            tl.store(residual + u.to(tl.int64) * V + cols, cur, mask=m)
        else:
            q_scale = _q_scale(R, q_mass)
            rest = tl.maximum(cur * p_scale - q * q_scale, 0.)
            tl.store(partial + (u * SIBLINGS + R) * C + c, tl.sum(rest.to(tl.float64), 0))
            if R == 0:
                tl.store(q_partial + u * C + c, tl.sum(q.to(tl.float64), 0))
            x = tl.sum(tl.where(s == R, kid_tok, 0), 0)
            if (x >= c * BV) & (x < c * BV + BV):
                px = tl.sum(tl.where(cols == x, cur, 0.), 0) * p_scale
                qx = tl.sum(tl.where(cols == x, q, 0.), 0) * q_scale
                node = tl.sum(tl.where(s == R, kid, 0), 0)
                tl.store(hit + node, ((qx > 0) & (tl.load(uniforms + node) * qx < px)).to(tl.int8))


def drawn_hits(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
               uniforms: torch.Tensor, siblings: int, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``drawn_hits_ref`` in ``siblings + 1`` launches of ``[N, vocab / block]`` programs, one a sibling rank and
    one for the residual rows (at most ``MAX_NODES`` nodes; ``probs``, ``draft_probs [N, V]`` fp32 with contiguous
    rows). Each block's residual mass is stored in fp64 and later launches add a parent's blocks in a fixed order, so
    the sums do not depend on scheduling. The residual rows are proportional to the reference's and written
    only for nodes with children (the others' are undefined: a row without children is ``probs``'s)."""
    N, V = probs.shape
    if N > MAX_NODES:
        raise ValueError(f"the rejection kernel takes trees of at most {MAX_NODES} nodes, got {N}")
    if probs.dtype != torch.float32 or draft_probs.dtype != torch.float32:
        raise ValueError("the target's and the drafter's probabilities must be float32")
    if draft_probs.shape != probs.shape or tokens.shape != (N,) or parents.shape != (N,) or uniforms.shape != (N,):
        raise ValueError(f"drawn_hits needs probs and draft_probs of one shape [nodes, vocab] and tokens, parents, "
                         f"uniforms of [nodes]; got {list(probs.shape)}, {list(draft_probs.shape)}, "
                         f"{list(tokens.shape)}, {list(parents.shape)}, {list(uniforms.shape)}")
    C = triton.cdiv(V, block)
    hit = torch.zeros(N, dtype=torch.int8, device=probs.device)
    residual = torch.empty(N, V, dtype=torch.float32, device=probs.device)
    partial = torch.empty(N, siblings, C, dtype=torch.float64, device=probs.device)
    q_partial = torch.empty(N, C, dtype=torch.float64, device=probs.device)
    for rank in range(siblings + 1):
        drawn_rank_kernel[(N, C)](tokens, parents, probs, draft_probs, uniforms, hit, residual, partial, q_partial,
                                  N, V, C, rank, probs.stride(0), draft_probs.stride(0), SIBLINGS=siblings,
                                  FINAL=rank == siblings, BN=max(16, triton.next_power_of_2(N)),
                                  BS=max(16, triton.next_power_of_2(siblings)), BV=block,
                                  BC=max(16, triton.next_power_of_2(C)), num_warps=4)
    return hit.view(torch.bool), residual
