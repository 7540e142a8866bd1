"""Triton code: a GDN layer's per-token decay and write strength from its projections.

Semantics of :func:`specla_kernels.reference.gdn_gate_beta_ref`: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
``beta = sigmoid(b)`` (times 2 with negative eigenvalues allowed), both fp32. In torch that is about ten elementwise
kernels per layer. A verify pass computes them in extra programs of the tree conv's launch
(``tree_conv.tree_conv_gates``), whose inputs come from the same projection GEMM; ``gdn_gate_beta`` is their own
launch, for layers without a short conv. ``a`` and ``b`` may be column slices of the fused input-projection GEMM
output: rows are read with their stride.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import pdl


@triton.jit
def gate_rows(a, b, A_log, dt_bias, g, beta, rows, m_rows, stride_a, stride_b,
              HV: tl.constexpr, BHV: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr,
              PDL: tl.constexpr):
    """``g`` and ``beta`` of token rows ``rows`` (``m_rows``: the real ones), every head; waits for the kernel before
    (``pdl.py``) after loading the weights, so a caller must not have waited already."""
    o = tl.arange(0, BHV)
    m = m_rows[:, None] & (o < HV)[None, :]
    b_A = tl.load(A_log + o, mask=o < HV, other=0.).to(tl.float32)[None, :]      # weights: before the wait
    if HAS_DT_BIAS:
        b_dt = tl.load(dt_bias + o, mask=o < HV, other=0.).to(tl.float32)[None, :]
    pdl.wait_for_inputs(PDL)
    r = rows.to(tl.int64)[:, None]
    x = tl.load(a + r * stride_a + o[None, :], mask=m, other=0.).to(tl.float32)
    if HAS_DT_BIAS:
        x += b_dt
    # softplus as torch computes it: x above 20, log1p(e^x) below, as max(x, 0) + log1p(e^-|x|); log1p(e) as
    # log(u) * e / (u - 1), u = 1 + e, which cancels the rounding of u (log(u) alone loses e's low bits when e is
    # small: 5e-4 relative at x = -8)
    e = tl.exp(-tl.abs(x))
    u = 1. + e
    log1p = tl.where(u == 1., e, tl.log(u) * (e / (u - 1.)))
    softplus = tl.where(x > 20., x, tl.maximum(x, 0.) + log1p)
    decay = -tl.exp(b_A) * softplus
    strength = tl.sigmoid(tl.load(b + r * stride_b + o[None, :], mask=m, other=0.).to(tl.float32)) * BETA_SCALE
    tl.store(g + r * HV + o[None, :], decay, mask=m)
    tl.store(beta + r * HV + o[None, :], strength, mask=m)


def token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [B, T, HV]`` with unit column stride, as rows of a [B*T, HV] matrix: (tensor, row stride)."""
    B, T, _ = x.shape
    if x.stride(-1) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1)


@triton.jit
def gate_beta_kernel(a, b, A_log, dt_bias, g, beta, R, stride_a, stride_b,
                     BR: tl.constexpr, HV: tl.constexpr, BHV: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    gate_rows(a, b, A_log, dt_bias, g, beta, rows, rows < R, stride_a, stride_b, HV, BHV, HAS_DT_BIAS, BETA_SCALE,
              PDL)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [B, T, HV]`` (any float dtype, unit column stride) -> ``g, beta [B, T, HV]`` fp32 (see module), in a
    launch of its own: for GDN layers without a short conv, whose tree nodes launch no ``tree_conv``."""
    B, T, HV = a.shape
    (a, stride_a), (b, stride_b) = token_rows(a), token_rows(b)
    g = torch.empty(B, T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    on = pdl.small_enabled(a.device)
    BR = min(16, triton.next_power_of_2(B * T))
    gate_beta_kernel[(triton.cdiv(B * T, BR),)](
        a, b, A_log, dt_bias if dt_bias is not None else A_log, g, beta, B * T, stride_a, stride_b,
        BR=BR, HV=HV, BHV=triton.next_power_of_2(HV), HAS_DT_BIAS=dt_bias is not None,
        BETA_SCALE=2.0 if allow_neg_eigval else 1.0, PDL=on, num_warps=1, launch_pdl=on)
    return g, beta
