"""Triton kernel: a drafter pass's input rows ``[norm_e(E[token]) ; norm_f(feature)]``
(:func:`specla_kernels.reference.embed_norm_cat_ref`).

The EAGLE-style drafter and the MTP head both start a pass by looking up the target's embedding of each node's token,
RMS-normalising it and the node's feature with norms of their own, and concatenating the two before their input
projection. As torch ops that is four launches a pass (the lookup, two norms, the concatenation), and the lookup
alone, aten's small-index gather, walks the tokens one after another. Here one program normalises one half of one
row: the token's embedding row (read from the table in place) or its feature, in fla's row-norm arithmetic (fp32,
``x / sqrt(mean(x^2) + eps) * w``, rounded once on the store).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels import pdl


@triton.jit
def embed_norm_cat_kernel(table, stride_table, tokens, feature, stride_feature, w_e, w_f, y, H, eps_e, eps_f,
                          FEATURE_FIRST: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    i_t, half = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o = tl.arange(0, BH)
    m = o < H
    if half == 0:                                    # weights: before the wait (pdl.py)
        b_w = tl.load(w_e + o, mask=m).to(tl.float32)
        eps = eps_e
    else:
        b_w = tl.load(w_f + o, mask=m).to(tl.float32)
        eps = eps_f
    pdl.wait_for_inputs(PDL)
    if half == 0:
        token = tl.load(tokens + i_t).to(tl.int64)
        b_x = tl.load(table + token * stride_table + o, mask=m, other=0.).to(tl.float32)
    else:
        b_x = tl.load(feature + i_t * stride_feature + o, mask=m, other=0.).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / H + eps)
    at = (1 - half if FEATURE_FIRST else half) * H
    tl.store(y + i_t * 2 * H + at + o, (b_x * b_rstd * b_w).to(y.dtype.element_ty), mask=m)


def embed_norm_cat(table: torch.Tensor, tokens: torch.Tensor, feature: torch.Tensor, w_e: torch.Tensor, eps_e: float,
                   w_f: torch.Tensor, eps_f: float, feature_first: bool = False) -> torch.Tensor:
    """Triton twin of ``embed_norm_cat_ref``: ``table [V, H]`` (unit-stride rows), ``tokens [..., T]``, ``feature
    [..., T, H]`` (rows may be strided) -> ``[..., T, 2H]`` in ``feature``'s dtype."""
    H = feature.shape[-1]
    if table.shape[-1] != H or w_e.shape != (H,) or w_f.shape != (H,) or tokens.shape != feature.shape[:-1]:
        raise ValueError(f"embed_norm_cat: feature {list(feature.shape)} needs tokens {list(feature.shape[:-1])}, a "
                         f"[vocab, {H}] table and scales of {H}; got tokens {list(tokens.shape)}, table "
                         f"{list(table.shape)}, scales {list(w_e.shape)} / {list(w_f.shape)}")
    if table.stride(-1) != 1 or feature.stride(-1) != 1:
        raise ValueError("embed_norm_cat needs unit-stride rows of the table and the feature")
    rows, tokens = feature.reshape(-1, H), tokens.reshape(-1)
    T = rows.shape[0]
    y = feature.new_empty(*feature.shape[:-1], 2 * H)
    if not T:
        return y
    on = pdl.small_enabled(feature.device)
    BH = triton.next_power_of_2(H)
    embed_norm_cat_kernel[(T, 2)](table, table.stride(0), tokens, rows, rows.stride(0), w_e, w_f, y, H, eps_e,
                                  eps_f, FEATURE_FIRST=feature_first, BH=BH, PDL=on,
                                  num_warps=8 if BH >= 4096 else 4, launch_pdl=on)
    return y
