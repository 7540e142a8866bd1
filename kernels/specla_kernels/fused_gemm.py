"""Triton kernel: the verify pass's products ``y [M, N] = f(x [M, K]) @ W.T`` for the few token rows of a draft tree,
with the one-token GEMV's prologues and residual epilogue fused (``gemv.py``).

Semantics of :func:`specla_kernels.reference.fused_gemm_ref`: ``gemv_ref`` row by row, without the conv epilogue (a
tree's short conv follows its parents, ``tree_conv``). A verify pass through cuBLAS is 14 launches a GDN layer (two
norms, the gated norm, SwiGLU, the residual add and two split-K reductions beside the four GEMMs); fused, it is the
four products plus the tree conv, gates and tree verify.

One program owns ``BN`` output columns of every row (``MP`` = the rows padded to a power of two, at least 16, the
smallest ``tl.dot``) and one slice of ``K``, and walks it in ``BK`` steps: the weight tile ``[BK, BN]`` meets the rows'
right-hand side ``[MP, BK]``, computed from ``x`` on the way and rounded to the model dtype where the unfused op
rounds its output. A loop around ``tl.dot`` is software-pipelined, so weight tiles stream ``num_stages`` deep. With
several slices (``KS < K``: few output columns for the SMs, e.g. o_proj and down), each program writes fp32 partials
and the last program of a column block sums them in slice order (deterministic) and applies the epilogue, as the
GEMV's split-K does. A norm's statistic spans the row: every program takes it from all of ``x`` first (``M x K``
elements, cache-resident after the first program).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import pdl
from specla_kernels.gemv import (CONV, GATED_NORM, NORM, NORM_ADD, RESIDUAL, SWIGLU, _cold_bench, _epilogue,
                                 _gated_head_norm, _kinds)
from specla_kernels.masked_attention import _dot

MAX_ROWS = 64   # a tree bucket's nodes
MIN_GATED_HEAD = 16   # a gated norm's K step is one head, and tl.dot's K is at least 16


@triton.jit
def _row_stats(x, stride_x, x2, rows, m_rows, K, eps, PRO: tl.constexpr, MP: tl.constexpr, BK: tl.constexpr):
    """``1 / rms`` of each row of ``x`` (``+ x2`` for ``NORM_ADD``) over all ``K`` columns, fp32 ``[MP]``."""
    sum_sq = tl.zeros([MP], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = m_rows[:, None] & (cols < K)[None, :]
        xv = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.).to(tl.float32)
        if PRO == NORM_ADD:
            xv += tl.load(x2 + rows[:, None] * K + cols[None, :], mask=m, other=0.).to(tl.float32)
        sum_sq += tl.sum(xv * xv, 1)
    return 1 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def _rows_rhs(x, stride_x, x2, add_out, norm_w, gate, stride_g, eps, rstd, rows, m_rows, cols, m_cols, K,
              write_add, PRO: tl.constexpr, BK: tl.constexpr):
    """The right-hand side ``[MP, BK]`` at ``cols`` of every row, as the unfused op rounds it (``gemv._rhs``'s
    arithmetic)."""
    m = m_rows[:, None] & m_cols[None, :]
    at = rows[:, None] * stride_x + cols[None, :]
    xv = tl.load(x + at, mask=m, other=0.).to(tl.float32)
    if PRO == NORM_ADD:
        xv += tl.load(x2 + rows[:, None] * K + cols[None, :], mask=m, other=0.).to(tl.float32)
        if write_add:                                # the residual stream after the add, for the next residual
            tl.store(add_out + rows[:, None] * K + cols[None, :], xv.to(add_out.dtype.element_ty), mask=m)
    if PRO == NORM or PRO == NORM_ADD:
        rhs = xv * rstd[:, None] * tl.load(norm_w + cols, mask=m_cols, other=0.).to(tl.float32)[None, :]
    elif PRO == GATED_NORM:                          # a tile is one head (BK = the head size)
        gv = tl.load(gate + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.).to(tl.float32)
        rhs = _gated_head_norm(xv, gv, norm_w, eps, BK)
    elif PRO == SWIGLU:
        up = tl.load(x + at + K, mask=m, other=0.).to(tl.float32)
        rhs = xv * tl.sigmoid(xv) * up
    else:
        rhs = xv
    return rhs.to(x.dtype.element_ty)


@triton.jit
def fused_gemm_kernel(w, x, y, part, count, M, N, K, stride_w, stride_x, x2, add_out, norm_w, gate, stride_g,
                      eps, res, window, conv_w, conv_b, C, KS, PRO: tl.constexpr, EPI: tl.constexpr,
                      HAS_CONV_BIAS: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, MP: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, HD: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # program (b, s): output columns b * BN .. of every row, reduced over K columns s * KS .. (KS a multiple of BK).
    # HD: a gated norm's head size (= BK), 1 without one; the autotuner keys and prunes its launches by it
    pdl.allow_dependents(PDL)
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    S = tl.num_programs(1)
    rows = tl.arange(0, MP)
    m_rows = rows < M
    n = i_b * BN + tl.arange(0, BN)
    m_n = n < N
    k_lo = i_s * KS
    k_hi = tl.minimum(k_lo + KS + (KS == 0) * K, K)              # KS = 0: one slice, the whole row
    w_cols = w + n.to(tl.int64)[None, :] * stride_w
    # the first weight tile is requested before the wait (with PDL, while the previous kernel ends): weights depend
    # on no kernel; everything that reads an activation or writes comes after, as in the GEMV
    cols = k_lo + tl.arange(0, BK)
    m_cols = cols < k_hi
    wt = tl.load(w_cols + cols[:, None], mask=m_n[None, :] & m_cols[:, None], other=0.)
    pdl.wait_for_inputs(PDL)
    rstd = tl.zeros([MP], dtype=tl.float32)
    if PRO == NORM or PRO == NORM_ADD:
        rstd = _row_stats(x, stride_x, x2, rows, m_rows, K, eps, PRO, MP, BK)
    rhs = _rows_rhs(x, stride_x, x2, add_out, norm_w, gate, stride_g, eps, rstd, rows, m_rows, cols, m_cols, K,
                    i_b == 0, PRO, BK)
    acc = _dot(rhs, wt, IEEE)
    for k0 in range(k_lo + BK, k_hi, BK):
        cols = k0 + tl.arange(0, BK)
        m_cols = cols < k_hi
        wt = tl.load(w_cols + cols[:, None], mask=m_n[None, :] & m_cols[:, None], other=0.)
        rhs = _rows_rhs(x, stride_x, x2, add_out, norm_w, gate, stride_g, eps, rstd, rows, m_rows, cols, m_cols, K,
                        i_b == 0, PRO, BK)
        acc += _dot(rhs, wt, IEEE)
    at = rows[:, None] * N + n[None, :]
    keep = m_n                                                     # the output columns this program writes
    if S > 1:
        tl.store(part + i_s * M * N + at, acc, mask=m_rows[:, None] & m_n[None, :])
        # every thread's partial is written before one thread's counter update releases them (acq_rel, GPU scope)
        tl.debug_barrier()
        last = tl.atomic_add(count + i_b, 1, sem="acq_rel") == S - 1
        if last:
            acc = tl.zeros([MP, BN], dtype=tl.float32)
            for t in range(S):       # .cg: read at L2, where the other programs' partials are
                acc += tl.load(part + t * M * N + at, mask=m_rows[:, None] & m_n[None, :], other=0.,
                               cache_modifier=".cg")
            tl.atomic_xchg(count + i_b, 0)
        keep = keep & last                                         # the others' partials are in
    if EPI == CONV:       # one token: its row through the GEMV's epilogue (the window's one writer per column)
        row = tl.sum(tl.where(rows[:, None] == 0, acc, 0.), 0).to(y.dtype.element_ty)     # the GEMM's rounding
        row = _epilogue(row, n, keep, res, window, conv_w, conv_b, C, EPI, HAS_CONV_BIAS, W, WP)
        tl.store(y + n, row, mask=keep)
    else:
        m_out = m_rows[:, None] & keep[None, :]
        out = acc.to(y.dtype.element_ty)                          # the GEMM's rounding
        if EPI == RESIDUAL:
            out = (out.to(tl.float32) + tl.load(res + at, mask=m_out, other=0.).to(tl.float32)).to(
                y.dtype.element_ty)
        tl.store(y + at, out, mask=m_out)


def _configs():
    """(output columns, K step, K slice or 0 for the whole row, warps, stages). Not yet timed on a GPU: the list spans
    what a skinny product may need (many column blocks for wide products, K slices for narrow ones, two stages for
    the 512-wide heads of a gated norm at 64 rows, whose tiles fill shared memory; a launch that does not fit is
    skipped by the autotuner)."""
    return [triton.Config({"BN": bn, "BK": bk, "KS": ks}, num_warps=nw, num_stages=st)
            for bn, bk, ks, nw, st in [(64, 128, 0, 4, 4), (32, 128, 0, 4, 4), (64, 256, 0, 4, 3), (128, 128, 0, 8, 3),
                                       (32, 256, 0, 4, 3), (64, 128, 1024, 4, 4), (32, 128, 512, 4, 4),
                                       (64, 256, 1024, 8, 3), (32, 512, 1024, 8, 3), (16, 512, 512, 8, 3),
                                       (32, 512, 0, 8, 2), (16, 512, 1024, 8, 2)]]


SHARED_BYTES = 227 * 1024     # an H100 / H200 block's shared memory


def _inputs(PRO: int) -> int:
    """Input tiles a K step loads: two for a gated norm (and its gate), a residual add, SwiGLU (gate and up)."""
    return 2 if PRO in (GATED_NORM.value, NORM_ADD.value, SWIGLU.value) else 1


def _stage_bytes(BN: int, BK: int, MP: int, PRO: int, elem: int) -> int:
    """Shared memory of one pipeline stage: the software pipeliner buffers every load of the K loop, the weight tile
    and the input tiles (``elem`` bytes an element). Compiled for sm_90 at the 1.3B shapes, kernels took 50-111% of
    stages times this (Triton 3.8 / 3.6): a launch the estimate admits near the limit may not fit, and the autotuner
    then skips it."""
    return BK * (BN + MP * _inputs(PRO)) * elem


def _fits(c: triton.Config, args: dict, elem: int) -> bool:
    """A gated norm's K step is one head; a slice holds whole K steps; the stages fit in shared memory; the input
    tiles' fp32 elements are at most 128 a thread (ptxas for sm_90: a 512-wide gated head at 32 rows spilled with 4
    warps, not with 8; gate|up at 64 rows, 2048 wide, fit 4 warps in 255 registers)."""
    bk, ks, bn, mp = c.kwargs["BK"], c.kwargs["KS"], c.kwargs["BN"], args["MP"]
    return ((args["HD"] == 1 or bk == args["HD"]) and (ks == 0 or ks % bk == 0 and ks < args["K"])
            and c.num_stages * _stage_bytes(bn, bk, mp, args["PRO"], elem) <= SHARED_BYTES
            and mp * bk * _inputs(args["PRO"]) <= 128 * 32 * c.num_warps)


def _prune(configs, named_args, **kwargs):
    """The launches that fit, else one small one: a gated head narrower than every listed K step (its K step is the
    head), or a 512-wide gated head at 64 rows (8 warps, the fewest spills of 4, 8 and 16: ~100 bytes with Triton
    3.8's ptxas, 840 with 3.6's; no room for a second stage). The autotuner passes the launch's positional arguments (``x``, ``K``) in
    ``named_args`` and its keywords (the constexprs) in ``kwargs``."""
    args = {**named_args, **kwargs}
    elem = args["x"].element_size()
    bk = 64 if args["HD"] == 1 else args["HD"]
    stages = 2 if 2 * _stage_bytes(16, bk, args["MP"], args["PRO"], elem) <= SHARED_BYTES else 1
    return [c for c in configs if _fits(c, args, elem)] or [triton.Config({"BN": 16, "BK": bk, "KS": 0},
                                                                          num_warps=8, num_stages=stages)]


def _grid(N: int, K: int):
    return lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(K, meta["KS"]) if meta["KS"] else 1)


# a model's products and buckets are ~15 keys of ~10 launches each: the timings are kept in Triton's cache, so that a
# process finding the cache (a carried one on a fresh GPU machine) does not time them again
_tuned = triton.autotune(_configs(), key=["MP", "N", "K", "PRO", "EPI", "HD"], restore_value=["window"],
                         prune_configs_by={"early_config_prune": _prune}, do_bench=_cold_bench,
                         cache_results=True)(fused_gemm_kernel)

_workspaces: dict = {}


def _workspace(device: torch.device, MP: int, N: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums (``slices`` of up to ``MP`` rows by ``N``) and per-column-block counters (zero between launches)
    of a product shape on ``device``, allocated once: a captured graph keeps reading them. Products of one shape
    share them, as the GEMV's split-K workspaces are shared."""
    key = (device, MP, N, slices)
    if key not in _workspaces:
        _workspaces[key] = (torch.empty(slices * MP * N, dtype=torch.float32, device=device),
                            torch.zeros(triton.cdiv(N, 16), dtype=torch.int32, device=device))
    return _workspaces[key]


def fused_gemm(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
               add: torch.Tensor | None = None, add_out: torch.Tensor | None = None,
               gate: torch.Tensor | None = None, swiglu: bool = False, residual: torch.Tensor | None = None,
               conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
               config: dict | None = None) -> torch.Tensor:
    """Triton twin of ``fused_gemm_ref``: ``x [M, K]`` (``[M, 2K]`` for SwiGLU; rows may be strided, as may a gated
    norm's ``gate``), ``add``/``add_out [M, K]`` and ``residual [M, N]`` contiguous, ``M <= MAX_ROWS``; ``conv``
    (``gemv``'s short-conv epilogue) for one row only. ``config``: a launch (``BN``, ``BK``, ``KS`` (0: no K
    slices), ``num_warps``, ``num_stages``) in place of the tuned one, for tests and benchmarks."""
    N, K = weight.shape
    M = x.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"fused_gemm takes 1 to {MAX_ROWS} rows, got {M}")
    if x.dim() != 2 or x.shape[1] != (2 * K if swiglu else K):
        raise ValueError(f"fused_gemm: x must be [rows, {2 * K if swiglu else K}] for a [{N}, {K}] weight"
                         f"{' with SwiGLU' if swiglu else ''}, got {list(x.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or gate is not None and gate.stride(-1) != 1:
        raise ValueError("fused_gemm needs unit-stride rows of x, gate and weight")
    if any(t is not None and not t.is_contiguous() for t in (add, add_out, residual)):
        raise ValueError("fused_gemm needs contiguous add, add_out and residual")
    if conv is not None and M != 1:
        raise ValueError(f"fused_gemm's conv epilogue shifts one token into the window, got {M} rows")
    pro, epi = _kinds(norm, add, add_out, gate, swiglu, residual, conv)
    HD = norm[0].numel() if gate is not None else 1
    if gate is not None and (HD & (HD - 1) or K % HD or HD < MIN_GATED_HEAD):
        raise ValueError(f"the gated-norm prologue needs a power-of-two head size of at least {MIN_GATED_HEAD} "
                         f"dividing {K}, got {HD}")
    if config is None and not x.is_cuda:     # the interpreter (tests): one launch, K in slices when long enough;
        bk = HD if gate is not None else 32  # few, wide programs, as each costs the interpreter the same
        config = dict(BN=32, BK=bk, KS=2 * bk if K > 2 * bk else 0)
    narrowest = min(c.kwargs["KS"] or K for c in _tuned.configs) if config is None else config["KS"] or K
    MP = max(16, triton.next_power_of_2(M))
    y = x.new_empty(M, N)
    part, count = _workspace(x.device, MP, N, triton.cdiv(K, narrowest))
    on = pdl.enabled(x.device)
    args = (weight, x, y, part, count, M, N, K)
    operands = (weight.stride(0), x.stride(0), add if add is not None else x, add_out if add_out is not None else x,
                norm[0] if norm is not None else x, gate if gate is not None else x,
                gate.stride(0) if gate is not None else 0, norm[1] if norm is not None else 0.,
                residual if residual is not None else x)
    window, conv_w, conv_b = conv if conv is not None else (x, x, None)
    operands += (window, conv_w, conv_b if conv_b is not None else x, window.shape[0] if conv is not None else 0)
    W = window.shape[-1] if conv is not None else 1
    consts = dict(PRO=pro, EPI=epi, HAS_CONV_BIAS=conv_b is not None, W=W, WP=triton.next_power_of_2(W), MP=MP,
                  HD=HD, PDL=on,
                  IEEE=x.dtype == torch.float32)          # an fp32 model's products in fp32, as cuBLAS's
    if config is None and x.is_cuda:
        _tuned[_grid(N, K)](*args, *operands, **consts, launch_pdl=on)
        return y
    launch = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
    meta = {k: v for k, v in config.items() if k not in launch}
    fused_gemm_kernel[_grid(N, K)(meta)](*args, *operands, **consts, **meta, **launch, launch_pdl=on)
    return y
