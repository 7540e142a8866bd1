"""Triton kernels: commit an accepted root-to-node path, in place.

``commit_state_`` is :func:`specla_kernels.reference.commit_state_ref` done in place on the fp32 V-first state:
with ``P`` the path from the committed state to the accepted node ``m`` and ``Γ`` the path log-decay,

    S ← e^{Γ_m} S + Σ_{j∈P} e^{Γ_m-Γ_j} u_j k̂_jᵀ

one rank-|P| update from the compact factors; the state is read once and written once. A first small kernel finds
the path (row ``m`` of the ancestor mask, built as in the tree kernel) and its weights ``e^{Γ_m-Γ_j}`` once per
(layer, sequence, value head); then each program of the update owns one [BV, BK] tile of one head's state: one
round trip to memory, reading the factors of path nodes only.
``commit_window_`` is :func:`specla_kernels.reference.commit_window_ref` in place: the new conv window is the last W raw
inputs of ``[old window, x along P]``. ``accepted[b] == -1`` leaves batch row ``b`` untouched in both.

A decode step commits every layer at once, so the kernels take a table of per-layer base addresses
(``commit_states_`` / ``commit_windows_``): two launches for all states and one for all windows, whatever the
layer count (the layers' tensors are separate allocations: the pending factors are outputs of the verify pass). The
tables are cached by address, so a decoding loop whose factors live in CUDA-graph output buffers builds them once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.tree_delta import ancestor_mask

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["Nt", "n_sq", "BHV"])
def commit_weights_kernel(
    g_ptrs, parents, accepted, w, decay,
    Nt, n_sq, BHV,
    HV: tl.constexpr,
    BN: tl.constexpr,
):
    """Per (layer, sequence, value head): the path weights ``w_j = e^{Γ_m-Γ_j}`` (0 off the path) and ``e^{Γ_m}``."""
    i_lbh = tl.program_id(0)
    i_l, i_bh = i_lbh // BHV, i_lbh % BHV
    i_b, i_hv = i_bh // HV, i_bh % HV
    m = tl.load(accepted + i_b).to(tl.int32)
    g = tl.load(g_ptrs + i_l).to(tl.pointer_type(tl.float32))
    rows = tl.arange(0, BN)
    m_n = rows < Nt
    p_n = tl.load(parents + i_b * Nt + rows, mask=m_n, other=-1).to(tl.int32)
    b_g = tl.load(g + (i_b * Nt + rows).to(tl.int64) * HV + i_hv, mask=m_n, other=0.).to(tl.float32)
    anc = ancestor_mask(p_n, rows, n_sq, BN)
    on_path = tl.sum(tl.where((rows == m)[:, None] & anc, 1, 0), 0) > 0         # row m of the mask
    # Γ_j of a path node sums the gates of its own ancestors, i.e. of the path down to j
    gam = tl.sum(tl.where(anc, b_g[None, :], 0.), 1)
    gam_m = tl.sum(tl.where(rows == m, gam, 0.), 0)
    tl.store(w + i_lbh.to(tl.int64) * BN + rows, tl.where(on_path, tl.exp(tl.minimum(gam_m - gam, 0.)), 0.))
    tl.store(decay + i_lbh, tl.exp(gam_m))


@triton.jit(do_not_specialize=["Nt", "BHV"])
def commit_state_kernel(
    state_ptrs, k_hat_ptrs, u_ptrs, w, decay, accepted,
    Nt, BHV,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_v, i_k, i_lbh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l, i_bh = i_lbh // BHV, i_lbh % BHV
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    m = tl.load(accepted + i_b).to(tl.int32)
    if m >= 0:
        state = tl.load(state_ptrs + i_l).to(tl.pointer_type(tl.float32))
        k_hat = tl.load(k_hat_ptrs + i_l).to(tl.pointer_type(tl.float32))
        u = tl.load(u_ptrs + i_l).to(tl.pointer_type(tl.float32))
        o_v = i_v * BV + tl.arange(0, BV)
        o_k = i_k * BK + tl.arange(0, BK)
        m_sk = (o_v < V)[:, None] & (o_k < K)[None, :]
        p_sk = state + i_bh.to(tl.int64) * V * K + o_v[:, None] * K + o_k[None, :]
        b_s = tl.load(p_sk, mask=m_sk, other=0.)
        rows = tl.arange(0, BN)
        tok = (i_b * Nt + rows).to(tl.int64)
        b_w = tl.load(w + i_lbh.to(tl.int64) * BN + rows)
        on_path = b_w > 0.                  # (a path node whose weight underflowed to 0 contributes nothing anyway)
        # only path rows are read
        b_u = tl.load(u + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=on_path[:, None] & (o_v < V)[None, :],
                      other=0.).to(tl.float32)
        b_kh = tl.load(k_hat + (tok[:, None] * H + i_h) * K + o_k[None, :],
                       mask=on_path[:, None] & (o_k < K)[None, :], other=0.).to(tl.float32)
        b_s = b_s * tl.load(decay + i_lbh) + tl.dot(tl.trans(b_u * b_w[:, None]), b_kh, input_precision="tf32x3")
        tl.store(p_sk, b_s, mask=m_sk)


@triton.jit(do_not_specialize=["Nt", "B"])
def commit_window_kernel(
    x_ptrs, window_ptrs, parents, accepted,
    Nt, D, B,
    X_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_lb = tl.program_id(0), tl.program_id(1)
    i_l, i_b = i_lb // B, i_lb % B
    m = tl.load(accepted + i_b).to(tl.int32)
    if m >= 0:
        x = tl.load(x_ptrs + i_l).to(tl.pointer_type(X_DTYPE))
        window = tl.load(window_ptrs + i_l).to(tl.pointer_type(W_DTYPE))
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
        new = tl.where((src >= 0)[None, :], from_tree.to(W_DTYPE), from_win.to(X_DTYPE).to(W_DTYPE))
        # new column t reads old column t + 1 + depth: every thread must have read before any writes
        tl.debug_barrier()
        tl.store(p_w + col[None, :], new, mask=m_d[:, None] & m_col[None, :])


_TABLES: dict[tuple, torch.Tensor] = {}
_CAPTURED: dict[tuple, torch.Tensor] = {}     # tables a captured CUDA graph reads: never freed


def _address_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 base addresses of ``tensors`` on their device, cached by address (a decoding loop reuses its buffers).
    Under CUDA-graph capture the table must exist already (a warm-up call made it); it is then kept for good."""
    key = (tensors[0].device, *(t.data_ptr() for t in tensors))
    table = _CAPTURED.get(key, _TABLES.get(key))
    if table is None:
        if len(_TABLES) > 1024:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key[1:], dtype=torch.int64, device=tensors[0].device)
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = table
    return table


def _same(tensors: list[torch.Tensor], what: str, dtype: torch.dtype | None = None) -> None:
    t0 = tensors[0]
    for t in tensors:
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device or not t.is_contiguous():
            raise ValueError(f"every layer's {what} must be a contiguous tensor of one shape, dtype and device")
    if dtype is not None and t0.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {t0.dtype}")


def commit_states_(
    states: list[torch.Tensor],
    k_hats: list[torch.Tensor],
    us: list[torch.Tensor],
    gs: list[torch.Tensor],
    parents: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """In-place ``commit_state_ref`` of every layer, one launch: per layer ``state [B,HV,V,K]`` fp32 and the factors of
    ``Nt`` verified nodes (``k_hat [B,Nt,H,K]``, ``u [B,Nt,HV,V]``, ``g [B,Nt,HV]``, fp32), all contiguous and of one
    shape across layers; one tree ``parents [B,Nt]`` and ``accepted [B]`` (-1: untouched) for all layers."""
    for ts, what in ((states, "state"), (k_hats, "k_hat"), (us, "u"), (gs, "g")):
        _same(ts, what, torch.float32)
    B, HV, V, K = states[0].shape
    Nt, H = k_hats[0].shape[1], k_hats[0].shape[2]
    if not 1 <= Nt <= 128:
        raise ValueError(f"one tree chunk holds 1..128 nodes, got {Nt}")
    BN = max(16, triton.next_power_of_2(Nt))
    BV, BK = 32, max(16, min(64, triton.next_power_of_2(K)))
    LBH = len(states) * B * HV
    parents, accepted = parents.contiguous(), accepted.contiguous()
    # the path and its decays once per (layer, sequence, head), not once per state tile: the update programs then
    # only stream the state (the ancestor mask of a 64-node tree in each of ~8000 programs cost ~5x the traffic)
    w = torch.empty(LBH, BN, dtype=torch.float32, device=parents.device)
    decay = torch.empty(LBH, dtype=torch.float32, device=parents.device)
    commit_weights_kernel[(LBH,)](_address_table(gs), parents, accepted, w, decay, Nt, (Nt - 1).bit_length(), B * HV,
                                  HV=HV, BN=BN, num_warps=4 if BN <= 32 else 8)
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), LBH)
    commit_state_kernel[grid](
        _address_table(states), _address_table(k_hats), _address_table(us), w, decay, accepted, Nt, B * HV,
        H=H, HV=HV, K=K, V=V, BN=BN, BK=BK, BV=BV, num_warps=4,
    )


def commit_windows_(xs: list[torch.Tensor], windows: list[torch.Tensor], parents: torch.Tensor,
                    accepted: torch.Tensor) -> None:
    """In-place ``commit_window_ref`` of every layer, one launch: per layer ``x [B,Nt,D]`` raw inputs of the
    verified nodes and ``window [B,D,W]`` (newest last), all contiguous and of one shape across layers."""
    _same(xs, "x")
    _same(windows, "window")
    B, Nt, D = xs[0].shape
    W = windows[0].shape[-1]
    BD = min(256, triton.next_power_of_2(D))
    grid = (triton.cdiv(D, BD), len(windows) * B)
    commit_window_kernel[grid](_address_table(xs), _address_table(windows), parents.contiguous(),
                               accepted.contiguous(), Nt, D, B, X_DTYPE=TL_DTYPES[xs[0].dtype],
                               W_DTYPE=TL_DTYPES[windows[0].dtype], W=W, BW=triton.next_power_of_2(W), BD=BD,
                               num_warps=4)


def commit_state_(state: torch.Tensor, k_hat: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                  parents: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``commit_states_`` of one layer (factors made contiguous fp32). Returns ``state``."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("commit_state_ updates a contiguous fp32 state in place")
    commit_states_([state], [k_hat.float().contiguous()], [u.float().contiguous()], [g.float().contiguous()],
                   parents, accepted)
    return state


def commit_window_(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """``commit_windows_`` of one layer. Returns ``window``."""
    if not window.is_contiguous():
        raise ValueError("commit_window_ updates a contiguous window in place")
    commit_windows_([x.contiguous()], [window], parents, accepted)
    return window
