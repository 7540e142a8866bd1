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


@triton.jit
def gate_beta_rows(a, b, A_log, dt_bias, g, beta, rows, m_rows, stride_a, stride_b, HV, BHV: tl.constexpr,
                   HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr):
    """``g, beta`` of the token ``rows`` (of the ``[B*T, HV]`` matrices; ``m_rows`` masks those past the end)."""
    o = tl.arange(0, BHV)
    m = m_rows[:, None] & (o < HV)[None, :]
    x = tl.load(a + rows[:, None] * stride_a + o[None, :], mask=m, other=0.).to(tl.float32)
    if HAS_DT_BIAS:
        x += tl.load(dt_bias + o, mask=o < HV, other=0.).to(tl.float32)[None, :]
    # softplus as torch computes it: x above 20, log(1 + e^x) below (written stably for very negative x)
    softplus = tl.where(x > 20., x, tl.maximum(x, 0.) + tl.log(1. + tl.exp(-tl.abs(x))))
    decay = -tl.exp(tl.load(A_log + o, mask=o < HV, other=0.).to(tl.float32))[None, :] * softplus
    strength = tl.sigmoid(tl.load(b + rows[:, None] * stride_b + o[None, :], mask=m, other=0.).to(tl.float32))
    tl.store(g + rows[:, None] * HV + o[None, :], decay, mask=m)
    tl.store(beta + rows[:, None] * HV + o[None, :], strength * BETA_SCALE, mask=m)


@triton.jit
def gate_beta_kernel(a, b, A_log, dt_bias, g, beta, stride_a, stride_b,
                     HV: tl.constexpr, BHV: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    gate_beta_rows(a, b, A_log, dt_bias, g, beta, rows, rows >= 0, stride_a, stride_b, HV, BHV, HAS_DT_BIAS,
                   BETA_SCALE)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [B, T, HV]`` with unit column stride, as rows of a [B*T, HV] matrix: (tensor, row stride)."""
    B, T, _ = x.shape
    if x.stride(-1) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1)


def gate_operands(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[tuple, dict, tuple[torch.Tensor, torch.Tensor]]:
    """What a launch computing ``g, beta`` of ``a, b [B, T, HV]`` takes: the pointer and stride arguments, the
    constexprs, and the outputs ``(g, beta)`` (fp32, allocated here). ``tree_conv`` reuses it."""
    B, T, HV = a.shape
    a, stride_a = _rows(a)
    b, stride_b = _rows(b)
    g = torch.empty(B, T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    args = (a, b, A_log, dt_bias if dt_bias is not None else A_log, g, beta, stride_a, stride_b)
    consts = dict(HV=HV, BHV=triton.next_power_of_2(HV), HAS_DT_BIAS=dt_bias is not None,
                  BETA_SCALE=2.0 if allow_neg_eigval else 1.0)
    return args, consts, (g, beta)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [B, T, HV]`` (any float dtype, unit column stride) -> ``g, beta [B, T, HV]`` fp32 (see module)."""
    B, T, _ = a.shape
    args, consts, out = gate_operands(a, b, A_log, dt_bias, allow_neg_eigval)
    gate_beta_kernel[(B * T,)](*args, **consts, num_warps=1)
    return out
