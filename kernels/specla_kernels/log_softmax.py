"""Triton kernel: fp32 log-softmax of each row of 16-bit or fp32 logits (a drafter's draft log-probs, every depth).

Semantics of :func:`specla_kernels.reference.log_softmax_ref` (``torch.log_softmax(x.float(), -1)``) up to fp32
rounding: ``(x - max) - log(sum(exp(x - max)))`` per row. From bf16 logits aten launches a cast and then its softmax
kernel, one block per row (10.5 us for 4 rows of 32K entries on an H100, a tenth of an MTP draft depth). Here one
program per row: a row of up to ``ONE_PASS`` entries is held in registers and written once; a longer row is read
twice, an online max and sum and then the write.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ONE_PASS = 32768          # the longest row held in registers (64 per thread at 16 warps)
LOOP_BLOCK = 4096         # entries per step of a longer row


@triton.jit
def log_softmax_kernel(x, out, V, stride_x, stride_out, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x += row * stride_x
    out += row * stride_out
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        v = tl.load(x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        top = tl.max(v, 0)
        shifted = v - top
        tl.store(out + cols, shifted - tl.log(tl.sum(tl.exp(shifted), 0)), mask=cols < V)
    else:
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0., tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(v, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(v - new_top), 0)
            top = new_top
        log_total = tl.log(total)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x + cols, mask=cols < V, other=0.).to(tl.float32)
            tl.store(out + cols, (v - top) - log_total, mask=cols < V)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``log_softmax_ref``: ``x [..., V]`` -> fp32 log-probs of the same shape."""
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.numel():
        one = V <= ONE_PASS
        block = triton.next_power_of_2(V) if one else LOOP_BLOCK
        log_softmax_kernel[(rows.shape[0],)](rows, out, V, rows.stride(0), out.stride(0), BLOCK=block,
                                             ONE_BLOCK=one, num_warps=16 if block >= 16384 else 8 if block >= 2048
                                             else 4)
    return out.view(x.shape)
