"""Pure-PyTorch chunked (WY/UT) gated delta rule with autograd: the training path where fla's backward is refused.

Same semantics as ``reference.recurrent_gated_delta_rule_ref``. Within a chunk of ``C`` tokens starting from state
``S`` (V-first, ``[V, K]``), with ``Γ`` the in-chunk cumulative log-decay, the values written to the state solve

    (I + L) U = β ⊙ V − (β e^Γ ⊙ K̂) Sᵀ,        L_ij = β_i e^{Γ_i − Γ_j} (k̂_i · k̂_j)  for j < i,

so with ``W = (I + L)⁻¹ (β e^Γ ⊙ K̂)`` and ``Ũ = (I + L)⁻¹ (β ⊙ V)`` (both independent of ``S``):

    U = Ũ − W Sᵀ,    O = (e^Γ ⊙ Q̂) Sᵀ + (Q̂ K̂ᵀ ⊙ e^{Γ_i − Γ_j} [j ≤ i]) U,    S' = e^{Γ_C} S + Uᵀ (e^{Γ_C − Γ} ⊙ K̂).

Everything but the last three lines runs for all chunks at once; the loop over chunks is three batched matmuls each,
which keeps the function cheap to trace with ``torch.compile`` (fixed shapes, no data-dependent control flow).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specla_kernels.reference import l2norm


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule, differentiable in every input (the initial state included).

    q, k: ``[B, T, H, K]`` raw (l2-normalised here, eps 1e-6); v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H``;
    g (log-decay, ``<= 0``) and beta (activated): ``[B, T, HV]``; initial_state: ``[B, HV, V, K]``.
    Returns ``o [B, T, HV, V]`` in v's dtype and the final state ``[B, HV, V, K]`` in fp32. Computed in fp32, with
    autocast off: under bf16 autocast the state recurrence would be rounded to bf16 at every chunk.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    rep = HV // H
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    out_dtype = v.dtype

    with torch.autocast(q.device.type, enabled=False):
        # [B, T, H, D] -> [B, HV, N, C, D]; padded tokens have k = 0 and beta = 0, g = 0 and so leave the state alone
        def chunks(x: torch.Tensor) -> torch.Tensor:
            x = F.pad(x.float().transpose(1, 2), (0, 0, 0, pad))
            return x.reshape(B, x.shape[1], N, C, x.shape[-1])

        qh = chunks(l2norm(q) * scale).repeat_interleave(rep, dim=1)
        kh = chunks(l2norm(k)).repeat_interleave(rep, dim=1)
        vc = chunks(v)
        gc = chunks(g[..., None]).squeeze(-1).cumsum(-1)                    # Γ: [B, HV, N, C]
        bc = chunks(beta[..., None])                                        # [B, HV, N, C, 1]

        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # Γ_i − Γ_j ≤ 0 on and below the diagonal; masking before exp keeps the upper triangle from overflowing
        gdiff = gc[..., :, None] - gc[..., None, :]
        decay = torch.where(causal, gdiff, torch.full_like(gdiff, float("-inf"))).exp()

        # L's diagonal is never read: the solve is unitriangular
        L = bc * (kh @ kh.transpose(-1, -2)) * decay
        eye = torch.eye(C, dtype=L.dtype, device=L.device)
        rhs = torch.cat([bc * gc.exp()[..., None] * kh, bc * vc], dim=-1)
        wu = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        w, u_tilde = wu[..., :K], wu[..., K:]                               # W: [.., C, K], Ũ: [.., C, V]

        q_decayed = qh * gc.exp()[..., None]                                # e^Γ ⊙ Q̂
        attn = (qh @ kh.transpose(-1, -2)) * decay                          # [.., C, C], j ≤ i
        g_last = gc[..., -1:]                                               # Γ_C: [B, HV, N, 1]
        k_decayed = kh * (g_last - gc).exp()[..., None]                     # e^{Γ_C − Γ} ⊙ K̂
        state_decay = g_last.exp()[..., None]                               # [B, HV, N, 1, 1]

        S = (q.new_zeros(B, HV, V, K, dtype=torch.float32) if initial_state is None
             else initial_state.float())
        outs = []
        for n in range(N):
            u = u_tilde[:, :, n] - w[:, :, n] @ S.transpose(-1, -2)         # [B, HV, C, V]
            outs.append(q_decayed[:, :, n] @ S.transpose(-1, -2) + attn[:, :, n] @ u)
            S = state_decay[:, :, n] * S + u.transpose(-1, -2) @ k_decayed[:, :, n]

        o = torch.stack(outs, dim=2).reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), S
