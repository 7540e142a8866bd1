"""Triton kernel: a GDN layer's per-token decay and write strength from its projections, in one launch.

Semantics of :func:`specla_kernels.reference.gdn_gate_beta_ref`: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
``beta = sigmoid(b)`` (times 2 with negative eigenvalues allowed), both fp32. In torch that is about ten elementwise
kernels per layer; a verify pass of a 21-layer model spends more on launching them than on the tree itself. ``a`` and
``b`` may be column slices of the fused input-projection GEMM output: rows are read with their stride.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import pdl


@triton.jit
def gate_beta_kernel(a, b, A_log, dt_bias, g, beta, stride_a, stride_b,
                     HV: tl.constexpr, BHV: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BHV)
    m = o < HV
    b_A = tl.load(A_log + o, mask=m, other=0.).to(tl.float32)           # weights: before the wait (pdl.py)
    if HAS_DT_BIAS:
        b_dt = tl.load(dt_bias + o, mask=m, other=0.).to(tl.float32)
    pdl.wait_for_inputs(PDL)
    x = tl.load(a + row * stride_a + o, mask=m, other=0.).to(tl.float32)
    if HAS_DT_BIAS:
        x += b_dt
    # softplus as torch computes it: x above 20, log(1 + e^x) below (written stably for very negative x)
    softplus = tl.where(x > 20., x, tl.maximum(x, 0.) + tl.log(1. + tl.exp(-tl.abs(x))))
    decay = -tl.exp(b_A) * softplus
    strength = tl.sigmoid(tl.load(b + row * stride_b + o, mask=m, other=0.).to(tl.float32)) * BETA_SCALE
    tl.store(g + row * HV + o, decay, mask=m)
    tl.store(beta + row * HV + o, strength, mask=m)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [B, T, HV]`` with unit column stride, as rows of a [B*T, HV] matrix: (tensor, row stride)."""
    B, T, _ = x.shape
    if x.stride(-1) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [B, T, HV]`` (any float dtype, unit column stride) -> ``g, beta [B, T, HV]`` fp32 (see module)."""
    B, T, HV = a.shape
    a, stride_a = _rows(a)
    b, stride_b = _rows(b)
    g = torch.empty(B, T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    on = pdl.small_enabled(a.device)
    gate_beta_kernel[(B * T,)](a, b, A_log, dt_bias if dt_bias is not None else A_log, g, beta, stride_a, stride_b,
                               HV=HV, BHV=triton.next_power_of_2(HV), HAS_DT_BIAS=dt_bias is not None,
                               BETA_SCALE=2.0 if allow_neg_eigval else 1.0, PDL=on, num_warps=1, launch_pdl=on)
    return g, beta
