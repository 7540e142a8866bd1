"""Triton kernel: a batch-1 matrix-vector product ``y = W @ f(x)`` with the decode step's small ops fused around it.

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
the stock layer computes up to the GEMV's summation order. One program owns ``BN`` output rows and streams its
``[BN, K]`` block of ``W`` (rows contiguous along ``K``) with no split-K: a row's sum has one owner, so results are
deterministic, and a conv row's window has one writer. Prologue reductions (the norm statistics) are recomputed by
every program from ``x`` (a few KB, cache-resident): cheaper than a launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# prologue (what turns the input vector into the product's right-hand side) and epilogue kinds
PLAIN = tl.constexpr(0)
NORM = tl.constexpr(1)
NORM_ADD = tl.constexpr(2)
GATED_NORM = tl.constexpr(3)
SWIGLU = tl.constexpr(4)
RESIDUAL = tl.constexpr(1)
CONV = tl.constexpr(2)


@triton.jit
def _rhs(x, x2, norm_w, gate, cols, m_cols, k0, rstd, eps, PRO: tl.constexpr, HEAD_DIM: tl.constexpr, K):
    """The right-hand side's values at ``cols`` (fp32, rounded to the model dtype like the unfused op's output)."""
    xv = tl.load(x + cols, mask=m_cols, other=0.).to(tl.float32)
    if PRO == NORM:
        r = xv * rstd * tl.load(norm_w + cols, mask=m_cols, other=0.).to(tl.float32)
    elif PRO == NORM_ADD:
        xv += tl.load(x2 + cols, mask=m_cols, other=0.).to(tl.float32)
        r = xv * rstd * tl.load(norm_w + cols, mask=m_cols, other=0.).to(tl.float32)
    elif PRO == GATED_NORM:
        # this chunk lies in one head (BK divides HEAD_DIM): that head's statistic from its HEAD_DIM values
        head = (k0 // HEAD_DIM) * HEAD_DIM + tl.arange(0, HEAD_DIM)
        hv = tl.load(x + head).to(tl.float32)
        h_rstd = 1 / tl.sqrt(tl.sum(hv * hv, 0) / HEAD_DIM + eps)
        gv = tl.load(gate + cols, mask=m_cols, other=0.).to(tl.float32)
        r = xv * h_rstd * tl.load(norm_w + cols % HEAD_DIM, mask=m_cols, other=0.).to(tl.float32)
        r = r * gv * tl.sigmoid(gv)
    elif PRO == SWIGLU:
        up = tl.load(x + K + cols, mask=m_cols, other=0.).to(tl.float32)
        r = xv * tl.sigmoid(xv) * up
    else:
        r = xv
    return r.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def gemv_kernel(w, x, y, N, K, stride_w, x2, add_out, norm_w, gate, eps, res, window, conv_w, conv_b, C,
                PRO: tl.constexpr, EPI: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr,
                W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    m_rows = rows < N
    rstd = 0.
    if PRO == NORM or PRO == NORM_ADD:
        # the mean square of the whole input (every program; program 0 also writes x + x2 for the later residual)
        sq = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            m_cols = cols < K
            xv = tl.load(x + cols, mask=m_cols, other=0.).to(tl.float32)
            if PRO == NORM_ADD:
                xv += tl.load(x2 + cols, mask=m_cols, other=0.).to(tl.float32)
                if pid == 0:
                    tl.store(add_out + cols, xv.to(add_out.dtype.element_ty), mask=m_cols)
            sq += xv * xv
        rstd = 1 / tl.sqrt(tl.sum(sq, 0) / K + eps)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    w_rows = w + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m_cols = cols < K
        r = _rhs(x, x2, norm_w, gate, cols, m_cols, k0, rstd, eps, PRO, HEAD_DIM, K)
        wt = tl.load(w_rows + cols[None, :], mask=m_rows[:, None] & m_cols[None, :], other=0.)
        acc += wt.to(tl.float32) * r[None, :]
    out = tl.sum(acc, 1).to(y.dtype.element_ty)                 # the product, rounded as the unfused GEMM's output
    if EPI == RESIDUAL:
        out = (out.to(tl.float32) + tl.load(res + rows, mask=m_rows, other=0.).to(tl.float32)).to(y.dtype.element_ty)
    elif EPI == CONV:
        m_conv = m_rows & (rows < C)
        base = rows.to(tl.int64) * W
        conv = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(W - 1):                        # oldest tap first
            prev = tl.load(window + base + j + 1, mask=m_conv, other=0.)
            conv += prev.to(tl.float32) * tl.load(conv_w + base + j, mask=m_conv, other=0.).to(tl.float32)
            tl.store(window + base + j, prev, mask=m_conv)
        conv += out.to(tl.float32) * tl.load(conv_w + base + W - 1, mask=m_conv, other=0.).to(tl.float32)
        tl.store(window + base + W - 1, out.to(window.dtype.element_ty), mask=m_conv)
        if HAS_CONV_BIAS:
            conv += tl.load(conv_b + rows, mask=m_conv, other=0.).to(tl.float32)
        out = tl.where(m_conv, (conv * tl.sigmoid(conv)).to(y.dtype.element_ty), out)
    tl.store(y + rows, out, mask=m_rows)


# (BN, BK, warps): narrow row blocks give the N = hidden-size products (o_proj, down_proj) enough programs to fill
# the GPU without split-K; wide K blocks keep enough bytes in flight per program
_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=nw)
            for bn, bk, nw in [(2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4), (8, 512, 8),
                               (16, 256, 4), (16, 512, 8), (32, 128, 4)]]


def _prune(configs, named_args, **kwargs):
    """A gated-norm prologue needs each K block inside one head: BK divides the head size."""
    head_dim, pro = kwargs["HEAD_DIM"], kwargs["PRO"]
    if pro != 3:
        return configs
    return [c for c in configs if head_dim % c.kwargs["BK"] == 0] or [triton.Config({"BN": 4, "BK": head_dim})]


# tuned per shape and mode on first use (a conv epilogue rewrites its window: the tuner restores it between trials)
_tuned_kernel = triton.autotune(_CONFIGS, key=["N", "K", "PRO", "EPI", "HEAD_DIM"], restore_value=["window"],
                                prune_configs_by={"early_config_prune": _prune})(gemv_kernel)


def gemv(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
         add: torch.Tensor | None = None, add_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
         swiglu: bool = False, residual: torch.Tensor | None = None,
         conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Triton twin of ``gemv_ref``; arguments are 1-D vectors (one token of batch 1), see the module docstring."""
    N, K = weight.shape
    head_dim = norm[0].numel() if gate is not None else 1
    if head_dim & (head_dim - 1):
        raise ValueError(f"the gated-norm prologue needs a power-of-two head size, got {head_dim}")
    pro = 4 if swiglu else 3 if gate is not None else 2 if add is not None else 1 if norm is not None else 0
    epi = 2 if conv is not None else 1 if residual is not None else 0
    window, conv_w, conv_b = conv if conv is not None else (x, x, None)
    y = x.new_empty(N)
    args = (weight, x, y, N, K, weight.stride(0), add if add is not None else x, add_out if add_out is not None else x,
            norm[0] if norm is not None else x, gate if gate is not None else x, norm[1] if norm is not None else 0.,
            residual if residual is not None else x, window, conv_w, conv_b if conv_b is not None else x,
            window.shape[0] if conv is not None else 0)
    consts = dict(PRO=pro, EPI=epi, HAS_CONV_BIAS=conv_b is not None, HEAD_DIM=head_dim,
                  W=window.shape[-1] if conv is not None else 1)
    if x.is_cuda:
        _tuned_kernel[lambda meta: (triton.cdiv(N, meta["BN"]),)](*args, **consts)
    else:  # the interpreter (tests): one small configuration
        bk = min(64, head_dim) if gate is not None else 64
        gemv_kernel[(triton.cdiv(N, 4),)](*args, **consts, BN=4, BK=bk)
    return y
