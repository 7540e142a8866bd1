"""Triton kernels: a batch-1 matrix-vector product ``y = W @ f(x)`` with the decode step's small ops fused around it.

Semantics of :func:`specla_kernels.reference.gemv_ref`. A one-token step of a GDN model is four GEMVs per layer plus a
dozen tiny kernels (norms, residual adds, short conv and its window update, SwiGLU, the split-K reductions cuBLAS adds
to its narrow GEMVs); on the H200 the tiny ones and the gaps between launches cost about as much as the weights'
bandwidth. Here each GEMV applies the op that produced its input (prologue) and the op that consumes its output
(epilogue), so a layer is four launches plus the recurrence:

- prologue ``norm`` (optionally of ``x + add``, the sum written to ``add_out``: fla's pre-norm residual add), ``gate``
  (fla's gated RMSNorm of each ``head_dim``-wide head, swish gate) or ``swiglu`` (``x = [gate | up]``);
- epilogue ``residual`` (added to the output) or ``conv`` (output rows ``< C`` are the raw inputs of a depthwise
  causal conv: shift them into the ``window [C, W]`` in place, emit ``silu(conv)``).

Every intermediate is rounded to the model dtype where the unfused ops round it, so the fused step computes what
the stock layer computes up to the GEMV's summation order. Two kernels, the same prologues and epilogues:

- row-owner (``gemv_kernel``): one program owns ``BN`` output rows and loads its whole ``[BN, K]`` block of ``W`` at
  once (``K <= 16384``; the input is one register tile): a batch-1 GEMV is bound by how many bytes are in flight,
  and a K loop without ``tl.dot`` is not software-pipelined, so each of its iterations would wait a full memory
  latency (such a version streamed 0.8-2.1 TB/s on the H200). Prologue statistics are recomputed by every program
  from ``x`` (a few KB, cache-resident): cheaper than a launch.
- split-K (``gemv_split_kernel``): a program owns a row block and one slice of the columns; the last program of a
  row block sums the slices' partials in slice order (deterministic: no float atomics) and applies the epilogue, so
  a conv row's window still has one writer. More, smaller loads in flight: it wins on products with few rows
  (``tuning.KernelTuning.gemv_split_max_rows``, ``gemv_split_cols``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specla_kernels import pdl, tuning

# prologue (what turns the input vector into the product's right-hand side) and epilogue kinds
PLAIN = tl.constexpr(0)
NORM = tl.constexpr(1)
NORM_ADD = tl.constexpr(2)
GATED_NORM = tl.constexpr(3)
SWIGLU = tl.constexpr(4)
NO_EPILOGUE = tl.constexpr(0)
RESIDUAL = tl.constexpr(1)
CONV = tl.constexpr(2)


@triton.jit
def _weight_block(w, blk, N, stride_w, cols, m_cols, BN: tl.constexpr):
    """Rows ``blk * BN ..`` of ``W`` as a ``[BN, KR, KC]`` tile (all masked for a block past the end)."""
    rows = blk * BN + tl.arange(0, BN)
    return tl.load(w + rows.to(tl.int64)[:, None, None] * stride_w + cols[None, :, :],
                   mask=(rows < N)[:, None, None] & m_cols[None, :, :], other=0.)


@triton.jit
def _gated_head_norm(xv, gv, norm_w, eps, D: tl.constexpr):
    """fla's gated RMSNorm (swish gate ``gv``) of each row of ``xv [R, D]``, a head a row, in fp32."""
    h_rstd = 1 / tl.sqrt(tl.sum(xv * xv, 1) / D + eps)
    rhs = xv * h_rstd[:, None] * tl.load(norm_w + tl.arange(0, D)).to(tl.float32)[None, :]
    return rhs * gv * tl.sigmoid(gv)


@triton.jit
def _rhs(x, x2, add_out, norm_w, gate, eps, cols, m_cols, K, write_add, PRO: tl.constexpr, KC: tl.constexpr,
         KP: tl.constexpr):
    """The product's right-hand side at ``cols`` (a ``[KR, KC]`` tile; a gated norm's heads are its rows), rounded as
    the unfused op's output. The statistic of ``NORM``/``NORM_ADD`` spans the whole input: it is taken from the tile
    when the tile is the whole input (``KP = 0``), else from a reload of all ``K <= KP`` columns (a few KB, cached)."""
    xv = tl.load(x + cols, mask=m_cols, other=0.).to(tl.float32)
    if PRO == NORM_ADD:
        xv += tl.load(x2 + cols, mask=m_cols, other=0.).to(tl.float32)
        if write_add:                                # the residual stream after the add, for the next residual
            tl.store(add_out + cols, xv.to(add_out.dtype.element_ty), mask=m_cols)
    if PRO == NORM or PRO == NORM_ADD:
        if KP == 0:
            sum_sq = tl.sum(tl.sum(xv * xv, 1), 0)
        else:
            every = tl.arange(0, KP)
            xa = tl.load(x + every, mask=every < K, other=0.).to(tl.float32)
            if PRO == NORM_ADD:
                xa += tl.load(x2 + every, mask=every < K, other=0.).to(tl.float32)
            sum_sq = tl.sum(xa * xa, 0)
        rstd = 1 / tl.sqrt(sum_sq / K + eps)
        rhs = xv * rstd * tl.load(norm_w + cols, mask=m_cols, other=0.).to(tl.float32)
    elif PRO == GATED_NORM:
        rhs = _gated_head_norm(xv, tl.load(gate + cols, mask=m_cols, other=0.).to(tl.float32), norm_w, eps, KC)
    elif PRO == SWIGLU:
        up = tl.load(x + K + cols, mask=m_cols, other=0.).to(tl.float32)
        rhs = xv * tl.sigmoid(xv) * up
    else:
        rhs = xv
    return rhs.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _epilogue(out, rows, m_rows, res, window, conv_w, conv_b, C, EPI: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
              W: tl.constexpr, WP: tl.constexpr):
    """The op consuming the output rows ``out`` (rounded as the GEMM rounds them), computed as the unfused op rounds:
    ``RESIDUAL`` adds ``res[rows]``; ``CONV``: rows ``< C`` are raw conv inputs, their window ``[C, W]`` (newest
    last) becomes ``[window[1:], out]`` in place and they are replaced by SiLU of the conv."""
    if EPI == RESIDUAL:
        out = (out.to(tl.float32) + tl.load(res + rows, mask=m_rows, other=0.).to(tl.float32)).to(out.dtype)
    elif EPI == CONV:
        m_conv = m_rows & (rows < C)
        taps = tl.arange(0, WP)[None, :]
        base = rows.to(tl.int64)[:, None] * W
        shifted = tl.load(window + base + taps + 1, mask=m_conv[:, None] & (taps < W - 1), other=0.)
        cw = tl.load(conv_w + base + taps, mask=m_conv[:, None] & (taps < W), other=0.).to(tl.float32)
        new = tl.where(taps == W - 1, out.to(tl.float32)[:, None], shifted.to(tl.float32))
        conv = tl.sum(new * cw, 1)
        if HAS_CONV_BIAS:
            conv += tl.load(conv_b + rows, mask=m_conv, other=0.).to(tl.float32)
        # every thread holding a copy of a row must read its window before any writes it back shifted
        tl.debug_barrier()
        tl.store(window + base + taps, new.to(window.dtype.element_ty), mask=m_conv[:, None] & (taps < W))
        out = tl.where(m_conv, (conv * tl.sigmoid(conv)).to(out.dtype), out)
    return out


@triton.jit
def gemv_kernel(w, x, y, N, K, stride_w, x2, add_out, norm_w, gate, eps, res, window, conv_w, conv_b, C,
                PRO: tl.constexpr, EPI: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, KR: tl.constexpr,
                KC: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BN: tl.constexpr, PER_SM: tl.constexpr,
                STAGES: tl.constexpr, PDL: tl.constexpr):
    # The input is one [KR, KC] register tile (KC = the head size for a gated norm: a head per row). A program owns
    # the row blocks pid, pid + G, ... (G = PER_SM programs per SM, set at launch) and loads each block's whole
    # [BN, KR, KC] weight tile at once, STAGES - 1 blocks ahead of the one it reduces (2 or 3): the memory pipe never
    # waits for a reduction, and the prologue is computed once per program. A batch-1 GEMV streams as fast as it
    # keeps bytes in flight; a third stage is 50% more per program at the same occupancy.
    # With PDL (specla_kernels.pdl) this kernel may start before the previous one ends: the weights do not depend
    # on it, so the first blocks are requested before waiting; everything that reads an activation or writes comes
    # after.
    pdl.allow_dependents(PDL)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BN)
    cols = tl.arange(0, KR)[:, None] * KC + tl.arange(0, KC)[None, :]
    m_cols = cols < K
    wt = _weight_block(w, pid, N, stride_w, cols, m_cols, BN)
    if STAGES == 3:
        wt_ahead = _weight_block(w, pid + G, N, stride_w, cols, m_cols, BN)
    pdl.wait_for_inputs(PDL)
    rhs = _rhs(x, x2, add_out, norm_w, gate, eps, cols, m_cols, K, pid == 0, PRO, KC, 0)
    for blk in range(pid, n_blocks, G):
        wt_next = _weight_block(w, blk + (STAGES - 1) * G, N, stride_w, cols, m_cols, BN)
        rows = blk * BN + tl.arange(0, BN)
        m_rows = rows < N
        out = tl.sum(tl.sum(wt.to(tl.float32) * rhs[None, :, :], 2), 1).to(y.dtype.element_ty)  # the GEMM's rounding
        out = _epilogue(out, rows, m_rows, res, window, conv_w, conv_b, C, EPI, HAS_CONV_BIAS, W, WP)
        tl.store(y + rows, out, mask=m_rows)
        if STAGES == 3:
            wt = wt_ahead
            wt_ahead = wt_next
        else:
            wt = wt_next



@triton.jit
def gemv_split_kernel(w, x, y, part, count, N, K, stride_w, x2, add_out, norm_w, gate, eps, res, window, conv_w,
                      conv_b, C, PRO: tl.constexpr, EPI: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, KR: tl.constexpr,
                      KC: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BN: tl.constexpr,
                      PDL: tl.constexpr):
    # Split-K: program (b, s) owns rows b * BN .. and the s-th [KR, KC] slice of the columns. Against the row-owner
    # kernel above it has S times more, smaller, unpadded loads in flight (a narrow product such as o_proj, 2048 rows,
    # has too few row blocks to fill the SMs, and 5632 columns pad to 8192 there). Each program writes its fp32
    # partial sums to ``part [S, N]``; the program that finds itself last on its row block (a counter per block)
    # adds the S partials in slice order -- the same order on every run, so the result is deterministic -- applies
    # the epilogue (a conv row's window has that one writer), stores the row block and re-arms the counter for the
    # next launch. A norm's statistic spans the input: every program takes it from all of ``x`` (``KP``).
    pdl.allow_dependents(PDL)
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    S = tl.num_programs(1)
    rows = i_b * BN + tl.arange(0, BN)
    m_rows = rows < N
    cols = i_s * KR * KC + tl.arange(0, KR)[:, None] * KC + tl.arange(0, KC)[None, :]
    m_cols = cols < K
    wt = _weight_block(w, i_b, N, stride_w, cols, m_cols, BN)
    pdl.wait_for_inputs(PDL)
    rhs = _rhs(x, x2, add_out, norm_w, gate, eps, cols, m_cols, K, i_b == 0, PRO, KC, KP)
    tl.store(part + i_s * N + rows, tl.sum(tl.sum(wt.to(tl.float32) * rhs[None, :, :], 2), 1), mask=m_rows)
    # every thread's partial is written before one thread's counter update releases them (acq_rel, GPU scope)
    tl.debug_barrier()
    if tl.atomic_add(count + i_b, 1, sem="acq_rel") == S - 1:
        acc = tl.zeros([BN], dtype=tl.float32)
        for t in range(S):       # .cg: read at L2, where the other programs' partials are
            acc += tl.load(part + t * N + rows, mask=m_rows, other=0., cache_modifier=".cg")
        out = _epilogue(acc.to(y.dtype.element_ty), rows, m_rows, res, window, conv_w, conv_b, C, EPI,  # GEMM rounding
                        HAS_CONV_BIAS, W, WP)
        tl.store(y + rows, out, mask=m_rows)
        tl.atomic_xchg(count + i_b, 0)


MAX_K = 16384       # the whole input is one register tile
TUNE_BYTES = 8 * 2**20   # products with smaller weights run one fixed launch shape: tuning would cost compiles


def _configs():
    """(rows per block, programs per SM, warps, stages). Tuning the 1.3B shape's five products on the H200 over 24
    shapes (BN 1-8, 4 or 8 warps, 2 or 4 programs per SM or one program per block) picked the first four below; each
    configuration costs a compile (~1 s) the first time a model runs, so the list keeps the winners and two
    neighbours, and the winners with a third stage (streaming plain products on the H200, this kernel reached 3.1
    TB/s with two stages against split-K's 4.1, which keeps more, smaller loads in flight)."""
    return [triton.Config({"BN": bn, "PER_SM": per_sm, "STAGES": st}, num_warps=nw)
            for bn, per_sm, nw, st in [(4, 2, 8, 2), (2, 2, 8, 2), (2, 4, 4, 2), (1, 2, 8, 2), (1, 4, 4, 2),
                                       (4, 4, 8, 2), (4, 2, 8, 3), (2, 4, 4, 3), (2, 2, 8, 3)]]


def _row_fits(c: triton.Config, elems: int) -> bool:
    """Two weight tiles live per program (this block's, the next one's): at most 32 elements each per thread."""
    return c.kwargs["BN"] * elems <= 32 * 32 * c.num_warps


def _prune(configs, named_args, **kwargs):
    ok = [c for c in configs if _row_fits(c, kwargs["KR"] * kwargs["KC"])]
    return ok or [min(configs, key=lambda c: c.kwargs["BN"] / c.num_warps)]


def _grid(N: int, device: torch.device):
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def grid(meta):
        blocks = triton.cdiv(N, meta["BN"])
        return (min(blocks, sms * meta["PER_SM"]),)
    return grid


def _cold_bench(kernel_call, quantiles=(0.5, 0.2, 0.8), **_) -> list[float]:
    """Time ``kernel_call`` as a model runs it: its weights not in L2. Triton's default benchmark empties L2 by
    *writing* a large buffer, so the timed kernel pays for writing those dirty lines back (configurations chosen that
    way measured up to 2.3x slower than the best in a model's back-to-back sequence, H200); here L2 is
    emptied by *reading* 256 MiB (clean lines). Returns the requested quantiles in ms."""
    flush = torch.ones(64 * 2**20, dtype=torch.float32, device="cuda")   # back to the allocator's cache after
    kernel_call()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(25)]
    for start, end in events:
        flush.sum()
        start.record()
        kernel_call()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([start.elapsed_time(end) for start, end in events])
    return torch.quantile(times, torch.tensor(quantiles)).tolist()


def _split_configs():
    """(rows per program, warps) for the split-K kernel; a program holds one ``[BN, KR * KC]`` slice of the weight."""
    return [triton.Config({"BN": bn}, num_warps=nw)
            for bn, nw in [(2, 4), (4, 4), (8, 4), (16, 4), (4, 8), (8, 8), (16, 8), (32, 8)]]


def _split_fits(c: triton.Config, elems: int) -> bool:
    """At most 64 weight elements per thread (one tile per program)."""
    return c.kwargs["BN"] * elems <= 64 * 32 * c.num_warps


def _split_prune(configs, named_args, **kwargs):
    ok = [c for c in configs if _split_fits(c, kwargs["KR"] * kwargs["KC"])]
    return ok or [min(configs, key=lambda c: c.kwargs["BN"] / c.num_warps)]


# tuned per shape and mode on first use (a conv epilogue rewrites its window: the tuner restores it between trials)
_tuned_kernel = triton.autotune(_configs(), key=["N", "K", "PRO", "EPI", "KC"], restore_value=["window"],
                                prune_configs_by={"early_config_prune": _prune}, do_bench=_cold_bench)(gemv_kernel)


_tuned_split = triton.autotune(_split_configs(), key=["N", "K", "PRO", "EPI", "KR", "KC"], restore_value=["window"],
                               prune_configs_by={"early_config_prune": _split_prune},
                               do_bench=_cold_bench)(gemv_split_kernel)

_split_buffers: dict = {}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def product_key(weight: torch.Tensor, x: torch.Tensor, **fused) -> tuple:
    """The ``gemv_step_configs`` key (``tuning``) of ``gemv(weight, x, **fused)``: GPU name, weight dtype, rows, columns, prologue,
    epilogue, and the input tile's width (a gated norm's head size)."""
    return _key(weight, x, *_kinds(**fused), _tiles(weight.shape[1], fused.get("gate"), fused.get("norm"))[1])


def _key(weight: torch.Tensor, x: torch.Tensor, pro: int, epi: int, KC: int) -> tuple:
    return (_device_name(x.device), str(weight.dtype).removeprefix("torch."), *weight.shape, pro, epi, KC)


def _kinds(norm=None, add=None, add_out=None, gate=None, swiglu=False, residual=None, conv=None) -> tuple[int, int]:
    pro = (SWIGLU if swiglu else GATED_NORM if gate is not None else NORM_ADD if add is not None else
           NORM if norm is not None else PLAIN).value
    return pro, (CONV if conv is not None else RESIDUAL if residual is not None else NO_EPILOGUE).value


def _tiles(K: int, gate: torch.Tensor | None, norm) -> tuple[int, int]:
    """The input's register tile ``[KR, KC]`` (a gated norm's heads are its rows)."""
    if gate is not None:
        KC = norm[0].numel()
        if KC & (KC - 1) or K % KC:
            raise ValueError(f"the gated-norm prologue needs a power-of-two head size dividing {K}, got {KC}")
        return triton.next_power_of_2(K // KC), KC
    KC = min(512, triton.next_power_of_2(K))
    return triton.cdiv(triton.next_power_of_2(K), KC), KC


# The launches benchmarks/tune_step.py tries: wider than the autotuner's lists (a user's first run compiles every
# configuration those hold; the tuner's table is measured once per GPU). (rows, warps) x programs per SM x stages
# for the row-owner kernel, (rows, warps) x columns per program for split-K; 2048 columns lost on every product of
# the 1.3B step in chains of 21 copies on the H200.
STEP_ROW_SHAPES = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (8, 16)]
STEP_SPLIT_SHAPES = [(2, 4), (4, 4), (8, 4), (4, 8), (8, 8), (16, 8), (32, 8), (16, 16), (32, 16), (64, 16)]


def launch_candidates(weight: torch.Tensor, x: torch.Tensor, **fused) -> list[dict]:
    """Every launch the step-config table may hold for this product, for ``benchmarks/tune_step.py``: the row-owner
    kernel at ``STEP_ROW_SHAPES`` with 1-4 programs per SM and 2 or 3 stages, split-K at ``STEP_SPLIT_SHAPES`` with
    256, 512 and 1024 columns per program, those that fit the register budgets the autotuner prunes by."""
    K = weight.shape[1]
    KR, KC = _tiles(K, fused.get("gate"), fused.get("norm"))
    rows = [triton.Config({"BN": bn, "PER_SM": per_sm, "STAGES": st}, num_warps=nw)
            for bn, nw in STEP_ROW_SHAPES for per_sm in (1, 2, 3, 4) for st in (2, 3)]
    out = [{"split": 0, **c.kwargs, "num_warps": c.num_warps} for c in rows if _row_fits(c, KR * KC)]
    splits = [triton.Config({"BN": bn}, num_warps=nw) for bn, nw in STEP_SPLIT_SHAPES]
    for split in (256, 512, 1024):
        if split > K or (fused.get("gate") is not None and split % KC):
            continue
        out += [{"split": split, **c.kwargs, "num_warps": c.num_warps} for c in splits if _split_fits(c, split)]
    return out


def _split_workspace(device: torch.device, N: int, S: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial sums ``[S, N]`` and per-row-block counters (zero between launches) of a split-K product, one pair
    per shape and device. Products of one shape share them: in one stream each launch ends (or, with PDL, reaches
    nothing of them before the previous kernel ends) before the next begins. Two streams running same-shaped split
    products at once would need their own."""
    key = (device, N, S)
    if key not in _split_buffers or _split_buffers[key][1].numel() < blocks:
        _split_buffers[key] = (torch.empty(S * N, dtype=torch.float32, device=device),
                               torch.zeros(blocks, dtype=torch.int32, device=device))
    return _split_buffers[key]


def gemv(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
         add: torch.Tensor | None = None, add_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
         swiglu: bool = False, residual: torch.Tensor | None = None,
         conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
         split: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Triton twin of ``gemv_ref``; arguments are 1-D vectors (one token of batch 1), see the module docstring.
    ``split``: columns per program of the split-K kernel (a power of two; a multiple of the head size with a gated
    norm), 0 for the row-owner kernel; by default large products of at most ``gemv_split_max_rows`` rows take split-K with
    ``gemv_split_cols`` columns (a gated norm's head, if wider). ``config``: a launch shape in place of the tuned (or
    fixed) one, for benchmarks and tests: ``BN`` and ``num_warps``, and for the row-owner kernel ``PER_SM`` and
    ``STAGES`` (on the CPU interpreter ``PER_SM`` is the number of programs)."""
    N, K = weight.shape
    if K > MAX_K:
        raise ValueError(f"gemv keeps the whole input in registers: at most {MAX_K} columns, got {K}")
    KR, KC = _tiles(K, gate, norm)
    pro, epi = _kinds(norm, add, add_out, gate, swiglu, residual, conv)
    big = x.is_cuda and weight.numel() * weight.element_size() >= TUNE_BYTES
    tune = tuning.active()
    if big and split is None and config is None and tune.gemv_row_config is None:
        tuned = tune.gemv_step_configs.get(_key(weight, x, pro, epi, KC))
        if tuned is not None:
            split, config = tuned["split"], {k: v for k, v in tuned.items() if k != "split"}
    if split is None:
        cols = max(tune.gemv_split_cols, KC if pro == GATED_NORM.value else 0)     # whole heads of a gated norm
        split = cols if big and N <= tune.gemv_split_max_rows and K >= cols else 0
    if split and (split & (split - 1) or pro == GATED_NORM.value and split % KC):
        raise ValueError(f"split must be a power of two (with a gated norm, a multiple of its head size {KC}), "
                         f"got {split}")
    y = x.new_empty(N)
    on = pdl.enabled(x.device)
    window, conv_w, conv_b = conv if conv is not None else (x, x, None)
    W = window.shape[-1] if conv is not None else 1
    consts = dict(PRO=pro, EPI=epi, HAS_CONV_BIAS=conv_b is not None, W=W, WP=triton.next_power_of_2(W), PDL=on)
    operands = (add if add is not None else x, add_out if add_out is not None else x,
                norm[0] if norm is not None else x, gate if gate is not None else x, norm[1] if norm is not None else 0.,
                residual if residual is not None else x, window, conv_w, conv_b if conv_b is not None else x,
                window.shape[0] if conv is not None else 0)
    if split:
        KC = min(KC, split)
        S = triton.cdiv(K, split)
        part, count = _split_workspace(x.device, N, S, triton.cdiv(N, 2))
        args = (weight, x, y, part, count, N, K, weight.stride(0), *operands)
        whole_stat = pro in (NORM.value, NORM_ADD.value)      # a statistic over all of x: each program reloads it
        consts.update(KR=split // KC, KC=KC, KP=triton.next_power_of_2(K) if whole_stat else 0)
        if config is not None:
            gemv_split_kernel[(triton.cdiv(N, config["BN"]), S)](*args, **consts, **config, launch_pdl=on)
        elif big:
            _tuned_split[lambda meta: (triton.cdiv(N, meta["BN"]), S)](*args, **consts, launch_pdl=on)
        else:     # a small product or the interpreter (tests): one configuration
            gemv_split_kernel[(triton.cdiv(N, 2), S)](*args, **consts, BN=2, num_warps=4, launch_pdl=on)
        return y
    args = (weight, x, y, N, K, weight.stride(0), *operands)
    consts.update(KR=KR, KC=KC)
    if config is None and big:
        config = tune.gemv_row_config
    if config is not None:
        meta = {"STAGES": 2, **config}
        grid = _grid(N, x.device)(meta) if x.is_cuda else (meta["PER_SM"],)
        gemv_kernel[grid](*args, **consts, **meta, launch_pdl=on)
    elif big:
        _tuned_kernel[_grid(N, x.device)](*args, **consts, launch_pdl=on)
    elif x.is_cuda:      # a small product (a small model, a drafter): one reasonable shape, no tuning compiles
        gemv_kernel[_grid(N, x.device)({"BN": 2, "PER_SM": 4})](*args, **consts, BN=2, PER_SM=4, STAGES=2,
                                                                  num_warps=4, launch_pdl=on)
    else:  # the interpreter (tests): one configuration, 8 rows a block (the interpreter's cost is per block step: the
        # fused-step decode check of tests/test_fla_parity.py took 123 s at 2 rows, 33 s at 8; test_gemv keeps 2)
        gemv_kernel[(min(3, triton.cdiv(N, 8)),)](*args, **consts, BN=8, PER_SM=1,   # several blocks per program
                                                  STAGES=2, launch_pdl=on)
    return y
