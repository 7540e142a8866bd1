"""Triton kernel: the GatedDeltaNet output norm, ``rmsnorm(x) * w (+ b) * act(g)``
(:func:`specla_kernels.reference.rms_norm_gated_ref`, fla's ``FusedRMSNormGated``), with the gate read in place.

In a verify pass the gate ``g`` is a column slice of the fused input projection (``[T, HV, V]`` heads of rows that
are ``proj_rows`` apart); fla's gated norm makes its inputs contiguous first, one copy kernel per layer. This kernel
takes the slice's token stride instead. One program per (token, head) row, as fla's row kernel, same operation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import pdl


@triton.jit
def rms_norm_gated_kernel(x, g, w, b, y, eps, stride_gt, HV, D: tl.constexpr, BD: tl.constexpr,
                          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SWISH: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    i_r = tl.program_id(0).to(tl.int64)              # row = token * HV + head
    i_t, i_h = i_r // HV, i_r % HV
    o = tl.arange(0, BD)
    m = o < D
    if HAS_WEIGHT:                                   # weights: before the wait (pdl.py)
        b_w = tl.load(w + o, mask=m).to(tl.float32)
    if HAS_BIAS:
        b_b = tl.load(b + o, mask=m).to(tl.float32)
    pdl.wait_for_inputs(PDL)
    b_x = tl.load(x + i_r * D + o, mask=m, other=0.).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_y = b_x * b_rstd
    if HAS_WEIGHT:
        b_y = b_y * b_w
    if HAS_BIAS:
        b_y = b_y + b_b
    b_g = tl.load(g + i_t * stride_gt + i_h * D + o, mask=m, other=0.).to(tl.float32)
    if SWISH:
        b_y = b_y * b_g * tl.sigmoid(b_g)
    else:
        b_y = b_y * tl.sigmoid(b_g)
    tl.store(y + i_r * D + o, b_y.to(y.dtype.element_ty), mask=m)


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, activation: str = "swish") -> torch.Tensor:
    """Triton twin of ``rms_norm_gated_ref`` for ``x``, ``g`` ``[B, T, H, D]``: ``g`` may be a column slice of a
    wider tensor (each token's heads contiguous, tokens evenly spaced), read in place. Returns ``x``'s dtype."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"unsupported gate activation {activation!r}")
    B, T, H, D = x.shape
    if g.shape != x.shape:
        raise ValueError(f"gate shape {tuple(g.shape)} differs from the input's {tuple(x.shape)}")
    x = x.contiguous()
    if not (g.stride(-1) == 1 and g.stride(-2) == D and (B == 1 or T == 1 or g.stride(0) == T * g.stride(1))):
        g = g.contiguous()
    y = torch.empty_like(x)
    stride_gt = g.stride(0) if T == 1 else g.stride(1)
    on = pdl.small_enabled(x.device)
    rms_norm_gated_kernel[(B * T * H,)](
        x, g, weight if weight is not None else x, bias if bias is not None else x, y, eps, stride_gt, H,
        D=D, BD=triton.next_power_of_2(D), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        SWISH=activation != "sigmoid", PDL=on, num_warps=4 if D >= 512 else 1, launch_pdl=on,
    )
    return y
