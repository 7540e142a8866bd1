"""Triton kernels: the device loop's acceptance of a verified tree (``specla_hf.loop.acceptance``).

Semantics of :func:`specla_kernels.reference.accept_walk_ref` and :func:`specla_kernels.reference.drawn_hits_ref`.
As torch ops the acceptance is a few dozen tiny launches a step (the walk ~35, the rejection sampling of drawn
children ~15 a sibling rank, each a pass over ``[nodes, vocab]``), queued behind every verify pass.

- ``accept_walk``: one program holds the whole tree (at most 128 nodes): which nodes match, which are accepted (every
  ancestor matches), the deepest, its root path and the emitted tokens, from ``[N, N]`` comparisons in registers.
- ``drawn_hits``: one program per parent node walks its children in rank order, each a decision from two loaded
  probabilities and a residual update in two passes over the vocabulary (its mass, then the rows); a node without
  children returns at once. ``p`` is kept as a row and a scale (its residual is left unnormalised: what reads it, an
  exponential race, is invariant to scale), ``q`` as the draft row with the earlier siblings' tokens masked and the
  remaining mass. Masses are summed in fp64 across the row's blocks, as the reference sums them (where ``q`` is
  close to ``p`` the residual is a cancellation, and a sequential fp32 sum over 248K entries misses by more than a
  drawn token's mass).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 128
MAX_VOCAB = 16384     # ``drawn_hits`` above it: slower than torch on the H200 at 248K (one program streams a row)


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
def _pass(p_row, q_row, p_scale, q_scale, drawn, V, write_row, WRITE: tl.constexpr, BV: tl.constexpr):
    """One pass over a row: the residual ``max(p - q, 0)`` (``p = p_row * p_scale``, ``q = q_row * q_scale`` without
    the tokens in ``drawn``); returns its mass, and with ``WRITE`` stores it to ``write_row``."""
    total = tl.sum(tl.zeros([BV], dtype=tl.float64), 0)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        m = cols < V
        p = tl.load(p_row + cols, mask=m, other=0.) * p_scale
        q = tl.load(q_row + cols, mask=m, other=0.) * q_scale
        q = tl.where(tl.max((cols[:, None] == drawn[None, :]).to(tl.int32), 1) > 0, 0., q)
        rest = tl.maximum(p - q, 0.)
        total += tl.sum(rest, 0).to(tl.float64)
        if WRITE:
            tl.store(write_row + cols, rest, mask=m)
    if WRITE:
        # the next pass reads the row back in another layout (other threads): the writes must be visible
        tl.debug_barrier()
    return total


@triton.jit
def drawn_hits_kernel(tokens, parents, probs, draft, uniforms, hit, residual, N, V, s_p, s_q,
                      SIBLINGS: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr):
    u = tl.program_id(0)
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
    decided = tl.zeros([BN], dtype=tl.int32)
    if tl.sum(has.to(tl.int32), 0) > 0:
        p_row, q_row, out_row = probs + u.to(tl.int64) * s_p, draft + u.to(tl.int64) * s_q, residual + u.to(tl.int64) * V
        q_total = tl.sum(tl.zeros([BV], dtype=tl.float64), 0)
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            q_total += tl.sum(tl.load(q_row + cols, mask=cols < V, other=0.), 0).to(tl.float64)
        read_row, p_scale, q_mass = p_row, tl.sum(tl.zeros([BV], dtype=tl.float32), 0) + 1, q_total
        for r in tl.static_range(SIBLINGS):
            if tl.sum(tl.where(s == r, has.to(tl.int32), 0), 0) > 0:
                c = tl.sum(tl.where(s == r, kid, 0), 0)
                x = tl.sum(tl.where(s == r, kid_tok, 0), 0)
                drawn = tl.where(s < r, kid_tok, -1)                 # the earlier siblings' tokens
                if r == 0:                                      # q as given (the reference renormalises it
                    q_scale = p_scale * 0 + 1                   # only once a draw is removed)
                else:
                    q_scale = tl.where(q_mass > 0, 1 / q_mass, 0.).to(tl.float32)
                px = tl.load(read_row + x) * p_scale
                qx = tl.load(q_row + x) * q_scale
                qx = tl.where(tl.max((drawn == x).to(tl.int32), 0) > 0, 0., qx)
                hit_c = (qx > 0) & (tl.load(uniforms + c) * qx < px)
                decided = tl.where(i == c, hit_c.to(tl.int32), decided)
                total = _pass(read_row, q_row, p_scale, q_scale, drawn, V, out_row, False, BV)
                if total > 0:
                    _pass(read_row, q_row, p_scale, q_scale, drawn, V, out_row, True, BV)
                    read_row, p_scale = out_row, (1 / total).to(tl.float32)
                elif r == 0:                                    # nothing left: p itself goes on
                    for v0 in range(0, V, BV):
                        cols = v0 + tl.arange(0, BV)
                        tl.store(out_row + cols, tl.load(p_row + cols, mask=cols < V, other=0.), mask=cols < V)
                    tl.debug_barrier()
                    read_row = out_row
                # the next rank draws without this token: its mass leaves q
                first = tl.max((drawn == x).to(tl.int32), 0) == 0
                q_mass -= tl.where(first, tl.load(q_row + x), 0.).to(tl.float64)
    tl.store(hit + i, decided.to(tl.int8), mask=child)
    if tl.load(parents + u) < 0:
        tl.store(hit + u, 0)


def drawn_hits(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
               uniforms: torch.Tensor, siblings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``drawn_hits_ref`` in one launch (at most ``MAX_NODES`` nodes; ``probs``, ``draft_probs [N, V]`` fp32 with
    contiguous rows). The residual rows are proportional to the reference's and written only for nodes with
    children (the others' are undefined: a row without children is ``probs``'s)."""
    N, V = probs.shape
    if N > MAX_NODES:
        raise ValueError(f"the rejection kernel takes trees of at most {MAX_NODES} nodes, got {N}")
    if probs.dtype != torch.float32 or draft_probs.dtype != torch.float32:
        raise ValueError("the target's and the drafter's probabilities must be float32")
    hit = torch.empty(N, dtype=torch.int8, device=probs.device)
    residual = torch.empty(N, V, dtype=torch.float32, device=probs.device)
    drawn_hits_kernel[(N,)](tokens, parents, probs, draft_probs, uniforms, hit, residual, N, V, probs.stride(0),
                            draft_probs.stride(0), SIBLINGS=siblings, BN=max(16, triton.next_power_of_2(N)),
                            BS=max(16, triton.next_power_of_2(siblings)), BV=1024, num_warps=4)
    return hit.view(torch.bool), residual
