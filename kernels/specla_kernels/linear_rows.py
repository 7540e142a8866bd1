"""Triton kernel: ``y = f(x) @ W^T`` for a few rows (a verify pass's tree nodes), with the same fused prologues and
residual epilogue as the one-token GEMV (:mod:`specla_kernels.gemv`).

Semantics of :func:`specla_kernels.reference.gemv_ref` with ``x [M, K]``, ``M <= 128``. A verify pass at the 1.3B
shape is cuBLAS's products plus a dozen small kernels per layer (norms, the residual add, SwiGLU, the split-K
reductions): 298 launches for 16 nodes in session 4's profile, with ~0.5 ms of gaps. Here a layer's four products
carry those ops: RMSNorm (optionally of ``x + add``, the sum written to ``add_out``), the gated head norm or SwiGLU
before the product, a residual after it. The conv epilogue of the one-token GEMV has no twin: a tree's short conv
follows each node's ancestors (``tree_conv``).

One program owns ``BN`` output columns and all ``M`` rows (padded to ``BM >= 16`` for ``tl.dot``); it loops over
``K`` in ``BK`` chunks, so Triton pipelines the weight loads that feed the dot. Norm statistics are a first pass
over the rows (cache-resident). No split-K: deterministic sums. 16-bit inputs multiply on the tensor cores with fp32
accumulation (operands already rounded to the model dtype, as the unfused GEMM's are); fp32 inputs use exact fp32
products (``input_precision="ieee"``), as do interpreted runs (the interpreter multiplies 16-bit dot operands as
raw bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.gemv import (GATED_NORM, NO_EPILOGUE, NORM, NORM_ADD, PLAIN, RESIDUAL, SWIGLU, TUNE_BYTES,
                                 _cold_bench)
from specla_kernels.tree_delta import INTERPRETED

MAX_ROWS = 128


@triton.jit
def linear_rows_kernel(w, x, y, M, N, K, stride_w, stride_x, stride_y, x2, stride_x2, add_out, norm_w, gate,
                       stride_gate, eps, res, stride_res,
                       PRO: tl.constexpr, EPI: tl.constexpr, HEAD_DIM: tl.constexpr, LOWP_DOT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    m_rows = rows < M
    cols = pid * BN + tl.arange(0, BN)
    m_cols = cols < N
    x_rows = x + rows.to(tl.int64)[:, None] * stride_x
    rstd = tl.zeros([BM], dtype=tl.float32)
    if PRO == NORM or PRO == NORM_ADD:
        # each row's mean square (program 0 also writes x + x2, the residual stream after the add)
        sq = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            m = m_rows[:, None] & (ks < K)[None, :]
            xv = tl.load(x_rows + ks[None, :], mask=m, other=0.).to(tl.float32)
            if PRO == NORM_ADD:
                xv += tl.load(x2 + rows.to(tl.int64)[:, None] * stride_x2 + ks[None, :], mask=m, other=0.).to(
                    tl.float32)
                if pid == 0:
                    tl.store(add_out + rows.to(tl.int64)[:, None] * K + ks[None, :],
                             xv.to(add_out.dtype.element_ty), mask=m)
            sq += tl.sum(xv * xv, 1)
        rstd = 1 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    w_cols = w + cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        m_k = ks < K
        m = m_rows[:, None] & m_k[None, :]
        xv = tl.load(x_rows + ks[None, :], mask=m, other=0.).to(tl.float32)
        if PRO == NORM:
            rhs = xv * rstd[:, None] * tl.load(norm_w + ks, mask=m_k, other=0.).to(tl.float32)[None, :]
        elif PRO == NORM_ADD:
            xv += tl.load(x2 + rows.to(tl.int64)[:, None] * stride_x2 + ks[None, :], mask=m, other=0.).to(tl.float32)
            rhs = xv * rstd[:, None] * tl.load(norm_w + ks, mask=m_k, other=0.).to(tl.float32)[None, :]
        elif PRO == GATED_NORM:
            # this chunk lies in one head (BK divides HEAD_DIM): each row's statistic of that head
            head = (k0 // HEAD_DIM) * HEAD_DIM + tl.arange(0, HEAD_DIM)
            hv = tl.load(x_rows + head[None, :], mask=m_rows[:, None], other=0.).to(tl.float32)
            h_rstd = 1 / tl.sqrt(tl.sum(hv * hv, 1) / HEAD_DIM + eps)
            gv = tl.load(gate + rows.to(tl.int64)[:, None] * stride_gate + ks[None, :], mask=m, other=0.).to(
                tl.float32)
            rhs = xv * h_rstd[:, None] * tl.load(norm_w + ks % HEAD_DIM, mask=m_k, other=0.).to(tl.float32)[None, :]
            rhs = rhs * gv * tl.sigmoid(gv)
        elif PRO == SWIGLU:
            up = tl.load(x_rows + K + ks[None, :], mask=m, other=0.).to(tl.float32)
            rhs = xv * tl.sigmoid(xv) * up
        else:
            rhs = xv
        wt = tl.load(w_cols + ks[None, :], mask=m_cols[:, None] & m_k[None, :], other=0.)
        if LOWP_DOT:
            acc += tl.dot(rhs.to(wt.dtype), tl.trans(wt))
        else:
            # operands rounded to the model dtype first, then exact fp32 products
            acc += tl.dot(rhs.to(x.dtype.element_ty).to(tl.float32), tl.trans(wt.to(tl.float32)),
                          input_precision="ieee")
    out = acc.to(y.dtype.element_ty)                        # the product, rounded as the unfused GEMM's output
    m_out = m_rows[:, None] & m_cols[None, :]
    if EPI == RESIDUAL:
        r = tl.load(res + rows.to(tl.int64)[:, None] * stride_res + cols[None, :], mask=m_out, other=0.)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], out, mask=m_out)


def _configs():
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=4, num_stages=st)
            for bn, bk, st in [(16, 256, 4), (32, 128, 4), (32, 256, 3), (64, 128, 4), (64, 64, 5), (128, 64, 4)]]


def _prune(configs, named_args, **kwargs):
    """At most 64 accumulator elements per thread; a gated-norm prologue needs each K chunk inside one head (BK
    divides the head size)."""
    ok = [c for c in configs if kwargs["BM"] * c.kwargs["BN"] <= 64 * 32 * c.num_warps and
          (kwargs["PRO"] != GATED_NORM.value or kwargs["HEAD_DIM"] % c.kwargs["BK"] == 0)]
    return ok or [triton.Config({"BN": 16, "BK": min(64, kwargs["HEAD_DIM"])}, num_warps=4)]


_tuned_kernel = triton.autotune(_configs(), key=["M", "N", "K", "PRO", "EPI", "HEAD_DIM", "BM"],
                                prune_configs_by={"early_config_prune": _prune}, do_bench=_cold_bench)(
    linear_rows_kernel)


def linear_rows(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                add: torch.Tensor | None = None, add_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``gemv_ref`` for ``x [M, K]`` (``[M, 2K]`` with ``swiglu``), ``M <= 128``: returns
    ``y [M, N]``. ``x``, ``add``, ``gate`` and ``residual`` may be row-strided views (unit column stride);
    ``add_out`` must be a contiguous ``[M, K]``."""
    N, K = weight.shape
    M = x.shape[0]
    if x.dim() != 2 or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"linear_rows takes [rows <= {MAX_ROWS}, features], got shape {tuple(x.shape)}")
    head_dim = norm[0].numel() if gate is not None else 1
    if gate is not None and (head_dim & (head_dim - 1) or K % head_dim):
        raise ValueError(f"the gated-norm prologue needs a power-of-two head size dividing {K}, got {head_dim}")
    unit = lambda t: t if t is None or t.stride(-1) == 1 else t.contiguous()    # noqa: E731
    x, add, gate, residual = unit(x), unit(add), unit(gate), unit(residual)
    if add_out is not None and not add_out.is_contiguous():
        raise ValueError("add_out must be contiguous")
    pro = (SWIGLU if swiglu else GATED_NORM if gate is not None else NORM_ADD if add is not None else
           NORM if norm is not None else PLAIN).value
    epi = (RESIDUAL if residual is not None else NO_EPILOGUE).value
    y = x.new_empty(M, N)
    args = (weight, x, y, M, N, K, weight.stride(0), x.stride(0), y.stride(0),
            add if add is not None else x, add.stride(0) if add is not None else 0,
            add_out if add_out is not None else x, norm[0] if norm is not None else x,
            gate if gate is not None else x, gate.stride(0) if gate is not None else 0,
            norm[1] if norm is not None else 0., residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0)
    consts = dict(PRO=pro, EPI=epi, HEAD_DIM=head_dim, BM=max(16, triton.next_power_of_2(M)),
                  LOWP_DOT=x.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED)
    if x.is_cuda and weight.numel() * weight.element_size() >= TUNE_BYTES:
        _tuned_kernel[lambda meta: (triton.cdiv(N, meta["BN"]),)](*args, **consts)
    else:   # small products, and the interpreter: one configuration
        bk = min(64, head_dim) if gate is not None else 64
        linear_rows_kernel[(triton.cdiv(N, 32),)](*args, **consts, BN=32, BK=bk, num_warps=4)
    return y
