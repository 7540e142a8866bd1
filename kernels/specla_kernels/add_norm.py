"""Triton kernel: the residual add between two blocks and the RMSNorm after it, in one launch
(:func:`specla_kernels.reference.add_rms_norm_ref`).

A verify pass ends each block with ``h = residual + mlp_out`` and starts the next with ``attn_norm(h)``: two
kernels per layer in stock fla (fla's fused pre-norm add normalises the unrounded fp32 sum, so it is not the same
function). Here one program per token row adds, rounds the sum to the model dtype as the unfused add does, writes it
(the residual stream) and normalises the rounded sum as fla's RMSNorm does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x, delta, w, h, y, eps, D, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    s = tl.load(x + row * D + o, mask=m, other=0.).to(tl.float32) + tl.load(delta + row * D + o, mask=m,
                                                                             other=0.).to(tl.float32)
    s = s.to(h.dtype.element_ty)                   # the unfused add's rounding
    tl.store(h + row * D + o, s, mask=m)
    sf = s.to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
    tl.store(y + row * D + o, (sf * rstd * tl.load(w + o, mask=m).to(tl.float32)).to(y.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``add_rms_norm_ref``: ``x, delta [..., D]`` of one dtype -> ``(x + delta, rmsnorm(x + delta))``."""
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and delta {tuple(delta.shape)} {delta.dtype} must match")
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for {D} features")
    x, delta = x.contiguous(), delta.contiguous()
    h, y = torch.empty_like(x), torch.empty_like(x)
    BD = triton.next_power_of_2(D)
    add_rms_norm_kernel[(x.numel() // D,)](x, delta, weight, h, y, eps, D, BD=BD,
                                          num_warps=max(1, min(8, BD // 256)))
    return h, y
