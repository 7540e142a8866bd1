"""Triton kernel: commit an accepted root-to-node path, in place, every layer's state and conv window in one launch.

The state part is :func:`specla_kernels.reference.commit_state_ref` in place on the fp32 V-first state: with ``P``
the path from the committed state to the accepted node ``m`` and ``Γ`` the path log-decay,

    S ← e^{Γ_m} S + Σ_{j∈P} e^{Γ_m-Γ_j} u_j k̂_jᵀ

one rank-|P| update from the compact factors; the state is read once and written once. The path is row ``m`` of the
tree's ancestor mask (``tree_ancestors``, built once per tree by the verify pass); since parents precede children,
``Γ_m - Γ_j`` is the sum of the path's gates after ``j``: a cumulative sum, no mask to build. Each program owns one
[BV, BK] tile of one head's state: it requests the tile first (it depends on nothing), then reads the path's gates
and factors only, one dot over the tree's nodes masked to the path (or, with ``BP`` below the padded node count,
the path's nodes gathered ``BP`` per dot), one store.
The window part is :func:`specla_kernels.reference.commit_window_ref` in place: the new conv window is the last W raw
inputs of ``[old window, x along P]``. ``accepted[b] == -1`` leaves batch row ``b`` untouched in both.

The layers' tensors are separate allocations (the pending factors are outputs of the verify pass), so the kernel takes
tables of per-layer base addresses; one grid holds the state tiles of every layer, then the window blocks. The
tables are cached by address, so a decoding loop whose factors live in CUDA-graph output buffers builds them once.
Addresses read from a table carry no alignment Triton can see (a pointer argument is specialised as 16-byte aligned,
a loaded one is not), so the kernel is told when every table's tensors are aligned (``ALIGN``, checked on the host):
128-bit loads and stores of the state and factors instead of 32-bit ones (session 16; 115 -> 96 registers at [64, 64]
tiles, Triton 3.6's ptxas).
Before session 7 this was three launches (the path weights, the states, the windows), and the first rebuilt the
ancestor mask of the tree per (layer, sequence, head).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.tree_delta import tree_ancestors

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _base(table, i_l, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Layer ``i_l``'s tensor from a table of base addresses, as a pointer aligned to ``ALIGN`` bytes (checked on the
    host). Without the hint Triton cannot know a loaded address's alignment and moves every tile element by element:
    32-bit loads and stores of the state instead of 128-bit ones."""
    return tl.multiple_of(tl.load(table + i_l).to(tl.pointer_type(DTYPE)), ALIGN)


@triton.jit
def _path(ancestors, accepted, i_b, Nt, BN: tl.constexpr):
    """The accepted node ``m`` of sequence ``i_b`` and its path as a mask over the nodes (row ``m`` of the ancestor
    mask; all False when ``m == -1``)."""
    m = tl.load(accepted + i_b).to(tl.int32)
    rows = tl.arange(0, BN)
    row = tl.load(ancestors + (i_b * Nt + tl.maximum(m, 0)).to(tl.int64) * Nt + rows, mask=rows < Nt, other=0)
    # (a vector compare, not `& (m >= 0)`: the interpreter turns a bool vector & bool scalar into int32)
    return m, (row != 0) & (rows < tl.where(m >= 0, Nt, 0))


@triton.jit
def _factors(tok, m_p, u, k_hat, o_v, o_k, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
             V: tl.constexpr):
    """The ``u`` and ``k̂`` tiles of the nodes ``tok`` where ``m_p`` (masked rows are not read) for a program's state
    tile."""
    b_u = tl.load(u + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_p[:, None] & (o_v < V)[None, :], other=0.)
    b_kh = tl.load(k_hat + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_p[:, None] & (o_k < K)[None, :],
                   other=0.)
    return b_u, b_kh


@triton.jit
def _path_update(tok, m_p, w_p, u, k_hat, o_v, o_k, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr):
    """``Σ_p w_p u_p k̂_pᵀ`` on a program's state tile over the nodes ``tok`` where ``m_p``."""
    b_u, b_kh = _factors(tok, m_p, u, k_hat, o_v, o_k, i_h, i_hv, H, HV, K, V)
    return tl.dot(tl.trans(b_u * w_p[:, None]), b_kh, input_precision="tf32x3")


@triton.jit
def _tile(pid, state_ptrs, BHV, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr, ALIGN: tl.constexpr):
    """State tile ``pid`` (layer-major, then batch x head, then [BV, BK] blocks): its layer, sequence, value and key
    heads, row and column offsets, addresses and mask."""
    NV: tl.constexpr = (V + BV - 1) // BV
    NK: tl.constexpr = (K + BK - 1) // BK
    i_lbh, i_vk = pid // (NV * NK), pid % (NV * NK)
    i_v, i_k = i_vk // NK, i_vk % NK
    i_l, i_bh = i_lbh // BHV, i_lbh % BHV
    i_b, i_hv = i_bh // HV, i_bh % HV
    state = _base(state_ptrs, i_l, tl.float32, ALIGN)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = i_k * BK + tl.arange(0, BK)
    m_sk = (o_v < V)[:, None] & (o_k < K)[None, :]
    p_sk = state + i_bh.to(tl.int64) * V * K + o_v[:, None] * K + o_k[None, :]
    return i_l, i_b, i_hv, i_hv // (HV // H), o_v, o_k, m_sk, p_sk


@triton.jit
def _commit_state_tile(pid, b_s, state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs, ancestors, accepted, Nt, BHV,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BN: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       EAGER: tl.constexpr, ALIGN: tl.constexpr):
    """Commit state tile ``pid``, whose current values ``b_s`` the caller has loaded."""
    i_l, i_b, i_hv, i_h, o_v, o_k, m_sk, p_sk = _tile(pid, state_ptrs, BHV, H, HV, K, V, BK, BV, ALIGN)
    rows = tl.arange(0, BN)
    k_hat = _base(k_hat_ptrs, i_l, tl.float32, ALIGN)
    u = _base(u_ptrs, i_l, tl.float32, ALIGN)
    if EAGER:
        # every node's factors, requested beside the state tile rather than after the path is known (they are the
        # verify pass's outputs, in L2): one dependent round trip fewer, the path masks the weights instead
        b_u, b_kh = _factors((i_b * Nt + rows).to(tl.int64), rows < Nt, u, k_hat, o_v, o_k, i_h, i_hv, H, HV, K, V)
    m, on_path = _path(ancestors, accepted, i_b, Nt, BN)
    if m >= 0:
        g = _base(g_ptrs, i_l, tl.float32, ALIGN)
        b_g = tl.load(g + (i_b * Nt + rows).to(tl.int64) * HV + i_hv, mask=on_path, other=0.)   # path rows only
        gam_m = tl.sum(b_g, 0)
        b_w = tl.where(on_path, tl.exp(gam_m - tl.cumsum(b_g, 0)), 0.)      # e^{Γ_m - Γ_j}: the gates after j
        b_s = b_s * tl.exp(gam_m)
        if EAGER:
            b_s += tl.dot(tl.trans(b_u * b_w[:, None]), b_kh, input_precision="tf32x3")
        elif BP == BN:
            # one dot over the tree's nodes, masked to the path
            b_s += _path_update((i_b * Nt + rows).to(tl.int64), on_path, b_w, u, k_hat, o_v, o_k, i_h, i_hv,
                                H, HV, K, V)
        else:
            # the path's nodes in path order, BP per dot: the dot and its factor tiles are as deep as the path, not
            # the tree. Chunks are unrolled and skipped past the path's end (a loop with a data-dependent trip
            # count measured 2-4x slower, session 7).
            pos = tl.cumsum(on_path.to(tl.int32), 0) - 1                     # a path node's position on the path
            n_path = tl.sum(on_path.to(tl.int32), 0)
            for c in tl.static_range(BN // BP):
                if c * BP < n_path:
                    slot = c * BP + tl.arange(0, BP)
                    hit = on_path[None, :] & (pos[None, :] == slot[:, None])            # [BP, BN]
                    tok = (i_b * Nt + tl.sum(tl.where(hit, rows[None, :], 0), 1)).to(tl.int64)
                    b_s += _path_update(tok, slot < n_path, tl.sum(tl.where(hit, b_w[None, :], 0.), 1), u, k_hat,
                                        o_v, o_k, i_h, i_hv, H, HV, K, V)
        tl.store(p_sk, b_s, mask=m_sk)


@triton.jit
def _commit_window_block(pid, x_ptrs, window_ptrs, ancestors, accepted, Nt, B, D,
                         X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                         BN: tl.constexpr, BD: tl.constexpr, ALIGN: tl.constexpr):
    ND = tl.cdiv(D, BD)
    i_lb, i_d = pid // ND, pid % ND
    i_l, i_b = i_lb // B, i_lb % B
    m, on_path = _path(ancestors, accepted, i_b, Nt, BN)
    if m >= 0:
        x = _base(x_ptrs, i_l, X_DTYPE, ALIGN)
        window = _base(window_ptrs, i_l, W_DTYPE, ALIGN)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        rows = tl.arange(0, BN)
        pos_of = tl.cumsum(on_path.to(tl.int32), 0) - 1           # a path node's position on the path (root: 0)
        n_path = tl.sum(on_path.to(tl.int32), 0)
        col = tl.arange(0, BW)
        m_col = col < W
        # new column t is input n_path + t of [old window (W), path (n_path)], counting from W - 1 inputs back
        pos = n_path + col - W                                     # < 0: old column n_path + t
        src = tl.max(tl.where(on_path[None, :] & (pos_of[None, :] == pos[:, None]), rows[None, :], -1), 1)
        from_tree = tl.load(x + (i_b * Nt + src[None, :]).to(tl.int64) * D + o_d[:, None],
                            mask=m_d[:, None] & (m_col & (pos >= 0))[None, :], other=0.)
        p_w = window + (i_b * D + o_d[:, None]).to(tl.int64) * W
        from_win = tl.load(p_w + (n_path + col)[None, :], mask=m_d[:, None] & (m_col & (pos < 0))[None, :], other=0.)
        new = tl.where((pos >= 0)[None, :], from_tree.to(W_DTYPE), from_win.to(X_DTYPE).to(W_DTYPE))
        # new column t reads old column t + n_path: every thread must have read before any writes
        tl.debug_barrier()
        tl.store(p_w + col[None, :], new, mask=m_d[:, None] & m_col[None, :])


@triton.jit(do_not_specialize=["Nt", "BHV", "B", "D", "n_state"])
def commit_kernel(state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs, x_ptrs, window_ptrs, ancestors, accepted,
                  Nt, BHV, B, D, n_state,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
                  BP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EAGER: tl.constexpr, X_DTYPE: tl.constexpr,
                  W_DTYPE: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, ALIGN: tl.constexpr):
    # the grid holds the state tiles, then the (short) window blocks (session 12 measured the window blocks first in
    # the grid, and programs looping over several state tiles with the next one's load issued first: both slower)
    pid = tl.program_id(0)
    if pid < n_state:
        _, _, _, _, _, _, m_sk, p_sk = _tile(pid, state_ptrs, BHV, H, HV, K, V, BK, BV, ALIGN)
        _commit_state_tile(pid, tl.load(p_sk, mask=m_sk, other=0.), state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs,
                           ancestors, accepted, Nt, BHV, H, HV, K, V, BN, BP, BK, BV, EAGER, ALIGN)
    else:
        _commit_window_block(pid - n_state, x_ptrs, window_ptrs, ancestors, accepted, Nt, B, D,
                             X_DTYPE, W_DTYPE, W, BW, BN, BD, ALIGN)


_TABLES: dict[tuple, torch.Tensor] = {}
_CAPTURED: dict[tuple, torch.Tensor] = {}     # tables a captured CUDA graph reads: never freed


def _address_table(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """int64 base addresses of ``tensors`` on their device, cached by address (a decoding loop reuses its buffers),
    and the alignment in bytes (16 or 1) the kernel may assume of all of them (torch allocates 16-byte aligned; a view
    may not be).
    A table a captured CUDA graph reads is kept for good. Under capture a missing table (of tensors the captured
    code made itself, at addresses its warm-up did not use) is written by fill kernels the graph replays: a copy
    from pageable host memory cannot be captured."""
    key = (tensors[0].device, *(t.data_ptr() for t in tensors))
    capturing = tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()
    table = _CAPTURED.get(key, _TABLES.get(key))
    if table is None and capturing:
        table = torch.empty(len(tensors), dtype=torch.int64, device=tensors[0].device)
        for row, address in zip(table, key[1:]):
            row.fill_(address)
    elif table is None:
        if len(_TABLES) > 1024:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key[1:], dtype=torch.int64, device=tensors[0].device)
    if capturing:
        _CAPTURED[key] = table
    return table, 16 if all(address % 16 == 0 for address in key[1:]) else 1


def _same(tensors: list[torch.Tensor], what: str, dtype: torch.dtype | None = None) -> None:
    t0 = tensors[0]
    for t in tensors:
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device or not t.is_contiguous():
            raise ValueError(f"every layer's {what} must be a contiguous tensor of one shape, dtype and device")
    if dtype is not None and t0.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {t0.dtype}")


def commit_tile(n: int) -> dict[str, int]:
    """A program's ``[BV, BK]`` state tile, path nodes per dot ``BP``, warps, and ``ALIGN`` (1: no 128-bit accesses,
    where that measured faster) for a tree of ``n`` nodes: the fastest of the sweep in benchmarks/bench_kernels.py
    (H200, 1.3B shape, 21 layers, the deepest path of a deep tree; sessions 17-18, with the alignment hint of session
    16): [64, 64] tiles with one masked dot over the tree up to 16 nodes (47.0 / 48.7 / 48.8 / 50.3 us at 1 / 4 / 8
    / 16 nodes; ``EAGER``, every node's factors requested with the state tile, loses at 16 nodes, 56.1 us); from 17
    to 64 nodes [64, 128] tiles with the path gathered 16 nodes per dot and no 128-bit accesses (session 18: 53.0 /
    55.0 us at 32 / 64 nodes, against 58.3 / 65.1 for [64, 64] tiles so gathered, 75.1 / 79.6 with 128-bit accesses
    and 66.9 / 75.9 with 32 nodes per dot; the same order on a drafted tree's deepest path). With 128-bit accesses
    [64, 128] tiles lose and [64, 64] ones win (56.8 against 50.4 at 16 nodes without them); the cause is not
    diagnosed. 8 warps lost at every size; above 64 nodes the shape is untimed since the hint (187 us at 128,
    session 8). Measured and removed: a loop over the path with a data-dependent trip count (94-406 us, session 7);
    the window blocks first in the grid and 2-3 programs per SM looping over the state tiles (session 12); 1-2 warps
    and whole state rows (session 15). ``EAGER`` reads off-path nodes' factors too, weighted 0: they must be finite,
    as the verify pass's outputs are."""
    if n <= 16:   # the whole (padded) tree in one dot
        return dict(BV=64, BK=64, BP=16, EAGER=0, num_warps=4)
    if n <= 64:
        return dict(BV=64, BK=128, BP=16, EAGER=0, ALIGN=1, num_warps=4)
    return dict(BV=64, BK=64, BP=128, EAGER=0, num_warps=4)


def commit_(parents: torch.Tensor, accepted: torch.Tensor, *,
            states: tuple[list[torch.Tensor], ...] | None = None,
            windows: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
            ancestors: torch.Tensor | None = None, tile: dict[str, int] | None = None) -> None:
    """In-place ``commit_state_ref`` and ``commit_window_ref`` of every layer, one launch, for one tree ``parents
    [B,Nt]`` (``ancestors``: its ``tree_ancestors`` when the caller has it) and ``accepted [B]`` (-1: untouched).
    ``states = (states, k_hats, us, gs)``: per layer ``state [B,HV,V,K]`` fp32 and the factors of the ``Nt`` verified
    nodes (``k_hat [B,Nt,H,K]``, ``u [B,Nt,HV,V]``, ``g [B,Nt,HV]``, fp32); ``windows = (xs, windows)``: per layer
    ``x [B,Nt,D]`` raw inputs and ``window [B,D,W]`` (newest last). Each list contiguous and of one shape across
    layers; either part may be ``None``. ``tile`` overrides ``commit_tile``'s entries, and ``ALIGN=1`` drops the
    128-bit accesses that 16-byte-aligned tensors get (benchmarks: the unhinted kernel)."""
    B, Nt = parents.shape
    if not 1 <= Nt <= 128:
        raise ValueError(f"one tree chunk holds 1..128 nodes, got {Nt}")
    if ancestors is None:
        ancestors = tree_ancestors(parents)
    tile = {**commit_tile(Nt), **(tile or {})}
    BN = max(16, triton.next_power_of_2(Nt))
    tables, n_state, n_window = [], 0, 0
    shape = dict(H=1, HV=1, K=16, V=16, BK=16, BV=16, X_DTYPE=tl.float32, W_DTYPE=tl.float32, W=1, BW=1, BD=16)
    if states is not None:
        for ts, what in zip(states, ("state", "k_hat", "u", "g")):
            _same(ts, what, torch.float32)
        _, HV, V, K = states[0][0].shape
        H = states[1][0].shape[2]
        BV, BK = min(tile["BV"], triton.next_power_of_2(V)), max(16, min(tile["BK"], triton.next_power_of_2(K)))
        n_state = len(states[0]) * B * HV * triton.cdiv(V, BV) * triton.cdiv(K, BK)
        shape.update(H=H, HV=HV, K=K, V=V, BK=BK, BV=BV)
        tables += [_address_table(ts) for ts in states]
    else:
        tables += [_address_table(windows[1])] * 4          # never read: no state programs
    if windows is not None:
        xs, ws = windows
        _same(xs, "x")
        _same(ws, "window")
        D, W = ws[0].shape[1:]
        BD = min(256, triton.next_power_of_2(D))
        n_window = len(ws) * B * triton.cdiv(D, BD)
        shape.update(X_DTYPE=TL_DTYPES[xs[0].dtype], W_DTYPE=TL_DTYPES[ws[0].dtype], W=W,
                     BW=triton.next_power_of_2(W), BD=BD)
        tables += [_address_table(xs), _address_table(ws)]
    else:
        D = 0
        tables += tables[:2]                                  # never read: no window programs
    align = min(tile.get("ALIGN", 16), *(a for _, a in tables))   # 16: 128-bit state and factor accesses
    commit_kernel[(n_state + n_window,)](
        *(t for t, _ in tables), ancestors.contiguous(), accepted.contiguous(), Nt, B * shape["HV"], B, D, n_state,
        BN=BN, BP=min(tile.get("BP") or BN, BN), EAGER=bool(tile.get("EAGER")) and (tile.get("BP") or BN) >= BN,
        ALIGN=align, **shape, num_warps=tile["num_warps"],
    )
