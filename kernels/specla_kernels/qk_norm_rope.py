"""Triton kernel: tokens of a Qwen3.5 gated attention layer from their projections to the attention (batch 1).

Semantics of :func:`specla_kernels.reference.qk_norm_rope_append_ref`: per token, query head and key head, the RMSNorm
over the head (fp32 scale ``1 + w``, rounded to the model dtype as the module rounds), the rotary embedding of its
first ``R`` dims, and for key heads the key and value written to the KV buffers after the committed length (read on
the device). The module's own ops take ~30 launches for this (two norms of six ops each, the rotary's slices,
negation and concatenations, the cache scatter); a decode step or a verify pass is bound by its launches. One program
per head and token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def qk_norm_rope_append_kernel(qkv, q_out, q_w, k_w, eps, cos, sin, key_buf, value_buf, length, first, stride_token,
                               stride_rotary, stride_head, stride_slot, H, KV, D: tl.constexpr, R: tl.constexpr,
                               DP: tl.constexpr):
    pid, t = tl.program_id(0), tl.program_id(1)
    qkv += t * stride_token
    cos += t * stride_rotary
    sin += t * stride_rotary
    d = tl.arange(0, DP)
    m = d < D
    is_key = pid >= H
    head = tl.where(is_key, pid - H, pid)
    # a query head's D values start its 2D (query, gate) block; key heads follow all query blocks
    base = tl.where(is_key, 2 * H * D + head * D, pid * 2 * D)
    x = tl.load(qkv + base + d, mask=m, other=0.).to(tl.float32)
    # rotate_half's partner of dim d < R: -y[d + R/2] below R/2, y[d - R/2] above (reloaded: a register permutation
    # is not expressible)
    rot = d < R
    partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
    xp = tl.load(qkv + base + partner, mask=rot, other=0.).to(tl.float32)
    if is_key:
        w = tl.load(k_w + d, mask=m, other=0.)
        wp = tl.load(k_w + partner, mask=rot, other=0.)
    else:
        w = tl.load(q_w + d, mask=m, other=0.)
        wp = tl.load(q_w + partner, mask=rot, other=0.)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * rstd * w).to(qkv.dtype.element_ty).to(tl.float32)
    yp = (xp * rstd * wp).to(qkv.dtype.element_ty).to(tl.float32)
    c = tl.load(cos + d, mask=rot, other=1.).to(tl.float32)
    s = tl.load(sin + d, mask=rot, other=0.).to(tl.float32)
    out = tl.where(rot, y * c + tl.where(d < R // 2, -yp, yp) * s, y).to(qkv.dtype.element_ty)
    if is_key:
        slot = tl.load(length).to(tl.int64) + first + t
        dst = head * stride_head + slot * stride_slot + d
        tl.store(key_buf + dst, out, mask=m)
        v = tl.load(qkv + 2 * H * D + KV * D + head * D + d, mask=m)
        tl.store(value_buf + dst, v, mask=m)
    else:
        tl.store(q_out + (t * H + head) * D + d, out, mask=m)


def qk_norm_rope_append(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                        length: torch.Tensor, num_heads: int, first: int = 0) -> torch.Tensor:
    """Triton twin of ``qk_norm_rope_append_ref`` (same arguments)."""
    KV, D = key_buffer.shape[1], key_buffer.shape[3]
    qkv = qkv.view(-1, qkv.shape[-1])
    T, R = qkv.shape[0], cos.shape[-1]
    cos, sin = cos.reshape(-1, R).contiguous(), sin.reshape(-1, R).contiguous()
    if (key_buffer.shape[0] != 1 or key_buffer.stride(3) != 1 or R % 2 or R > D or qkv.stride(1) != 1
            or cos.shape[0] not in (1, T)):
        raise ValueError(f"one sequence, contiguous heads, an even rotary width <= {D} and one rotary row or one per "
                         f"token expected; got buffers {tuple(key_buffer.shape)}, {T} tokens and rotary "
                         f"{tuple(cos.shape)}")
    q = qkv.new_empty(T, num_heads, D)
    qk_norm_rope_append_kernel[(num_heads + KV, T)](
        qkv, q, q_weight, k_weight, eps, cos, sin, key_buffer, value_buffer, length, first, qkv.stride(0),
        cos.stride(0) if cos.shape[0] > 1 else 0, key_buffer.stride(1), key_buffer.stride(2), num_heads, KV, D=D, R=R,
        DP=triton.next_power_of_2(D), num_warps=2 if D <= 256 else 4)
    return q
