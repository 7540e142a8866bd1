"""Triton kernel: the gated delta rule over a token tree, in one pass from the committed state.

Semantics are those of :func:`specla_kernels.reference.tree_gated_delta_rule_ref` (without ``prefix``). For one value
head, with ``A(i)`` the ancestors of node ``i`` (itself included) and ``Γ_i = Σ_{j∈A(i)} g_j``:

    (I + L) U = R,   L_ij = β_i e^{Γ_i-Γ_j} (k̂_i·k̂_j)  for j a strict ancestor of i,
                     R_i = β_i (v_i - e^{Γ_i} S₀ k̂_i)
    o_i = e^{Γ_i} S₀ q̂_i + Σ_{j∈A(i)} e^{Γ_i-Γ_j} (q̂_i·k̂_j) u_j

which is one chunk of fla's WY/UT form with the causal mask replaced by the ancestor mask. One program owns one
(batch, value head, block of V) and keeps every N x N quantity in registers: nothing per node but ``o``, ``u`` and
``k̂`` is written, and the only large read is the committed state, once.

How the pieces are computed, and why:
- Ancestor mask: ``M = I + P`` (``P`` the one-hot parent matrix) squared ``ceil(log2 N)`` times with exact fp16 dots
  (entries are path counts <= N, clipped to 1 after each product): log-depth, tensor cores, no gathers. One small
  kernel (``tree_ancestors``) builds it once per tree and every layer's verify loads it, rather than every program
  of every layer rebuilding it.
- k and q are l2-normalised *after* the products (``k̂_i·k̂_j = (k_i·k_j) r_i r_j``), so the K loop multiplies the raw
  inputs: for bf16 inputs these products are exact in bf16 dots with fp32 accumulation. The fp32 state is split into
  two bf16 halves (hi + lo, ~16 mantissa bits) for ``S₀k`` and ``S₀q``, and the solve's fp32 products are three bf16
  products of such halves (bf16x3, ``_dot3``); fp32/fp16 inputs use tf32x3 dots instead.
- The solve: ``I + L = (I + L_D)(I + X L_O)`` with ``L_D`` its BC x BC diagonal blocks and ``X = (I + L_D)^{-1}``.
  ``X`` is built for all blocks at once on a ``[NC, BC, BC]`` view by block doubling: the inverse over diagonal
  blocks of size 2^l becomes the inverse over blocks of size 2^(l+1) as ``X - X E X`` (``E`` the part of ``L_D``
  joining the two halves; ``E X E = 0``, so this is exact), ``log2 BC`` levels of two batched dots in place of
  BC - 1 steps of forward substitution, each of which needs two cross-warp reductions (on the H200, 21 layers at 64
  nodes: 416 µs against 481 with forward substitution). Unlike a Neumann product, no power of ``L`` is formed
  (their entries grow like binomial coefficients on repeated tokens and lose fp32 precision;
  ``tests/test_kernels.py`` has that case); then ``U = XR - (X L_O) U`` is resolved block row by block row
  (``NC - 1`` dots), like fla's 16x16 merge in ``solve_tril`` but without leaving registers. Padded nodes
  (N < BN) have zero k and v and no descendants, so they stay zero and are masked on store.
- Or, for trees of depth <= 16 at the sizes ``tuning``'s ``tree_sweeps`` names (64 and 128 nodes), by depth sweeps: ``L`` is
  nilpotent of the tree's depth, so that many sweeps of ``U <- R - L U`` solve it exactly (``_sweep_solve``); deeper
  trees take the block solve in the same kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from specla_kernels import pdl, tuning


@triton.jit
def ancestor_mask(p_n, rows, n_sq, BN: tl.constexpr):
    """``anc[i, j]`` (bool ``[BN, BN]``): node ``j`` is node ``i`` or one of its ancestors (parent pointers ``p_n``).

    ``M = I + P`` covers paths of length <= 1 and each clipped square doubles that, so ``n_sq = ceil(log2 N)`` squares
    cover the tree; fp16 holds the 0/1 operands and the fp32 accumulator the path counts (<= N) exactly.
    """
    b_m = ((rows[:, None] == rows[None, :]) | (p_n[:, None] == rows[None, :])).to(tl.float16)
    for _ in range(n_sq):
        b_m = tl.minimum(tl.dot(b_m, b_m), 1.0).to(tl.float16)
    return b_m > 0


@triton.jit(do_not_specialize=["N", "n_sq"])
def ancestors_kernel(parents, anc, N, n_sq, BN: tl.constexpr):
    """One sequence's ``anc [N, N]`` (bool) from its parent pointers."""
    i_b = tl.program_id(0)
    rows = tl.arange(0, BN)
    m_n = rows < N
    p_n = tl.load(parents + i_b * N + rows, mask=m_n, other=-1).to(tl.int32)
    tl.store(anc + (i_b * N + rows[:, None]).to(tl.int64) * N + rows[None, :], ancestor_mask(p_n, rows, n_sq, BN),
             mask=m_n[:, None] & m_n[None, :])


_LONE: dict[tuple[torch.device, int], torch.Tensor] = {}     # [B, 1, 1] True: the mask of B one-node trees


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``tree_ancestors`` (reference): ``anc [B, N, N]`` bool, one program per sequence. One node is
    its own only ancestor (its parent can only be the committed state): its mask is a kept constant, no launch (with
    the launch a one-token verify of 21 layers took 1.05x fla's one-token recurrence on the H200). Callers only read
    the mask. Under CUDA-graph capture a constant not yet made is not made there (a graph's fill runs at replay)."""
    B, N = parents.shape
    if not 1 <= N <= 128:
        raise ValueError(f"one tree chunk holds 1..128 nodes, got {N}")
    key = (parents.device, B)
    if N == 1 and (key in _LONE or not (parents.is_cuda and torch.cuda.is_current_stream_capturing())):
        if key not in _LONE:
            _LONE[key] = torch.ones(B, 1, 1, dtype=torch.bool, device=parents.device)
        return _LONE[key]
    anc = torch.empty(B, N, N, dtype=torch.bool, device=parents.device)
    BN = max(16, triton.next_power_of_2(N))
    ancestors_kernel[(B,)](parents.contiguous(), anc, N, (N - 1).bit_length(), BN=BN, num_warps=4 if BN <= 32 else 8)
    return anc


# Whether Triton runs these kernels in its interpreter (TRITON_INTERPRET=1 when Triton was imported)
INTERPRETED = isinstance(ancestor_mask, InterpretedFunction)
# read inside kernels (a plain global cannot be): the interpreter multiplies bf16 tl.dot operands as their raw uint16
# bits, so _mma widens them there (the same products: a bf16 x bf16 product is exact in fp32)
_WIDEN_BF16_DOTS = tl.constexpr(INTERPRETED)


# inline PTX does not run in the interpreter
_PTX = tl.constexpr(not INTERPRETED)


@triton.jit
def _prefetch_l1(ptrs):
    """Bring the lines at ``ptrs`` into L1 without waiting for them (``prefetch.global.L1``): a later load of them
    hits L1, and nothing before it waits on the memory latency."""
    if _PTX:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _load_rows(p_rows, cols, m):
    """The ``[len(cols), len(cols)]`` bytes at row starts ``p_rows``, rows and columns masked by ``m``."""
    return tl.load(p_rows[:, None] + cols[None, :], mask=m[:, None] & m[None, :], other=0)


@triton.jit
def _mma(a, b, acc):
    """``acc + a @ b`` for bf16 ``a`` and ``b``: tensor-core products, exact in the fp32 accumulator."""
    if _WIDEN_BF16_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _split_bf16(x):
    """fp32 ``x`` as two bf16 halves ``hi + lo`` (~16 mantissa bits together)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot3(a_hi, a_lo, b, acc):
    """``acc + a @ b`` for fp32 ``b`` and ``a`` given as its ``_split_bf16`` halves: three bf16 products
    (``a_hi b_hi + a_hi b_lo + a_lo b_hi``; relative error ~2^-16)."""
    b_hi, b_lo = _split_bf16(b)
    return _mma(a_hi, b_hi, _mma(a_hi, b_lo, _mma(a_lo, b_hi, acc)))


@triton.jit
def _dot(a, b, BF16X3: tl.constexpr):
    """``a @ b`` for fp32 ``a`` and ``b``: three bf16 products (``_dot3``) or three tf32 ones (tf32x3, ~2^-21)."""
    if BF16X3:
        a_hi, a_lo = _split_bf16(a)
        return _dot3(a_hi, a_lo, b, None)
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _block_solve(b_l, b_r, rows, N, n_lvl, BN: tl.constexpr, BC: tl.constexpr, BF16X3: tl.constexpr):
    """``U`` with ``(I + L) U = R`` for any unit lower triangular ``I + L`` (module docstring: block doubling for the
    diagonal blocks' inverses ``X``, then ``U = XR - (X L_O) U`` block row by block row); products by ``_dot``."""
    NC: tl.constexpr = BN // BC
    # X = (I + L_D)^{-1} for every BC x BC diagonal block at once, on a [NC, BC, BC] view
    blk = rows // BC
    same_blk = blk[:, None] == blk[None, :]
    if NC == 1:
        l_diag = tl.reshape(b_l, [1, BC, BC])
    else:
        l_diag = tl.sum(tl.reshape(tl.where(same_blk, b_l, 0.), [NC, BC, NC, BC]), 2)   # other blocks are 0
    i3 = tl.arange(0, BC)[None, :, None]
    j3 = tl.arange(0, BC)[None, None, :]
    x3 = tl.where(i3 == j3, 1., 0.) + tl.zeros([NC, BC, BC], dtype=tl.float32)
    # X inverts I + L_D restricted to diagonal blocks of size 2^lvl; adding the next level's off-diagonal half E
    # (rows in the lower, columns in the upper 2^lvl of each 2^(lvl+1) block) gives X - X E X exactly (E X E = 0)
    for lvl in range(n_lvl):
        e3 = tl.where(((i3 >> (lvl + 1)) == (j3 >> (lvl + 1))) & ((i3 >> lvl) != (j3 >> lvl)), l_diag, 0.)
        x3 = x3 - _dot(_dot(x3, e3, BF16X3), x3, BF16X3)

    if NC == 1:
        b_u = _dot(tl.reshape(x3, [BN, BN]), b_r, BF16X3)
    else:
        c_a = tl.arange(0, NC)[:, None, None, None]
        c_b = tl.arange(0, NC)[None, None, :, None]
        b_x = tl.reshape(tl.where(c_a == c_b, x3[:, :, None, :], 0.), [BN, BN])       # block diagonal
        # (I + L_D) U = R - L_O U  =>  U = XR - (X L_O) U, resolved one block row at a time
        b_xl = _dot(b_x, tl.where(same_blk, 0., b_l), BF16X3)
        b_xr = _dot(b_x, b_r, BF16X3)
        b_u = b_xr
        for c in range(1, tl.cdiv(N, BC)):
            b_u = tl.where((blk == c)[:, None], b_xr - _dot(b_xl, b_u, BF16X3), b_u)
    return b_u


@triton.jit
def _sweep_solve(b_l, b_r, depth, BF16X3: tl.constexpr):
    """``U`` with ``(I + L) U = R`` by sweeps of ``U <- R - L U`` from ``U = R``, for ``L`` ancestor-masked on a tree
    of depth ``depth``. ``L_ij != 0`` only for ``j`` a strict ancestor of ``i``, so after sweep ``t`` every node of
    depth <= t holds its final ``u``: its ancestors' were final one sweep earlier, and it is then computed from them
    exactly as forward substitution would (the other nodes' intermediate values are partial Neumann sums, bounded for
    the shallow trees this runs on, which enter a final row only multiplied by an exact zero of ``L``). A sweep is one
    dot over the whole tree: ``depth`` dependent dots in place of the block solve's ``2 log2 BC + NC`` (drafted trees
    are wide and shallow: depth 8 for the default 63-node tree).
    With ``BF16X3`` the matrix is split into bf16 halves once and each sweep accumulates ``-L U`` onto ``R``
    (``_dot3``): the split of ``U``, its store to shared memory and 3 x BN/16 wgmma instructions, 123 instructions a
    warp at 64 nodes against 372 for tf32x3, which re-converted ``L``'s register layout every sweep (sm_90 SASS,
    Triton 3.6); on the H200 that halved a sweep's time. (Two levels a sweep, ``(I - L^2)^-1 (I - L)``, are not used:
    their iterates lose ~300x more precision on repeated keys, 3e-2 in bf16x3.)"""
    b_u = b_r
    if BF16X3:
        a_hi, a_lo = _split_bf16(-b_l)
        for _ in range(depth):
            b_u = _dot3(a_hi, a_lo, b_u, b_r)
    else:
        for _ in range(depth):
            b_u = b_r - tl.dot(b_l, b_u, input_precision="tf32x3")
    return b_u


@triton.jit(do_not_specialize=["N", "n_lvl"])   # one binary per padded size, whatever N is
def tree_gdn_fwd_kernel(
    q, k, v, g, beta, ancestors, h0,       # inputs (ancestors: [B, N, N] bool, from tree_ancestors)
    o, k_hat, u,                           # outputs
    scale, N, n_lvl,                       # n_lvl = ceil(log2(min(N, BC))): doubling levels of the diagonal solve
    n_anc,                                 # N again, specialised (N is not): when it is a multiple of 16 (a decode
                                           # bucket) the ancestor mask's rows load as 16-byte vectors, not bytes
    stride_qt, stride_kt, stride_vt,       # elements between consecutive tokens of q, k, v (views of a wider tensor)
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,                      # nodes, padded to a power of two >= 16 (tl.dot needs 16)
    BC: tl.constexpr,                      # diagonal block of the solve
    BK: tl.constexpr,                      # K chunk of the contraction loop
    BV: tl.constexpr,                      # V slice owned by this program
    BF16_DOT: tl.constexpr,                # inputs are bf16: exact bf16 products, state split hi/lo, the solve's
                                           # products bf16x3 (_dot3); else tf32x3
    OUT_FP32: tl.constexpr,                # o is fp32: its last product also in tf32x3
    LATE_QK: tl.constexpr,                 # form q.k after the solve (see tree_config)
    SWEEP_MAX: tl.constexpr,               # trees of depth <= this solve by sweeps (_sweep_solve); 0: never
    ANC_LATE: tl.constexpr,                # the ancestor mask loaded after the K loop (prefetched into L1 before it)
    PDL: tl.constexpr,                     # launched with PDL (tuning's pdl_small_kernels)
):
    pdl.allow_dependents(PDL)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    NV: tl.constexpr = (V + BV - 1) // BV

    rows = tl.arange(0, BN)
    m_n = rows < N
    tok = (i_b * N + rows).to(tl.int64)            # token index into [B, N, ...]
    p_k = k + tok[:, None] * stride_kt + i_h * K

    if i_v == NV:
        # one extra program per key head writes k̂, off the critical path of the others
        pdl.wait_for_inputs(PDL)
        if i_hv % (HV // H) == 0:
            nk = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                b_k = tl.load(p_k + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :], other=0.).to(tl.float32)
                nk += tl.sum(b_k * b_k, 1)
            nrm = tl.sqrt(nk + 1e-6)
            for k0 in range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                m_nk = m_n[:, None] & (o_k < K)[None, :]
                b_k = tl.load(p_k + o_k[None, :], mask=m_nk, other=0.).to(tl.float32)
                tl.store(k_hat + (tok[:, None] * H + i_h) * K + o_k[None, :], b_k / nrm[:, None], mask=m_nk)
    else:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_q = q + tok[:, None] * stride_qt + i_h * K
        # the small operands are requested first and used only after the K loop, so that their memory latency
        # overlaps the loop's instead of preceding it. The ancestor mask (built before the pass: pdl.py) is the
        # exception: Triton converts its layout through shared memory right at the load, so the load is waited for
        # there, before the loop's own loads are issued; with ANC_LATE it is prefetched into L1 here and loaded after
        # the loop (tree_config says where that pays)
        p_anc = ancestors + (i_b * n_anc + rows).to(tl.int64) * n_anc
        m_anc = rows < n_anc
        if ANC_LATE:
            _prefetch_l1(p_anc)
        else:
            anc_early = _load_rows(p_anc, rows, m_anc)
        pdl.wait_for_inputs(PDL)
        g_raw = tl.load(g + tok * HV + i_hv, mask=m_n, other=0.)
        beta_raw = tl.load(beta + tok * HV + i_hv, mask=m_n, other=0.)
        v_raw = tl.load(v + tok[:, None] * stride_vt + i_hv * V + o_v[None, :], mask=m_n[:, None] & m_v[None, :],
                        other=0.)

        # ---- one pass over K: raw k.k, k.S0, q.S0 (and q.k unless it is deferred; q's squared norms with q.k). k's
        # are the diagonal of k.k: k never leaves shared memory for registers (summing its squares from a register
        # copy made the loop's body half again as long in sm_90 instructions). q's are summed, not formed as a q.q dot
        # beside q.k: in the deferred pass that dot gave a wrong o on the H200 with Triton 3.6 where the kernel had
        # the block solve alone, at 64 and 128 nodes
        b_kk = tl.zeros([BN, BN], dtype=tl.float32)
        b_qk = tl.zeros([BN, BN], dtype=tl.float32)
        nq = tl.zeros([BN], dtype=tl.float32)
        b_ks = tl.zeros([BN, BV], dtype=tl.float32)
        b_qs = tl.zeros([BN, BV], dtype=tl.float32)
        p_h0 = h0 + i_bh.to(tl.int64) * V * K
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            m_nk = m_n[:, None] & m_k[None, :]
            b_k = tl.load(p_k + o_k[None, :], mask=m_nk, other=0.)
            b_q = tl.load(p_q + o_k[None, :], mask=m_nk, other=0.)
            b_s = tl.load(p_h0 + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0.)
            b_qf = b_q.to(tl.float32)            # (the bf16 branch with LATE_QK does not use it: no code)
            if not LATE_QK:
                nq += tl.sum(b_qf * b_qf, 1)
            if BF16_DOT:
                s_hi, s_lo = _split_bf16(b_s)
                b_kk = _mma(b_k, tl.trans(b_k), b_kk)
                b_ks = _mma(b_k, tl.trans(s_hi), _mma(b_k, tl.trans(s_lo), b_ks))
                b_qs = _mma(b_q, tl.trans(s_hi), _mma(b_q, tl.trans(s_lo), b_qs))
                if not LATE_QK:
                    b_qk = _mma(b_q, tl.trans(b_k), b_qk)
            else:
                b_kf = b_k.to(tl.float32)
                b_kk += tl.dot(b_kf, tl.trans(b_kf), input_precision="tf32x3")
                b_ks += tl.dot(b_kf, tl.trans(b_s), input_precision="tf32x3")
                b_qs += tl.dot(b_qf, tl.trans(b_s), input_precision="tf32x3")
                if not LATE_QK:
                    b_qk += tl.dot(b_qf, tl.trans(b_kf), input_precision="tf32x3")
        anc = (_load_rows(p_anc, rows, m_anc) if ANC_LATE else anc_early) != 0
        b_g = g_raw.to(tl.float32)
        b_beta = beta_raw.to(tl.float32)
        b_vv = v_raw.to(tl.float32)
        eye = rows[:, None] == rows[None, :]
        rk = 1. / tl.sqrt(tl.sum(tl.where(eye, b_kk, 0.), 1) + 1e-6)

        # ---- topology: path log-decay Γ, pairwise decay e^{Γ_i - Γ_j} on ancestor pairs
        gam = tl.sum(tl.where(anc, b_g[None, :], 0.), 1)
        eg = tl.exp(gam)
        # Γ_i - Γ_j <= 0 on ancestor pairs; clamp before exp so that non-ancestor pairs cannot overflow
        decay = tl.where(anc, tl.exp(tl.minimum(gam[:, None] - gam[None, :], 0.)), 0.)
        if not LATE_QK:
            b_p = decay * b_qk

        # ---- right-hand side and the ancestor-masked system (I + L) U = R
        b_r = b_beta[:, None] * (b_vv - (eg * rk)[:, None] * b_ks)
        b_l = tl.where(eye, 0., (b_beta * rk)[:, None] * decay * b_kk * rk[None, :])

        # the block solve's products stay tf32x3 from 64 nodes: in bf16x3 they gave a wrong u there on the H200
        # (Triton 3.6; the sweeps' bf16x3 products are right at every size, GPU-tested)
        if SWEEP_MAX > 0:
            # the tree's depth (root 0): L^(depth+1) = 0, so that many sweeps solve it exactly (_sweep_solve)
            depth = tl.max(tl.sum(anc.to(tl.int32), 1), 0) - 1
            if depth <= SWEEP_MAX:
                b_u = _sweep_solve(b_l, b_r, depth, BF16_DOT)
            else:
                b_u = _block_solve(b_l, b_r, rows, N, n_lvl, BN, BC, BF16_DOT and BN <= 32)
        else:
            b_u = _block_solve(b_l, b_r, rows, N, n_lvl, BN, BC, BF16_DOT and BN <= 32)

        # ---- outputs: o = e^Γ S0 q̂ + (ancestor-masked decayed q̂ k̂^T) U
        if LATE_QK:
            for k0 in range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                m_nk = m_n[:, None] & (o_k < K)[None, :]
                b_k = tl.load(p_k + o_k[None, :], mask=m_nk, other=0.)
                b_q = tl.load(p_q + o_k[None, :], mask=m_nk, other=0.)
                b_qf = b_q.to(tl.float32)
                nq += tl.sum(b_qf * b_qf, 1)
                if BF16_DOT:
                    b_qk = _mma(b_q, tl.trans(b_k), b_qk)
                else:
                    b_qk += tl.dot(b_qf, tl.trans(b_k.to(tl.float32)), input_precision="tf32x3")
            b_p = decay * b_qk
        rq = scale / tl.sqrt(nq + 1e-6)
        b_p = rq[:, None] * b_p * rk[None, :]
        if OUT_FP32:
            b_o = tl.dot(b_p, b_u, input_precision="tf32x3")
        else:
            b_o = tl.dot(b_p, b_u)
        b_o += (eg * rq)[:, None] * b_qs
        m_nv = m_n[:, None] & m_v[None, :]
        p_nv = (tok[:, None] * HV + i_hv) * V + o_v[None, :]
        tl.store(u + p_nv, b_u, mask=m_nv)
        tl.store(o + p_nv, b_o.to(o.dtype.element_ty), mask=m_nv)


@triton.jit(do_not_specialize=["N"])
def tree_gdn_small_kernel(
    q, k, v, g, beta, ancestors, h0,       # as tree_gdn_fwd_kernel
    o, k_hat, u,
    scale, N, stride_qt, stride_kt, stride_vt,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,                      # nodes, padded to a power of two (a handful: the loop is unrolled)
    KP: tl.constexpr,                      # K padded to a power of two: the whole key in registers
    BV: tl.constexpr,                      # V slice owned by this program
    PDL: tl.constexpr,
):
    """The same outputs for a few nodes, node by node in fp32 without tensor cores (``tl.dot`` pads to 16 nodes):
    ``u_i = β_i (v_i - e^{Γ_i} S₀k̂_i - Σ_{j strict ancestor} e^{Γ_i-Γ_j} (k̂_i·k̂_j) u_j)``, then ``o_i`` as above.
    A program reads its ``[BV, K]`` slice of the state once; the programs of V slice 0 write k̂. With PDL the state
    slice and the ancestor mask are requested before waiting for the kernel before (pdl.py)."""
    pdl.allow_dependents(PDL)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    rows = tl.arange(0, BN)
    m_n = rows < N
    tok = (i_b * N + rows).to(tl.int64)
    o_k = tl.arange(0, KP)
    m_nk = m_n[:, None] & (o_k < K)[None, :]
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_s = tl.load(h0 + i_bh.to(tl.int64) * V * K + o_v[:, None] * K + o_k[None, :],
                  mask=m_v[:, None] & (o_k < K)[None, :], other=0.)
    anc = tl.load(ancestors + (i_b * N + rows[:, None]).to(tl.int64) * N + rows[None, :],
                  mask=m_n[:, None] & m_n[None, :], other=0) != 0
    pdl.wait_for_inputs(PDL)
    b_k = tl.load(k + tok[:, None] * stride_kt + i_h * K + o_k[None, :], mask=m_nk, other=0.).to(tl.float32)
    b_q = tl.load(q + tok[:, None] * stride_qt + i_h * K + o_k[None, :], mask=m_nk, other=0.).to(tl.float32)
    b_vv = tl.load(v + tok[:, None] * stride_vt + i_hv * V + o_v[None, :], mask=m_n[:, None] & m_v[None, :],
                   other=0.).to(tl.float32)
    b_g = tl.load(g + tok * HV + i_hv, mask=m_n, other=0.).to(tl.float32)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=m_n, other=0.).to(tl.float32)
    b_kh = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_qh = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6))[:, None]
    if (i_v == 0) & (i_hv % (HV // H) == 0):
        tl.store(k_hat + (tok[:, None] * H + i_h) * K + o_k[None, :], b_kh, mask=m_nk)
    gam = tl.sum(tl.where(anc, b_g[None, :], 0.), 1)
    decay = tl.where(anc, tl.exp(tl.minimum(gam[:, None] - gam[None, :], 0.)), 0.)
    b_u = tl.zeros([BN, BV], dtype=tl.float32)
    # parents precede children: when node i is reached, the u of its ancestors are final (the others still zero;
    # padded nodes have zero k, v and β, so their u stays zero and their o is masked)
    for i in tl.static_range(BN):
        sel = rows == i
        kh_i = tl.sum(tl.where(sel[:, None], b_kh, 0.), 0)
        qh_i = tl.sum(tl.where(sel[:, None], b_qh, 0.), 0)
        d_i = tl.sum(tl.where(sel[:, None], decay, 0.), 0)                    # e^{Γ_i-Γ_j} over ancestors j
        eg_i = tl.exp(tl.sum(tl.where(sel, gam, 0.), 0))
        w_k = tl.where(rows != i, d_i * tl.sum(b_kh * kh_i[None, :], 1), 0.)
        r_i = tl.sum(tl.where(sel[:, None], b_vv, 0.), 0) - eg_i * tl.sum(b_s * kh_i[None, :], 1)
        u_i = tl.sum(tl.where(sel, b_beta, 0.), 0) * (r_i - tl.sum(w_k[:, None] * b_u, 0))
        b_u = tl.where(sel[:, None], u_i[None, :], b_u)
        w_q = d_i * tl.sum(b_kh * qh_i[None, :], 1)
        o_i = eg_i * tl.sum(b_s * qh_i[None, :], 1) + tl.sum(w_q[:, None] * b_u, 0)
        p_i = ((i_b * N + i).to(tl.int64) * HV + i_hv) * V + o_v
        m_i = m_v & (tl.full([BV], i, tl.int32) < N)     # (a vector compare: see commit._path)
        tl.store(u + p_i, u_i, mask=m_i)
        tl.store(o + p_i, o_i.to(o.dtype.element_ty), mask=m_i)


def tree_config(n: int, v_dim: int, dtype: torch.dtype = torch.bfloat16, small: bool | None = None) -> dict[str, int]:
    """Launch shape for ``n`` nodes. Up to ``tree_small_max`` nodes (``tuning``), or with ``small``, the node-by-node
    kernel: padded node count BN, V slice BV and warps. Otherwise the WY/UT kernel: BN, solve block BC, K chunk BK, V slice BV, warps
    and the K loop's pipeline stages.

    Every program is a chain of dependent steps (loads, K loop, mask, solve, output), so latency, not bandwidth, sets
    the time. For bf16 inputs (how models run) the shapes are the fastest of the sweep in benchmarks/bench_kernels.py
    on an H200 (Triton 3.6, 1.3B shape), each checked there against the reference: few warps per program win, and
    8 warps pay only at BN = 128 where the [BN, BN] tiles need the registers. Other dtypes keep the shapes their GPU
    tests ran with (their tf32x3 branch holds more registers). q.k is formed in the K loop beside k.k, or after the
    solve in a pass of its own (LATE_QK, four reloads of k and q: it frees a [BN, BN] tile during the solve).
    """
    tune = tuning.active()
    if small if small is not None else n <= tune.tree_small_max:
        if n > 8:
            raise ValueError(f"the node-by-node kernel unrolls its loop over the nodes: at most 8, got {n}")
        # one warp on an 8-wide V slice: the fastest of the H200 sweep at 2-8 nodes (more programs, each a short
        # chain; 16-32 wide slices or more warps took 1.1-2.5x as long); a 4-wide slice for one node (21 layers: 85.0
        # against 90.0 us at 8 wide, fla's one-token recurrence 86.9 in the same run)
        return dict(SMALL=True, BN=triton.next_power_of_2(n), BV=4 if n == 1 else 8, num_warps=1)
    BN = max(16, triton.next_power_of_2(n))
    BK = 64
    stages = 3                        # Triton's default software pipelining of the K loop
    if dtype == torch.bfloat16:
        # H200 sweeps when these were chosen (two runs each, 21 layers): 4 stages at 16 nodes 222 -> 212 us, 2 warps
        # at 32 nodes 311 -> 303 us
        BC, BV, warps = {16: (16, 16, 2), 32: (16, 32, 2), 64: (16, 32, 4), 128: (16, 32, 8)}[BN]
        BK = 32 if BN <= 32 else 64   # H200 sweep when chosen: 21 layers 357 -> 309 us at 32 nodes with BK 32
        stages = 4 if BN == 16 else 3
        # H200, 21 layers, drafted trees of depth 8: q.k in the K loop at 64 nodes 288 us against 312 after the solve,
        # and after the solve at 128 nodes (786-790 against 865). (With Triton 3.6 a K loop that held k in registers
        # gave a wrong q.k at 64 nodes; this one, k only in shared memory, gives the right one, GPU-tested)
        late_qk = BN >= 128
    else:
        BC, BV, warps = {16: (16, 16, 4), 32: (16, 16, 4), 64: (16, 32, 8), 128: (32, 32, 8)}[BN]
        late_qk = BN >= 64
    # the ancestor mask after the K loop (ANC_LATE) or before it (H200, bf16, 21 layers, drafted trees, timed before
    # q.k moved into the K loop at 64 nodes): after at 64 nodes (311 against 318 us) and 128 (784 against 923), before
    # at 32 (239 against 252); 16 nodes was timed only with the late load
    return dict(SMALL=False, BN=BN, BC=BC, BK=BK, BV=min(BV, max(16, triton.next_power_of_2(v_dim))),
                num_warps=warps, num_stages=stages, LATE_QK=late_qk, SWEEP_MAX=tune.tree_sweeps.get(BN, 0),
                ANC_LATE=BN != 32)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [B, N, heads, dim]`` as is if its tokens are evenly spaced rows of contiguous heads, else a contiguous
    copy."""
    B, N, heads, dim = x.shape
    if x.stride(-1) == 1 and x.stride(-2) == dim and (B == 1 or N == 1 or x.stride(0) == N * x.stride(1)):
        return x
    return x.contiguous()


def _token_stride(x: torch.Tensor) -> int:
    """Elements between token ``t`` and ``t + 1`` of the flattened ``[B * N]`` tokens of a ``_token_rows`` tensor."""
    return x.stride(0) if x.shape[1] == 1 else x.stride(1)


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    ancestors: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``tree_gated_delta_rule_ref``: returns ``o [B,N,HV,V]`` (dtype of v), ``k_hat [B,N,H,K]`` and
    ``u [B,N,HV,V]`` (fp32), writing no per-node state. ``ancestors``: ``tree_ancestors(parents)`` when the caller
    has it (a model's layers share one tree); ``config`` overrides entries of ``tree_config`` (tuning)."""
    if prefix is not None:
        raise ValueError("tree_gated_delta_rule (Triton) does not take `prefix`; use tree_gated_delta_rule_ref")
    B, N, H, K = k.shape
    HV, V = v.shape[-2:]
    if not 1 <= N <= 128:
        raise ValueError(f"one tree chunk holds 1..128 nodes, got {N}")
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    scale = K ** -0.5 if scale is None else scale
    cfg = {**tree_config(N, V, k.dtype, small=(config or {}).get("SMALL")), **(config or {})}
    # q, k, v may be column slices of one conv output [B, N, D]: read in place (no copies) when each token's heads
    # are contiguous and tokens evenly spaced
    q, k, v = (_token_rows(t) for t in (q, k, v))
    if ancestors is None:
        ancestors = tree_ancestors(parents)
    elif ancestors.shape != (B, N, N) or ancestors.dtype != torch.bool:
        raise ValueError(f"ancestors must be a bool [{B}, {N}, {N}] tensor (tree_ancestors of the parents)")
    o = v.new_empty(B, N, HV, V)
    k_hat = k.new_empty(B, N, H, K, dtype=torch.float32)
    u = v.new_empty(B, N, HV, V, dtype=torch.float32)
    tensors = (q, k, v, g.contiguous(), beta.contiguous(), ancestors.contiguous(), initial_state.contiguous(),
               o, k_hat, u)
    strides = (_token_stride(q), _token_stride(k), _token_stride(v))
    on = pdl.small_enabled(q.device)
    if cfg["SMALL"]:
        tree_gdn_small_kernel[(triton.cdiv(V, cfg["BV"]), B * HV)](
            *tensors, scale, N, *strides, H=H, HV=HV, K=K, V=V, BN=cfg["BN"], KP=triton.next_power_of_2(K),
            BV=cfg["BV"], PDL=on, num_warps=cfg["num_warps"], launch_pdl=on)
        return o, k_hat, u
    # one column of programs per V slice, plus one that writes k̂
    grid = (triton.cdiv(V, cfg['BV']) + 1, B * HV)
    tree_gdn_fwd_kernel[grid](
        *tensors, scale, N, (min(N, cfg['BC']) - 1).bit_length(), N, *strides,
        H=H, HV=HV, K=K, V=V, BN=cfg['BN'], BC=cfg['BC'], BK=max(16, min(cfg['BK'], triton.next_power_of_2(K))),
        BV=cfg['BV'], BF16_DOT=k.dtype == q.dtype == torch.bfloat16,
        OUT_FP32=v.dtype == torch.float32, LATE_QK=cfg['LATE_QK'], SWEEP_MAX=cfg['SWEEP_MAX'],
        ANC_LATE=cfg['ANC_LATE'],
        PDL=on,
        num_warps=cfg['num_warps'],
        num_stages=cfg['num_stages'], launch_pdl=on,
    )
    return o, k_hat, u
