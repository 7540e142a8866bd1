"""Triton kernel: the ``k`` largest entries of each row, for small ``k`` (the drafter's expansion at every depth).

Semantics of :func:`specla_kernels.reference.row_topk_ref`: values in descending order, ties to the lower index
(``torch.sort(x, descending=True, stable=True)`` cut to ``k``). ``torch.topk`` over a 16k vocabulary runs a
multi-pass radix select (~34 us for 4 rows on the H200: ~0.2 ms of every draft proposal); for ``k <= 16`` two small
passes do it. Pass 1: one program per ``BLOCK`` columns of a row keeps that slice's top ``k`` by ``k`` rounds of
(max, lowest index holding it, retire it), all in registers. Pass 2: one program per row does the same over the
slices' candidates, whose original indices break ties. A row that fits one slice needs pass 1 only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# larger than any index: loses every tie, marks an empty slot (a constexpr: compiled kernels may read no other global)
NO_INDEX = tl.constexpr(2 ** 62)


@triton.jit
def top_k_slots(vals, idx, alive, K: tl.constexpr, KP: tl.constexpr):
    """The top ``K`` of the ``alive`` entries of ``vals`` (ties: lower ``idx``) as ``[KP]`` values and indices."""
    slot = tl.arange(0, KP)
    out_v = tl.full([KP], float("-inf"), tl.float32)
    out_i = tl.full([KP], NO_INDEX, tl.int64)
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, vals, float("-inf")), 0)
        pick = tl.min(tl.where(alive & (vals == best), idx, NO_INDEX), 0)
        out_v = tl.where(slot == j, best, out_v)
        out_i = tl.where(slot == j, pick, out_i)
        alive = alive & (idx != pick)
    return out_v, out_i


@triton.jit
def row_topk_slices_kernel(x, cand_v, cand_i, V, stride_row, NB, K: tl.constexpr, KP: tl.constexpr,
                           BLOCK: tl.constexpr):
    i_s, i_r = tl.program_id(0), tl.program_id(1)
    cols = i_s * BLOCK + tl.arange(0, BLOCK)
    alive = cols < V
    vals = tl.load(x + i_r.to(tl.int64) * stride_row + cols, mask=alive, other=float("-inf")).to(tl.float32)
    out_v, out_i = top_k_slots(vals, cols.to(tl.int64), alive, K, KP)
    slot = (i_r.to(tl.int64) * NB + i_s) * KP + tl.arange(0, KP)
    tl.store(cand_v + slot, out_v)
    tl.store(cand_i + slot, out_i)


@triton.jit
def row_topk_merge_kernel(cand_v, cand_i, values, indices, C, K: tl.constexpr, KP: tl.constexpr,
                          BC: tl.constexpr):
    i_r = tl.program_id(0)
    j = tl.arange(0, BC)
    m = j < C
    vals = tl.load(cand_v + i_r.to(tl.int64) * C + j, mask=m, other=float("-inf"))
    idx = tl.load(cand_i + i_r.to(tl.int64) * C + j, mask=m, other=NO_INDEX)
    out_v, out_i = top_k_slots(vals, idx, m & (idx != NO_INDEX), K, KP)
    slot = i_r.to(tl.int64) * KP + tl.arange(0, KP)
    tl.store(values + slot, out_v)
    tl.store(indices + slot, out_i)


def row_topk(x: torch.Tensor, k: int, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, V]`` -> the ``k`` largest entries of each row, ``values [R, k]`` (x's dtype) and ``indices [R, k]``
    (int64), sorted descending, ties to the lower index. ``block``: columns per pass-1 program (tuning)."""
    if x.dim() != 2:
        raise ValueError(f"row_topk takes [rows, columns], got shape {tuple(x.shape)}")
    R, V = x.shape
    if not 1 <= k <= min(V, 16):
        raise ValueError(f"row_topk needs 1 <= k <= min(columns, 16), got k={k} for {V} columns")
    x = x if x.stride(-1) == 1 else x.contiguous()
    KP = triton.next_power_of_2(k)
    BLOCK = min(block, max(16, triton.next_power_of_2(V)))
    NB = triton.cdiv(V, BLOCK)
    cand_v = torch.empty(R, NB, KP, dtype=torch.float32, device=x.device)
    cand_i = torch.empty(R, NB, KP, dtype=torch.int64, device=x.device)
    row_topk_slices_kernel[(NB, R)](x, cand_v, cand_i, V, x.stride(0), NB, K=k, KP=KP, BLOCK=BLOCK,
                                    num_warps=4 if BLOCK >= 512 else 1)
    if NB == 1:
        return cand_v[:, 0, :k].to(x.dtype), cand_i[:, 0, :k]
    values = torch.empty(R, KP, dtype=torch.float32, device=x.device)
    indices = torch.empty(R, KP, dtype=torch.int64, device=x.device)
    C = NB * KP
    row_topk_merge_kernel[(R,)](cand_v, cand_i, values, indices, C, K=k, KP=KP,
                                BC=max(16, triton.next_power_of_2(C)), num_warps=1 if C <= 256 else 4)
    return values[:, :k].to(x.dtype), indices[:, :k]
