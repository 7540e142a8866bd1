"""Triton kernels: commit an accepted root-to-node path, in place.

``commit_state_`` is :func:`specla_kernels.reference.commit_state_ref` done in place on the fp32 V-first state:
with ``P`` the path from the committed state to the accepted node ``m`` and ``Γ`` the path log-decay,

    S ← e^{Γ_m} S + Σ_{j∈P} e^{Γ_m-Γ_j} u_j k̂_jᵀ

one rank-|P| update from the compact factors; the state is read once and written once. Each program owns one
[BV, BK] tile of one head's state, so the whole commit is one round trip to memory per program: it issues the state
load first, finds the path (row ``m`` of the ancestor mask, built as in the tree kernel) meanwhile, and reads the
factors of path nodes only.
``commit_window_`` is :func:`specla_kernels.reference.commit_window_ref` in place: the new conv window is the last W raw
inputs of ``[old window, x along P]``. ``accepted[b] == -1`` leaves batch row ``b`` untouched in both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.tree_delta import ancestor_mask


@triton.jit(do_not_specialize=["Nt", "n_sq"])
def commit_state_kernel(
    state, k_hat, u, g, parents, accepted,
    Nt, n_sq,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    m = tl.load(accepted + i_b).to(tl.int32)
    if m >= 0:
        o_v = i_v * BV + tl.arange(0, BV)
        o_k = i_k * BK + tl.arange(0, BK)
        m_sk = (o_v < V)[:, None] & (o_k < K)[None, :]
        p_sk = state + i_bh.to(tl.int64) * V * K + o_v[:, None] * K + o_k[None, :]
        b_s = tl.load(p_sk, mask=m_sk, other=0.)                  # issued first: it does not depend on the path
        rows = tl.arange(0, BN)
        m_n = rows < Nt
        tok = (i_b * Nt + rows).to(tl.int64)
        p_n = tl.load(parents + i_b * Nt + rows, mask=m_n, other=-1).to(tl.int32)
        b_g = tl.load(g + tok * HV + i_hv, mask=m_n, other=0.).to(tl.float32)
        anc = ancestor_mask(p_n, rows, n_sq, BN)
        on_path = tl.sum(tl.where((rows == m)[:, None] & anc, 1, 0), 0) > 0         # row m of the mask
        # Γ_j of a path node sums the gates of its own ancestors, i.e. of the path down to j
        gam = tl.sum(tl.where(anc, b_g[None, :], 0.), 1)
        gam_m = tl.sum(tl.where(rows == m, gam, 0.), 0)
        w = tl.where(on_path, tl.exp(tl.minimum(gam_m - gam, 0.)), 0.)
        # only path rows are read
        b_u = tl.load(u + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=on_path[:, None] & (o_v < V)[None, :],
                      other=0.).to(tl.float32)
        b_kh = tl.load(k_hat + (tok[:, None] * H + i_h) * K + o_k[None, :],
                       mask=on_path[:, None] & (o_k < K)[None, :], other=0.).to(tl.float32)
        b_s = b_s * tl.exp(gam_m) + tl.dot(tl.trans(b_u * w[:, None]), b_kh, input_precision="tf32x3")
        tl.store(p_sk, b_s, mask=m_sk)


@triton.jit(do_not_specialize=["Nt"])
def commit_window_kernel(
    x, window, parents, accepted,
    Nt, D,
    W: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    m = tl.load(accepted + i_b).to(tl.int32)
    if m >= 0:
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        col = tl.arange(0, BW)                   # window column t holds the input W-1-t steps above m
        dist = W - 1 - col
        # walk W-1 steps up from m; `depth` counts the steps that stayed inside the tree
        cur = m
        depth = 0
        src = tl.where(dist == 0, m, -1)
        win = tl.zeros([BW], dtype=tl.int32)
        for s in tl.static_range(1, W):
            if cur >= 0:
                cur = tl.load(parents + i_b * Nt + cur).to(tl.int32)
            src = tl.where(dist == s, cur, src)
            # once the path has left the tree, distance s reads committed column W - s + depth(m)
            win = tl.where(dist == s, W - s + depth, win)
            depth += (cur >= 0).to(tl.int32)
        m_col = col < W
        from_tree = tl.load(x + (i_b * Nt + src[None, :]).to(tl.int64) * D + o_d[:, None],
                            mask=m_d[:, None] & (m_col & (src >= 0))[None, :], other=0.)
        p_w = window + (i_b * D + o_d[:, None]).to(tl.int64) * W
        from_win = tl.load(p_w + win[None, :], mask=m_d[:, None] & (m_col & (src < 0))[None, :], other=0.)
        new = tl.where((src >= 0)[None, :], from_tree.to(window.dtype.element_ty),
                       from_win.to(x.dtype.element_ty).to(window.dtype.element_ty))
        # new column t reads old column t + 1 + depth: every thread must have read before any writes
        tl.debug_barrier()
        tl.store(p_w + col[None, :], new, mask=m_d[:, None] & m_col[None, :])


def commit_state_(
    state: torch.Tensor,
    k_hat: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    accepted: torch.Tensor,
) -> torch.Tensor:
    """In-place ``commit_state_ref``: ``state [B,HV,V,K]`` fp32 (contiguous), factors of ``Nt`` verified nodes
    (``k_hat [B,Nt,H,K]``, ``u [B,Nt,HV,V]``, ``g [B,Nt,HV]``), ``accepted [B]`` (-1: untouched). Returns ``state``."""
    B, HV, V, K = state.shape
    Nt, H = k_hat.shape[1], k_hat.shape[2]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("commit_state_ updates a contiguous fp32 state in place")
    if not 1 <= Nt <= 128:
        raise ValueError(f"one tree chunk holds 1..128 nodes, got {Nt}")
    BN = max(16, triton.next_power_of_2(Nt))
    BV, BK = 32, max(16, min(64, triton.next_power_of_2(K)))
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), B * HV)
    commit_state_kernel[grid](
        state, k_hat.contiguous(), u.contiguous(), g.contiguous(), parents.contiguous(), accepted.contiguous(),
        Nt, (Nt - 1).bit_length(),
        H=H, HV=HV, K=K, V=V, BN=BN, BK=BK, BV=BV, num_warps=4 if BN <= 32 else 8,
    )
    return state


def commit_window_(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """In-place ``commit_window_ref``: ``x [B,Nt,D]`` raw inputs of the verified nodes, ``window [B,D,W]``
    (contiguous, newest last), ``accepted [B]`` (-1: untouched). Returns ``window``."""
    B, Nt, D = x.shape
    W = window.shape[-1]
    if not window.is_contiguous():
        raise ValueError("commit_window_ updates a contiguous window in place")
    BD = min(256, triton.next_power_of_2(D))
    grid = (triton.cdiv(D, BD), B)
    commit_window_kernel[grid](x.contiguous(), window, parents.contiguous(), accepted.contiguous(), Nt, D,
                               W=W, BW=triton.next_power_of_2(W), BD=BD, num_warps=4)
    return window
