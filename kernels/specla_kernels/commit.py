"""Triton kernel: commit an accepted root-to-node path, in place, every layer's state and conv window in one launch.

The state part is :func:`specla_kernels.reference.commit_state_ref` in place on the fp32 V-first state: with ``P``
the path from the committed state to the accepted node ``m`` and ``Γ`` the path log-decay,

    S ← e^{Γ_m} S + Σ_{j∈P} e^{Γ_m-Γ_j} u_j k̂_jᵀ

one rank-|P| update from the compact factors; the state is read once and written once. The kernel is handed the path
itself, root first (``path [B, P]`` and its length ``[B]``): the acceptance step has it (``greedy_accept``), a chain's
path is its first nodes, and :func:`root_path` reads it off the tree's ancestor mask for anyone else. Each program
owns one [BV, BK] tile of one head's state: it requests the tile, the path's first ``BP`` nodes and the length at
once (none depends on another), then the gates and factors of those nodes, one dot, one store. Longer paths take
further chunks of ``BP`` nodes, each one step of the recurrence over its nodes (the state decays by the chunk's
gates, then adds the chunk's update): exact, and no weight needs the gates of a later chunk.
(Handing over the accepted node instead, each program would load it, then its row of the ancestor mask, then gather
the path from the row: one dependent L2 round trip more before the factors, and work that grows with the tree's
size, not the path's. On the H200 that version took 50.9 / 55.0 / 156.9 us at 16 / 64 / 128 nodes for the same
9-node path, against 49.4 / 49.9 / 49.6 for this one.)
The window part is :func:`specla_kernels.reference.commit_window_ref` in place: the new conv window is the last W raw
inputs of ``[old window, x along P]``. A length of 0 leaves batch row ``b`` untouched in both.

The layers' tensors are separate allocations (the pending factors are outputs of the verify pass), so the kernel takes
tables of per-layer base addresses; one grid holds the state tiles of every layer, then the window blocks. The
tables are cached by address, so a decoding loop whose factors live in CUDA-graph output buffers builds them once.
Addresses read from a table carry no alignment Triton can see (a pointer argument is specialised as 16-byte aligned,
a loaded one is not), so the kernel is told when every table's tensors are aligned (``ALIGN``, checked on the host):
128-bit loads and stores of the state and factors instead of 32-bit ones (adding the hint also took the [64, 64]
state program from 115 to 96 registers, Triton 3.6's ptxas).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _base(table, i_l, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Layer ``i_l``'s tensor from a table of base addresses, as a pointer aligned to ``ALIGN`` bytes (checked on the
    host). Without the hint Triton cannot know a loaded address's alignment and moves every tile element by element:
    32-bit loads and stores of the state instead of 128-bit ones."""
    return tl.multiple_of(tl.load(table + i_l).to(tl.pointer_type(DTYPE)), ALIGN)


@triton.jit
def _path_update(row, on, w, u, k_hat, o_v, o_k, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr):
    """``Σ_p w_p u_p k̂_pᵀ`` on a program's state tile over the factor rows ``row`` where ``on`` (the rest are not
    read)."""
    b_u = tl.load(u + (row[:, None] * HV + i_hv) * V + o_v[None, :], mask=on[:, None] & (o_v < V)[None, :], other=0.)
    b_kh = tl.load(k_hat + (row[:, None] * H + i_h) * K + o_k[None, :], mask=on[:, None] & (o_k < K)[None, :],
                   other=0.)
    return tl.dot(tl.trans(b_u * w[:, None]), b_kh, input_precision="tf32x3")


@triton.jit
def _chunk(b_s, node, on, i_b, i_h, i_hv, o_v, o_k, g, u, k_hat, Nt, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, V: tl.constexpr):
    """One step of the recurrence over the path nodes ``node`` where ``on`` (in path order): the state tile decays by
    their gates, then takes their update."""
    row = (i_b * Nt + node).to(tl.int64)
    b_g = tl.load(g + row * HV + i_hv, mask=on, other=0.)
    gam = tl.sum(b_g, 0)                                           # the chunk's log-decay
    b_w = tl.where(on, tl.exp(gam - tl.cumsum(b_g, 0)), 0.)        # e^{Γ_end - Γ_j}: the gates after j
    return b_s * tl.exp(gam) + _path_update(row, on, b_w, u, k_hat, o_v, o_k, i_h, i_hv, H, HV, K, V)


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
def _commit_state_tile(pid, state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs, path, length, s_path, s_len, P, Nt, BHV,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BP: tl.constexpr, LONG: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       ALIGN: tl.constexpr):
    """Commit state tile ``pid``: load it, apply the path's chunks, store it (untouched where the length is 0)."""
    i_l, i_b, i_hv, i_h, o_v, o_k, m_sk, p_sk = _tile(pid, state_ptrs, BHV, H, HV, K, V, BK, BV, ALIGN)
    b_s = tl.load(p_sk, mask=m_sk, other=0.)
    slot = tl.arange(0, BP)
    # the first chunk's nodes are requested with the length, not after it (padding slots hold valid node numbers or
    # are masked off below: they are never used to address memory unmasked)
    first = tl.load(path + i_b * s_path + slot, mask=slot < P, other=0)
    n_path = tl.load(length + i_b * s_len).to(tl.int32)
    if n_path > 0:
        k_hat = _base(k_hat_ptrs, i_l, tl.float32, ALIGN)
        u = _base(u_ptrs, i_l, tl.float32, ALIGN)
        g = _base(g_ptrs, i_l, tl.float32, ALIGN)
        b_s = _chunk(b_s, first, slot < n_path, i_b, i_h, i_hv, o_v, o_k, g, u, k_hat, Nt, H, HV, K, V)
        if LONG:
            # paths longer than a chunk: a loop over the further chunks, compiled only where the path's buffer is
            # longer than a chunk (Triton 3.6's ptxas at [64, 64]: 96 registers without it, 128 with it, 141 with
            # four chunks unrolled, 150 with the loop software-pipelined)
            for c in tl.range(1, tl.cdiv(n_path, BP), num_stages=1):
                node = tl.load(path + i_b * s_path + c * BP + slot, mask=c * BP + slot < P, other=0)
                b_s = _chunk(b_s, node, c * BP + slot < n_path, i_b, i_h, i_hv, o_v, o_k, g, u, k_hat, Nt,
                             H, HV, K, V)
        tl.store(p_sk, b_s, mask=m_sk)


@triton.jit
def _commit_window_block(pid, x_ptrs, window_ptrs, path, length, s_path, s_len, Nt, B, D,
                         X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                         BD: tl.constexpr, ALIGN: tl.constexpr):
    ND = tl.cdiv(D, BD)
    i_lb, i_d = pid // ND, pid % ND
    i_l, i_b = i_lb // B, i_lb % B
    n_path = tl.load(length + i_b * s_len).to(tl.int32)
    if n_path > 0:
        x = _base(x_ptrs, i_l, X_DTYPE, ALIGN)
        window = _base(window_ptrs, i_l, W_DTYPE, ALIGN)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        col = tl.arange(0, BW)
        m_col = col < W
        # new column t is input n_path + t of [old window (W), path (n_path)], counting from W - 1 inputs back
        pos = n_path + col - W                                     # >= 0: path slot pos; < 0: old column n_path + t
        m_tree = m_col & (pos >= 0)
        node = tl.load(path + i_b * s_path + pos, mask=m_tree, other=0)
        from_tree = tl.load(x + (i_b * Nt + node[None, :]).to(tl.int64) * D + o_d[:, None],
                            mask=m_d[:, None] & m_tree[None, :], other=0.)
        p_w = window + (i_b * D + o_d[:, None]).to(tl.int64) * W
        from_win = tl.load(p_w + (n_path + col)[None, :], mask=m_d[:, None] & (m_col & (pos < 0))[None, :], other=0.)
        new = tl.where((pos >= 0)[None, :], from_tree.to(W_DTYPE), from_win.to(X_DTYPE).to(W_DTYPE))
        # new column t reads old column t + n_path: every thread must have read before any writes
        tl.debug_barrier()
        tl.store(p_w + col[None, :], new, mask=m_d[:, None] & m_col[None, :])


@triton.jit(do_not_specialize=["s_path", "s_len", "P", "Nt", "BHV", "B", "D", "n_state"])
def commit_kernel(state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs, x_ptrs, window_ptrs, path, length,
                  s_path, s_len, P, Nt, BHV, B, D, n_state,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BP: tl.constexpr,
                  LONG: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, X_DTYPE: tl.constexpr,
                  W_DTYPE: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, ALIGN: tl.constexpr):
    # the grid holds the state tiles, then the (short) window blocks (the window blocks first in the grid, and
    # programs looping over several state tiles with the next one's load issued first, both measured slower)
    pid = tl.program_id(0)
    if pid < n_state:
        _commit_state_tile(pid, state_ptrs, k_hat_ptrs, u_ptrs, g_ptrs, path, length, s_path, s_len, P, Nt, BHV,
                           H, HV, K, V, BP, LONG, BK, BV, ALIGN)
    else:
        _commit_window_block(pid - n_state, x_ptrs, window_ptrs, path, length, s_path, s_len, Nt, B, D,
                             X_DTYPE, W_DTYPE, W, BW, BD, ALIGN)


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


PATH_CHUNK = 16     # path nodes per chunk (commit_tile's BP up to 16 and above 32 nodes): a buffer no longer
                    # than one chunk compiles without the loop over further chunks


def commit_tile(p: int) -> dict[str, int]:
    """A program's ``[BV, BK]`` state tile, path nodes per chunk ``BP``, warps, and ``ALIGN`` (1: no 128-bit
    accesses) for a path buffer of ``p`` nodes. H200, 21 layers (``benchmarks/ab_commit.py``): [64, 64] tiles with
    16-node chunks, 46.5 / 46.9 / 49.4-49.8 us for paths of 1 / 2 / 9 nodes (trees of 1 / 4 / 16-128 nodes), against
    59-62 with 32-node chunks, 49.5-50.1 with [32, 64] tiles and 60-64 with [64, 128] or [128, 64] ones or 8 warps; a
    path of 19-23 nodes in one 32-node chunk 62.4-63.0 against 69.0-69.5 in two of 16, while a longer buffer (the loop
    over chunks) takes 69-70 either way. Also measured slower: a loop over the path with a data-dependent trip count
    (94-406 us, before the first chunk was peeled off); the window blocks first in the grid and 2-3 programs per SM
    looping over the state tiles; 1-2 warps and whole state rows; every node's factors requested with the state tile
    before the path is known (slower once the alignment hint made the factor loads short)."""
    return dict(BV=64, BK=64, BP=2 * PATH_CHUNK if PATH_CHUNK < p <= 2 * PATH_CHUNK else PATH_CHUNK, num_warps=4)


def root_path(ancestors: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's root-to-``accepted`` path as the commit takes it, from the tree's ancestor mask ``[B, Nt, Nt]``
    and ``accepted [B]`` (-1: none): the nodes ``[B, Nt]``, root first (the path's nodes in node order: parents precede
    children; then the other nodes, never read), and their count ``[B]`` (0 where ``accepted == -1``). For callers
    that know only the accepted node: the acceptance step has the path already (``decoding.greedy_accept``)."""
    B, N = ancestors.shape[:2]
    row = ancestors.gather(1, accepted.clamp(min=0).view(B, 1, 1).expand(B, 1, N))[:, 0].bool()
    row &= (accepted >= 0)[:, None]
    return torch.argsort((~row).to(torch.int32), dim=1, stable=True), row.sum(1)


def commit_(path: torch.Tensor, length: torch.Tensor, *,
            states: tuple[list[torch.Tensor], ...] | None = None,
            windows: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
            tile: dict[str, int] | None = None) -> None:
    """In-place ``commit_state_ref`` and ``commit_window_ref`` of every layer, one launch: sequence ``b`` keeps the
    path of its first ``length[b]`` entries of ``path [B, P]`` (node numbers, root first; ``length`` 0: untouched;
    either may be a strided view, ``path``'s rows contiguous). ``states = (states, k_hats, us, gs)``: per layer
    ``state [B,HV,V,K]`` fp32 and the factors of the ``Nt`` verified nodes (``k_hat [B,Nt,H,K]``, ``u [B,Nt,HV,V]``,
    ``g [B,Nt,HV]``, fp32); ``windows = (xs, windows)``: per layer ``x [B,Nt,D]`` raw inputs and ``window [B,D,W]``
    (newest last). Each list contiguous and of one shape across layers; either part may be ``None``. ``tile``
    overrides ``commit_tile``'s entries, and ``ALIGN=1`` drops the 128-bit accesses that 16-byte-aligned tensors get
    (benchmarks: the unhinted kernel)."""
    B, P = path.shape
    if path.stride(1) != 1:
        path = path.contiguous()
    if length.shape != (B,):
        raise ValueError(f"the path's length must be one count per sequence [{B}], got {tuple(length.shape)}")
    tile = {**commit_tile(P), **(tile or {})}
    BP = tile["BP"]
    tables, n_state, n_window = [], 0, 0
    shape = dict(H=1, HV=1, K=16, V=16, BK=16, BV=16, X_DTYPE=tl.float32, W_DTYPE=tl.float32, W=1, BW=1, BD=16)
    if states is not None:
        for ts, what in zip(states, ("state", "k_hat", "u", "g")):
            _same(ts, what, torch.float32)
        _, HV, V, K = states[0][0].shape
        Nt, H = states[1][0].shape[1:3]
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
        Nt = xs[0].shape[1]
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
        *(t for t, _ in tables), path, length, path.stride(0), length.stride(0), P, Nt, B * shape["HV"], B, D,
        n_state, BP=BP, LONG=P > BP, ALIGN=align, **shape, num_warps=tile["num_warps"],
    )


@triton.jit(do_not_specialize=["s_path", "s_len", "P", "B", "C", "D"])
def commit_kv_kernel(buffer_ptrs, committed_ptrs, path, length, s_path, s_len, P, B, C, D,
                     H: tl.constexpr, DTYPE: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr,
                     ALIGN: tl.constexpr):
    # program: one [path, BD] block of one head's rows in one buffer (the layers' keys and values alternate in the
    # table); every row is read before any is written, as a path node's entry may sit where an earlier one goes
    ND = tl.cdiv(D, BD)
    pid = tl.program_id(0)
    i_tbh, i_d = pid // ND, pid % ND
    i_t, i_bh = i_tbh // (B * H), i_tbh % (B * H)
    i_b = i_bh // H
    n_path = tl.load(length + i_b * s_len).to(tl.int32)
    if n_path > 0:
        buffer = _base(buffer_ptrs, i_t, DTYPE, ALIGN)
        start = tl.load(tl.load(committed_ptrs + i_t // 2).to(tl.pointer_type(tl.int64)) + i_b)
        slot = tl.arange(0, BP)
        node = tl.load(path + i_b * s_path + slot, mask=slot < P, other=0)
        moved = (slot < n_path) & (node != slot)
        o_d = i_d * BD + tl.arange(0, BD)
        m = moved[:, None] & (o_d < D)[None, :]
        rows = buffer + (i_bh.to(tl.int64) * C + start) * D
        entries = tl.load(rows + node[:, None].to(tl.int64) * D + o_d[None, :], mask=m)
        tl.debug_barrier()
        tl.store(rows + slot[:, None].to(tl.int64) * D + o_d[None, :], entries, mask=m)


def commit_kv_(path: torch.Tensor, length: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               committed: list[torch.Tensor]) -> None:
    """``commit_kv_ref`` in place on every attention layer's key and value buffers, one launch: per layer
    ``keys``/``values [B, KV heads, capacity, D]`` (contiguous, one shape and dtype across layers) and its committed
    positions ``committed [B]`` (int64), the path as ``commit_`` takes it. The committed counts are not advanced
    (every program reads them): the caller adds ``length`` after."""
    B, P = path.shape
    if path.stride(1) != 1:
        path = path.contiguous()
    buffers = [t for pair in zip(keys, values) for t in pair]
    _same(buffers, "key and value buffer")
    _same(committed, "committed length", torch.int64)
    if length.shape != (B,) or committed[0].shape != (B,) or buffers[0].shape[0] != B:
        raise ValueError(f"a path of {B} sequences needs one length and one committed count per sequence, and "
                         f"buffers of {B} sequences")
    _, H, C, D = buffers[0].shape
    BP = triton.next_power_of_2(P)
    BD = min(triton.next_power_of_2(D), max(16, 8192 // BP))      # at most 8192 entries a program holds
    (table, align), (committed_table, _) = _address_table(buffers), _address_table(committed)
    commit_kv_kernel[(len(buffers) * B * H * triton.cdiv(D, BD),)](
        table, committed_table, path, length, path.stride(0), length.stride(0), P, B, C, D,
        H=H, DTYPE=TL_DTYPES[buffers[0].dtype], BP=BP, BD=BD, ALIGN=align, num_warps=4)
