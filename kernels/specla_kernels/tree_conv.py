"""Triton kernel: the depthwise short convolution over a token tree (:func:`specla_kernels.reference.tree_conv_ref`).

Node ``i`` convolves its own raw input with those of its ``W-1`` nearest ancestors; where the path leaves the tree
at distance ``s``, it reads column ``W - s + depth(i)`` of the committed window (fla layout ``[B, D, W]``, newest
last), exactly what a plain sequence would have seen. Each program owns a block of nodes of one tree for a slice of
channels and walks the parent pointers ``W-1`` steps, so no ancestor table is built and any node count works.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import gate, pdl


@triton.jit(do_not_specialize=["N", "T"])
def tree_conv_kernel(
    x, weight, bias, window, parents, y, x_out,
    a, b, A_log, dt_bias, g, beta,
    N, D, stride_xt, T, stride_a, stride_b,
    W: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    COPY_X: tl.constexpr,
    GATES: tl.constexpr,                 # the last program along axis 0 computes the gates of the last T nodes
    HV: tl.constexpr,
    BHV: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BETA_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.allow_dependents(PDL)
    i_d, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GATES:
        if i_d == tl.num_programs(0) - 1:
            t = i_n * BN + tl.arange(0, BN)
            gate.gate_rows(a, b, A_log, dt_bias, g, beta, i_b * T + t, t < T, stride_a, stride_b,
                           HV, BHV, HAS_DT_BIAS, BETA_SCALE, PDL)
            return
    rows = i_n * BN + tl.arange(0, BN)
    m_n = rows < N
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    m_nd = m_n[:, None] & m_d[None, :]
    p_win = window + (i_b * D + o_d[None, :]).to(tl.int64) * W

    b_y = tl.zeros([BN, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    pdl.wait_for_inputs(PDL)                       # x comes from the kernel before (pdl.py)
    cur = tl.where(m_n, rows, -1)                  # the node `s` steps above each node, -1 once off the tree
    depth = tl.zeros([BN], dtype=tl.int32)         # steps that stayed inside the tree so far
    for s in tl.static_range(W):
        if s > 0:
            cur = tl.load(parents + i_b * N + cur, mask=cur >= 0, other=-1).to(tl.int32)
        inside = cur >= 0
        from_tree = tl.load(x + (i_b * N + cur[:, None]).to(tl.int64) * stride_xt + o_d[None, :],
                            mask=m_nd & inside[:, None], other=0.)
        if COPY_X and s == 0:            # the nodes' own inputs: a contiguous copy for the commit's factors
            tl.store(x_out + (i_b * N + rows[:, None]).to(tl.int64) * D + o_d[None, :], from_tree, mask=m_nd)
        # the committed window stores W inputs, newest last; distance s past the root is column W - s + depth
        from_win = tl.load(p_win + (W - s + depth)[:, None], mask=m_nd & (~inside)[:, None], other=0.)
        b_x = tl.where(inside[:, None], from_tree, from_win.to(x.dtype.element_ty)).to(tl.float32)
        b_w = tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.).to(tl.float32)
        b_y += b_x * b_w[None, :]
        if s > 0:
            depth += inside.to(tl.int32)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + (i_b * N + rows[:, None]).to(tl.int64) * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_nd)


def tree_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    parents: torch.Tensor,
    activation: str | None = 'silu',
    x_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``tree_conv_ref``: ``x [B,N,D]`` raw inputs, ``weight [D,W]``, ``window [B,D,W]``,
    ``parents [B,N]``; returns ``[B,N,D]`` in the dtype of x. ``x`` may be a column slice of a wider tensor (tokens
    evenly spaced, channels contiguous: the runner's fused projection output), read in place; ``x_out`` (contiguous
    ``[B,N,D]``), if given, receives a contiguous copy of ``x`` on the way (the raw inputs the commit needs)."""
    return _launch(x, weight, bias, window, parents, activation, x_out, None)[0]


def tree_conv_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    parents: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    allow_neg_eigval: bool = False,
    activation: str | None = 'silu',
    x_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree_conv`` and, in the same launch, ``gdn_gate_beta_ref`` of the gate inputs ``a, b [B,T,HV]`` of the last
    ``T`` of the ``N`` nodes (column slices read in place): ``(y, g, beta)``, ``g`` and ``beta`` fp32 ``[B,T,HV]``."""
    return _launch(x, weight, bias, window, parents, activation, x_out, (a, b, A_log, dt_bias, allow_neg_eigval))


def _launch(x, weight, bias, window, parents, activation, x_out, gates):
    B, N, D = x.shape
    W = weight.shape[-1]
    if activation not in (None, 'silu', 'swish'):
        raise ValueError(f"unsupported activation {activation!r}")
    if x_out is not None and (x_out.shape != x.shape or x_out.dtype != x.dtype or not x_out.is_contiguous()):
        raise ValueError("x_out must be a contiguous tensor of x's shape and dtype")
    if not (x.stride(-1) == 1 and (B == 1 or x.stride(0) == N * x.stride(1))):
        x = x.contiguous()
    BN = min(64, triton.next_power_of_2(N))
    BD = max(16, min(triton.next_power_of_2(D), 1024 // BN))
    y = x.new_empty(B, N, D)
    if gates is None:
        a = b = A_log = dt_bias = g = beta = y
        T, HV, stride_a, stride_b, beta_scale = N, 1, 0, 0, 1.0
    else:
        a, b, A_log, dt_bias, allow_neg_eigval = gates
        T, HV = a.shape[1:]
        if a.shape != (B, T, HV) or b.shape != a.shape or T > N:
            raise ValueError(f"gate inputs a {tuple(a.shape)} and b {tuple(b.shape)} must both be [B, T, heads] "
                             f"for the last T of the {N} nodes")
        (a, stride_a), (b, stride_b) = gate.token_rows(a), gate.token_rows(b)
        g = torch.empty(B, T, HV, dtype=torch.float32, device=x.device)
        beta = torch.empty_like(g)
        beta_scale = 2.0 if allow_neg_eigval else 1.0
    on = pdl.small_enabled(x.device)
    grid = (triton.cdiv(D, BD) + (gates is not None), triton.cdiv(N, BN), B)
    tree_conv_kernel[grid](
        x, weight.contiguous(), bias if bias is not None else x, window.contiguous(), parents.contiguous(),
        y, x_out if x_out is not None else y,
        a, b, A_log, dt_bias if dt_bias is not None else A_log, g, beta,
        N, D, x.stride(1) if N > 1 else x.stride(0), T, stride_a, stride_b,
        W=W, BN=BN, BD=BD, HAS_BIAS=bias is not None, SILU=activation is not None, COPY_X=x_out is not None,
        GATES=gates is not None, HV=HV, BHV=triton.next_power_of_2(HV), HAS_DT_BIAS=dt_bias is not None,
        BETA_SCALE=beta_scale, PDL=on, num_warps=4, launch_pdl=on,
    )
    return y, (None if gates is None else g), (None if gates is None else beta)
