"""Triton kernels: a few queries (tree nodes, or one token) attending over a long, mostly unused KV buffer under an
additive mask, with grouped key/value heads: the full-attention layers of a hybrid target's verify pass and its MTP
head's draft depths; and that mask with the new tokens' positions, built in one launch (``attention_mask``, the
semantics of :func:`specla_kernels.reference.attention_mask_ref`), where its torch ops took ~12.

Semantics of :func:`specla_kernels.reference.masked_attention_ref`. Split-KV (flash decoding): the buffer's slots are
cut into ``splits`` ranges, one program per (range, key/value head, block of query rows), each keeping an online
softmax over its slots; a second kernel merges the ranges' partial results. The rows of a program are every query
head of its key/value head times every query, so the keys and values are read once per group. A tile of slots whose
mask entries are all at or below ``HIDDEN`` (-1e4) for every row is skipped without reading its keys or values: a
graphed cache is sized for the longest generation, and the slots past the committed prefix and the pending nodes are
hidden. cuDNN's SDPA kernel for such a call reads them all (H200, 16 nodes, 8 heads of 256, a 2048-slot buffer:
117-120 us a call). Qwen3.5's gated attention multiplies the output by the sigmoid of a gate: the kernel that writes
the output applies it (``gate``), which saves the two torch launches a call took for it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.reference import HIDDEN
from specla_kernels.tree_delta import INTERPRETED

_HIDDEN = tl.constexpr(HIDDEN)       # mask entries at or below it count as hidden
# the interpreter multiplies 16-bit tl.dot operands as their raw bits: widened there (the same, exact products)
_WIDEN_DOTS = tl.constexpr(INTERPRETED)

BLOCK_N = 64
MAX_BLOCK_M = 64


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` in fp32: 16-bit operands on tensor cores, fp32 ones in full precision when ``IEEE`` (an fp32 model
    must match the reference's fp32 attention, which TF32 would not)."""
    if _WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _output(o, gate, at, m, GATED: tl.constexpr, dtype: tl.constexpr):
    """The attention output ``o`` (fp32) rounded to ``dtype``, times the sigmoid of the gate at ``gate + at`` as
    torch's ops round it: the sigmoid rounded, then the product."""
    o = o.to(dtype)
    if GATED:
        g = tl.sigmoid(tl.load(gate + at, mask=m, other=0.).to(tl.float32)).to(dtype)
        o = (o.to(tl.float32) * g.to(tl.float32)).to(dtype)
    return o


@triton.jit
def masked_attention_split_kernel(
        q, k, v, mask, o_part, m_part, l_part, out, gate, scale,
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_t, sm_s, so_b, so_t, so_h, sg_b, sg_t, sg_h,
        T, S, HKV, ROWS, TILES_PER_SPLIT,
        G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, SINGLE: tl.constexpr, GATED: tl.constexpr):
    split, bh, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = bh // HKV, bh % HKV
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)            # row r: query head kv * G + r // T, query r % T
    in_rows = rows < ROWS
    head, t = kv * G + rows // T, rows % T
    d = tl.arange(0, DP)
    in_d = d < D
    qt = tl.load(q + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                 mask=in_rows[:, None] & in_d[None, :], other=0.)
    k_base, v_base = k + b * sk_b + kv * sk_h, v + b * sv_b + kv * sv_h
    m_base = mask + b * sm_b + t * sm_t
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    first = split * TILES_PER_SPLIT * BLOCK_N
    for start in range(first, tl.minimum(first + TILES_PER_SPLIT * BLOCK_N, S), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_n = n < S
        bias = tl.load(m_base[:, None] + n[None, :] * sm_s, mask=in_rows[:, None] & in_n[None, :],
                       other=float("-inf")).to(tl.float32)
        if tl.max(tl.max(bias, 1), 0) > _HIDDEN:
            kt = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=in_n[:, None] & in_d[None, :], other=0.)
            s = _dot(qt, tl.trans(kt), IEEE) * scale + bias
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            vt = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=in_n[:, None] & in_d[None, :], other=0.)
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
    if SINGLE:       # one range: normalise and write the output in place of a partial result
        o = acc / tl.where(l_i > 0, l_i, 1.)[:, None]
        m_out = in_rows[:, None] & in_d[None, :]
        o = _output(o, gate, b * sg_b + t[:, None] * sg_t + head[:, None] * sg_h + d[None, :], m_out, GATED,
                    out.dtype.element_ty)
        tl.store(out + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :], o, mask=m_out)
    else:
        part = (split * tl.num_programs(1) + bh) * ROWS + rows
        tl.store(o_part + part[:, None] * DP + d[None, :], acc, mask=in_rows[:, None])
        tl.store(m_part + part, m_i, mask=in_rows)
        tl.store(l_part + part, l_i, mask=in_rows)


@triton.jit
def masked_attention_merge_kernel(o_part, m_part, l_part, out, gate, so_b, so_t, so_h, sg_b, sg_t, sg_h, T, HKV, ROWS,
                                  SPLITS, BH, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                                  BLOCK_S: tl.constexpr, GATED: tl.constexpr):
    bh, r = tl.program_id(0), tl.program_id(1)
    b, kv = bh // HKV, bh % HKV
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, DP)
    part = (sp * BH + bh) * ROWS + r
    m_s = tl.load(m_part + part, mask=sp < SPLITS, other=-1e30)
    l_s = tl.load(l_part + part, mask=sp < SPLITS, other=0.)
    w = tl.exp(m_s - tl.max(m_s, 0))
    total = tl.sum(l_s * w, 0)
    o = tl.sum(tl.load(o_part + part[:, None] * DP + d[None, :], mask=(sp < SPLITS)[:, None], other=0.)
               * w[:, None], 0) / tl.where(total > 0, total, 1.)
    head, t = kv * G + r // T, r % T
    o = _output(o, gate, b * sg_b + t * sg_t + head * sg_h + d, d < D, GATED, out.dtype.element_ty)
    tl.store(out + b * so_b + t * so_t + head * so_h + d, o, mask=d < D)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     splits: int | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``masked_attention_ref`` (same arguments; ``splits``: slot ranges, default enough programs to
    fill the device). Output ``[B, T, H, D]`` in ``q``'s dtype."""
    B, H, T, D = q.shape
    HKV, S = k.shape[1], k.shape[2]
    G = H // HKV
    rows = G * T
    BLOCK_M = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(rows)))
    row_blocks = triton.cdiv(rows, BLOCK_M)
    tiles = triton.cdiv(S, BLOCK_N)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, sms // (B * HKV * row_blocks))
    per_split = triton.cdiv(tiles, min(splits, tiles))
    splits = triton.cdiv(tiles, per_split)
    DP = triton.next_power_of_2(D)
    out = q.new_empty(B, T, H, D)
    if gate is not None and (gate.shape != out.shape or gate.stride(-1) != 1):
        raise ValueError(f"masked_attention: the output gate must be [B, T, H, D] = {list(out.shape)} with unit-stride "
                         f"rows, got {list(gate.shape)} with strides {gate.stride()}")
    g = gate if gate is not None else out
    single = splits == 1
    if single:
        o_part = m_part = l_part = out            # unused
    else:
        o_part = torch.empty(splits * B * HKV * rows, DP, dtype=torch.float32, device=q.device)
        m_part = torch.empty(splits * B * HKV * rows, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    masked_attention_split_kernel[(splits, B * HKV, row_blocks)](
        q, k, v, mask, o_part, m_part, l_part, out, g, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), mask.stride(0), mask.stride(2), mask.stride(3), out.stride(0), out.stride(1), out.stride(2),
        g.stride(0), g.stride(1), g.stride(2), T, S, HKV, rows, per_split, G=G, D=D, DP=DP, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, SINGLE=single, GATED=gate is not None,
        num_warps=4 if DP <= 128 else 8, num_stages=2)
    if not single:
        masked_attention_merge_kernel[(B * HKV, rows)](
            o_part, m_part, l_part, out, g, out.stride(0), out.stride(1), out.stride(2), g.stride(0), g.stride(1),
            g.stride(2), T, HKV, rows, splits, B * HKV, G=G, D=D, DP=DP, BLOCK_S=triton.next_power_of_2(splits),
            GATED=gate is not None, num_warps=4)
    return out


MASK_BLOCK = 1024


@triton.jit
def attention_mask_kernel(length, anc, mask, positions, T, N, CAP, sa_b, sa_t, sa_n, hidden,
                          TREE: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b * T + t, slot block): token ``t``'s mask entries over a block of slots; block 0 also its position."""
    bt, blk = tl.program_id(0), tl.program_id(1)
    b, t = bt // T, bt % T
    start = tl.load(length + b)
    slots = blk * BLOCK + tl.arange(0, BLOCK)
    row = anc + b * sa_b + t * sa_t                 # the node's ancestor row (tree nodes)
    if TREE:
        pending = slots - start
        idx = tl.minimum(tl.maximum(pending, 0), N - 1)
        among = tl.load(row + idx * sa_n, mask=slots < CAP, other=0)
        seen = (pending < 0) | ((among != 0) & (pending < N))
    else:
        seen = slots <= start + t
    tl.store(mask + bt * CAP + slots, tl.where(seen, 0., hidden).to(mask.dtype.element_ty), mask=slots < CAP)
    if blk == 0:
        if TREE:
            n = tl.arange(0, NP)
            depth = tl.sum(tl.load(row + n * sa_n, mask=n < N, other=0).to(tl.int64), 0) - 1
        else:
            depth = t.to(tl.int64)
        tl.store(positions + bt, start + depth)


def attention_mask(length: torch.Tensor, ancestors: torch.Tensor | None, T: int, capacity: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``attention_mask_ref`` (same arguments and outputs)."""
    B = length.shape[0]
    mask = torch.empty(B, 1, T, capacity, dtype=dtype, device=length.device)
    positions = torch.empty(B, T, dtype=torch.long, device=length.device)
    if not mask.numel():
        return mask, positions
    if ancestors is None:
        anc, N, strides = length, 1, (0, 0, 0)                      # unread without a tree
    else:
        anc, N = ancestors.view(torch.uint8), ancestors.shape[-1]
        strides = anc.stride()
    attention_mask_kernel[(B * T, triton.cdiv(capacity, MASK_BLOCK))](
        length, anc, mask, positions, T, N, capacity, *strides, torch.finfo(dtype).min,
        TREE=ancestors is not None, NP=triton.next_power_of_2(N), BLOCK=MASK_BLOCK, num_warps=4)
    return mask, positions
