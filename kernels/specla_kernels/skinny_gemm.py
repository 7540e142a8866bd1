"""Triton kernel: the plain product ``y [M, N] = x [M, K] @ W.T`` of a few token rows (a verify or drafter pass of up
to 64 tree nodes), semantics of :func:`specla_kernels.reference.skinny_gemm_ref`.

At 16 rows a product is bound by streaming ``W``, and cuBLAS streams these at 1.4-2.6 TB/s on an H100 (its 128 x 16
tiles leave a third of the SMs idle on the 1.3B shape's input projection; narrow products run split-K plus a
separate reduction kernel). Here the weight is the left operand: one program owns ``BN`` output columns, i.e. a
``[BN, BK]`` tile of ``W`` per K step against the rows' ``[BK, MP]`` (``MP`` = the rows padded to a power of two, at
least 16), so a 64-column block is a Hopper warpgroup's ``wgmma`` M. The K loop is software-pipelined (weight tiles
stream ``num_stages`` deep). With ``S`` K slices each program writes fp32 partials and the last program of a column
block (a counter per block) sums them in slice order, so the result does not depend on which program finishes first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.masked_attention import _dot

MAX_ROWS = 64   # a tree bucket's nodes


@triton.jit
def skinny_gemm_kernel(x, w, y, part, count, M, N, K, stride_x, stride_w, stride_y, KS,
                       MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    # program (b, s): output columns b * BN .. of every row, reduced over K columns s * KS .. (a multiple of BK)
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    S = tl.num_programs(1)
    n = i_b * BN + tl.arange(0, BN)
    m_n = n < N
    rows = tl.arange(0, MP)
    m_rows = rows < M
    k_hi = tl.minimum(i_s * KS + KS, K)
    w_rows = w + n.to(tl.int64)[:, None] * stride_w
    x_cols = x + rows[None, :] * stride_x
    acc = tl.zeros([BN, MP], dtype=tl.float32)                    # y.T's tile
    for k0 in range(i_s * KS, k_hi, BK):
        cols = k0 + tl.arange(0, BK)
        m_cols = cols < k_hi
        wt = tl.load(w_rows + cols[None, :], mask=m_n[:, None] & m_cols[None, :], other=0.)
        xt = tl.load(x_cols + cols[:, None], mask=m_cols[:, None] & m_rows[None, :], other=0.)
        acc += _dot(wt, xt, IEEE)
    at = n[:, None] * MP + rows[None, :]
    keep = m_n
    if S > 1:
        tl.store(part + i_s * N * MP + at, acc, mask=m_n[:, None])
        # every thread's partial is written before one thread's counter update releases them (acq_rel, GPU scope)
        tl.debug_barrier()
        last = tl.atomic_add(count + i_b, 1, sem="acq_rel") == S - 1
        if last:
            acc = tl.zeros([BN, MP], dtype=tl.float32)
            for t in range(S):       # .cg: read at L2, where the other programs' partials are
                acc += tl.load(part + t * N * MP + at, mask=m_n[:, None], other=0., cache_modifier=".cg")
            tl.atomic_xchg(count + i_b, 0)
        keep = keep & last
    tl.store(y + rows[None, :] * stride_y + n[:, None], acc.to(y.dtype.element_ty),   # the GEMM's rounding
             mask=keep[:, None] & m_rows[None, :])


def default_launch(M: int, N: int, K: int, sms: int) -> dict:
    """A launch for a shape the launch table lacks: 64-column blocks (a warpgroup's M), 128-wide K steps, and as many
    K slices as bring the programs to about two per SM (a program streams at most ~one in-flight pipeline, so a
    product needs several per SM to keep HBM busy), each slice at least four K steps."""
    BN, BK = 64, 128
    blocks = triton.cdiv(N, BN)
    S = max(1, min(triton.cdiv(2 * sms, blocks), K // (4 * BK)))
    return dict(BN=BN, BK=BK, S=S, num_warps=4, num_stages=4)


_workspaces: dict = {}


def _workspace(device: torch.device, MP: int, N: int, S: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums ``[S, N, MP]`` and per-column-block counters (zero between launches) of a product shape on
    ``device``, allocated once: a captured graph keeps reading them. Products of one shape in one stream share them
    (each launch ends before the next begins)."""
    key = (device, MP, N, S)
    if key not in _workspaces or _workspaces[key][1].numel() < blocks:
        _workspaces[key] = (torch.empty(S * N * MP, dtype=torch.float32, device=device),
                            torch.zeros(blocks, dtype=torch.int32, device=device))
    return _workspaces[key]


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """Triton twin of ``skinny_gemm_ref``: ``x [..., M, K]`` (unit-stride rows, ``M <= MAX_ROWS`` rows in all) times
    ``weight [N, K]`` transposed, ``[..., M, N]`` in ``x``'s dtype. ``launch``: ``BN``, ``BK``, ``S`` (K slices),
    ``num_warps``, ``num_stages``; None: ``default_launch`` (one small launch under the interpreter)."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"skinny_gemm: x's rows are {x.shape[-1]} wide, the weight [{N}, {K}] takes {K}")
    if x.dtype != weight.dtype:
        raise ValueError(f"skinny_gemm: x is {x.dtype}, the weight {weight.dtype}; cast one to the other")
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_ROWS} rows, got {M}; larger products belong to cuBLAS")
    if rows.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_gemm needs unit-stride rows of x and of the weight")
    if launch is None:
        launch = (dict(BN=16, BK=16, S=2 if K > 32 else 1, num_warps=1, num_stages=1) if not x.is_cuda else
                  default_launch(M, N, K, torch.cuda.get_device_properties(x.device).multi_processor_count))
    BN, BK, S = launch["BN"], launch["BK"], launch["S"]
    KS = triton.cdiv(triton.cdiv(K, S), BK) * BK              # whole K steps a slice
    S = triton.cdiv(K, KS)
    MP = max(16, triton.next_power_of_2(M))
    blocks = triton.cdiv(N, BN)
    part, count = _workspace(x.device, MP, N, S, blocks)
    y = x.new_empty(*x.shape[:-1], N)
    skinny_gemm_kernel[(blocks, S)](rows, weight, y, part, count, M, N, K, rows.stride(0), weight.stride(0), N, KS,
                                    MP=MP, BN=BN, BK=BK, IEEE=x.dtype == torch.float32,
                                    num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return y
