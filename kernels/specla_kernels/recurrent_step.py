"""Triton kernel: one token of batch 1 through the gated delta rule, state updated in place, inside the one-token
step's programmatic dependent launch (PDL) chain.

Semantics of :func:`specla_kernels.reference.recurrent_gated_delta_rule_ref` for ``T = 1`` with the gates of
:func:`specla_kernels.reference.gdn_gate_beta_ref` (raw ``a``, ``b`` in; q and k l2-normalised inside), the
arithmetic of fla's ``fused_recurrent_gated_delta_rule_fwd_kernel`` (its ``exp``/``softplus``, its order of
operations, its launch shape: a program per ``[BV, K]`` slice of a head's state, one warp).

Why not fla's kernel, which the step used until now: it is launched normally, so it cannot start before the input
projection's GEMV has ended, and it never lets the next kernel start early, so the output projection's GEMV cannot
request its weights while the recurrence runs: two of each layer's five hand-overs outside the PDL chain. This one
allows its dependents first, then loads its state slice (3 MiB a layer, which no kernel of the step writes before
it), then waits for the input projection.
Why the early state read is safe: layer ``i``'s state is written only by this kernel of layer ``i`` (in place), by
the commit, and by prompt passes, and every one-token step begins with a normally launched kernel (the embedding
lookup), which starts only after everything before it in the stream has finished.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.op import exp
from fla.ops.utils.softplus import softplus

from specla_kernels import pdl


@triton.jit
def recurrent_step_kernel(q, k, v, a, b, A_log, dt_bias, o, state, scale, H: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    pid = tl.program_id(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_hv = pid % NV, pid // NV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_v[:, None] & m_k[None, :]
    p_h = state + i_hv.to(tl.int64) * K * V + o_v[:, None] * K + o_k[None, :]
    # before the wait: what no earlier kernel of the step writes (the state slice, the gate's parameters)
    b_h = tl.load(p_h, mask=m_h, other=0.)
    b_A = tl.load(A_log + i_hv).to(tl.float32)
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32) if HAS_DT_BIAS else 0.
    pdl.wait_for_inputs(PDL)
    b_q = tl.load(q + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v + i_hv * V + o_v, mask=m_v, other=0.).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_beta = tl.sigmoid(tl.load(b + i_hv).to(tl.float32)) * BETA_SCALE
    b_g = -exp(b_A) * softplus(tl.load(a + i_hv).to(tl.float32) + b_dt)
    b_h *= exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
    b_h += b_u[:, None] * b_k[None, :]
    tl.store(o + i_hv * V + o_v, tl.sum(b_h * b_q[None, :], 1).to(o.dtype.element_ty), mask=m_v)
    tl.store(p_h, b_h, mask=m_h)


def recurrent_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                    allow_neg_eigval: bool = False, scale: float | None = None) -> torch.Tensor:
    """One token: 1-D ``q, k [H*K]`` (raw), ``v [HV*V]``, raw gate inputs ``a, b [HV]`` (contiguous vectors or
    column slices of one projection row), ``state [1, HV, V, K]`` fp32 (V-first), updated in place. Returns
    ``o [HV*V]`` in ``v``'s dtype."""
    HV, V, K = state.shape[1:]
    H = q.numel() // K
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape[0] != 1:
        raise ValueError(f"the state must be a contiguous fp32 [1, HV, V, K] tensor, got {tuple(state.shape)} "
                         f"{state.dtype}")
    if k.numel() != H * K or v.numel() != HV * V or HV % H or a.numel() != HV or b.numel() != HV:
        raise ValueError(f"q {q.numel()}, k {k.numel()}, v {v.numel()}, a {a.numel()}, b {b.numel()} do not fit a "
                         f"state of {HV} value heads x {V} x {K}")
    o = v.new_empty(HV * V)
    BV = min(8, triton.next_power_of_2(V))          # fla's launch shape for this kernel
    recurrent_step_kernel[(triton.cdiv(V, BV) * HV,)](
        q, k, v, a, b, A_log, dt_bias if dt_bias is not None else A_log, o, state, K ** -0.5 if scale is None else scale,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, HAS_DT_BIAS=dt_bias is not None,
        BETA_SCALE=2.0 if allow_neg_eigval else 1.0, PDL=pdl.enabled(v.device), num_warps=1, num_stages=3,
        launch_pdl=pdl.enabled(v.device))
    return o
