"""Programmatic dependent launch (PDL) for the one-token step's GEMVs, on compute capability 9.0 (Hopper) and later.

A decode step is a chain of short dependent kernels; between two of them the GPU drains the first, then schedules
the second. A kernel launched with PDL may be scheduled while the kernel before it in the stream still runs, once
every program of that kernel has called ``gdc_launch_dependents``; it must not read what that kernel writes, nor
write anything, before ``gdc_wait`` returns. The GEMV (``gemv.py``) allows its dependents first, issues its first
weight load (weights depend on no kernel), then waits. Kernels of other libraries in between (fla's recurrence,
torch's) launch normally, and a PDL kernel after one of them waits for it to finish. Graph capture keeps PDL edges.

Measured on the H200 (settings alternating): the step replay 1.242 -> 1.154 ms and 32 greedy steps 1.205 -> 1.142
ms per token with PDL. The verify pass's small kernels launch normally: ``pdl_small_kernels`` (``tuning``) launches the tree conv,
gates, tree verify and gated norm with PDL (``profile_step.py --ab pdl_small`` compares), and in an alternating A/B
inside the model it changed nothing measurable (64-node verify pass 2.073 ms against 2.070-2.071, the drafter's pass
3% slower). Before their wait those kernels read only weights and what the pass found already committed (the state,
the conv window, the ancestor mask): in a verify or drafter pass a cuBLAS GEMM, launched normally, precedes each
layer's run of these kernels, so everything before it has finished.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specla_kernels import tuning

def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL (``tuning``'s ``pdl``; never under the interpreter: tensors are
    on the CPU)."""
    return tuning.active().pdl and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def small_enabled(device: torch.device) -> bool:
    """Whether the verify pass's small kernels (``tuning``'s ``pdl_small_kernels``) launched on ``device`` use PDL."""
    return tuning.active().pdl_small_kernels and enabled(device)


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (it still waits for this one before reading its outputs)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()
