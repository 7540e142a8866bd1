"""The kernels' launch choices as data: one ``KernelTuning`` value, read when a kernel is launched or captured.

Defaults are what was measured best on an H200 (the reasons are on each field). A benchmark that compares choices
builds and captures under each one (``with using(pdl=False): ...``) instead of rebinding module globals; the GEMV
launch table for the one-token step is a JSON file written by ``benchmarks/tune_step.py`` (how to tune for another
GPU or model shape: ``docs/kernels.md``).
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

STEP_CONFIGS_FILE = Path(__file__).with_name("gemv_step_configs.json")


def step_config_entries(path: Path = STEP_CONFIGS_FILE) -> list[dict]:
    """The product entries of a file ``benchmarks/tune_step.py`` wrote (none: ``[]``), over all its runs (one per GPU
    and model shape)."""
    if not path.exists():
        return []
    return [e for run in json.loads(path.read_text())["runs"] for e in run["products"]]


def load_step_configs(path: Path = STEP_CONFIGS_FILE) -> dict[tuple, dict]:
    """``{product_key: launch}`` of ``step_config_entries``; ``launch`` is ``split`` (columns per program, 0 for the
    row-owner kernel) and the kernel's launch shape."""
    return {(e["device"], e["dtype"], e["N"], e["K"], e["PRO"], e["EPI"], e["KC"]): e["launch"]
            for e in step_config_entries(path)}


@dataclass(frozen=True)
class KernelTuning:
    # programmatic dependent launch for the one-token step's GEMVs (each lets the next kernel start early and requests
    # its first weight block before waiting for the previous kernel's writes)
    pdl: bool = True
    # PDL for the verify pass's small kernels too (tree conv, gates, tree verify, gated norm): no measured gain
    pdl_small_kernels: bool = False
    # large GEMV products with at most this many rows take split-K with ``gemv_split_cols`` columns per program (more
    # rows fill the GPU by rows alone; 0: none split). H200, 1.3B shape, 21 copies back to back, row-owner / split 512
    # / split 1024 us: o_proj 7.7-7.9 / 6.8-7.0 / 6.4-7.1, down 10.3 / 9.6 / 9.0, in_proj 14.5 / 15.0 / 13.9-14.0
    gemv_split_max_rows: int = 10240
    gemv_split_cols: int = 1024
    # a fixed launch shape for the large row-owner products instead of tuning (A/Bs)
    gemv_row_config: dict | None = None
    # launch shapes chosen by timing whole one-token steps, before the split rule and the autotuner (an explicit
    # ``split``/``config`` or ``gemv_row_config`` still wins): the autotuner times each product alone after an L2
    # flush, and its picks can lose among the step's other kernels (H200: in_proj's pick 21.3 us, the best of the
    # same candidates 13.3)
    gemv_step_configs: Mapping[tuple, dict] = field(default_factory=load_step_configs)
    # verified trees of up to this many nodes (at most 64) run the GDN layers' products as ``fused_gemm`` with the
    # norms, SwiGLU and residual adds fused (7 launches a layer instead of 14) instead of cuBLAS GEMMs; 0: never.
    # Off: with its autotuned launches a graphed 16-node pass of the 1.3B shape took 3.01 ms against 1.72 / 1.79
    # through cuBLAS (H200, ``profile_step.py --ab fused_verify_16``)
    fused_verify_max_nodes: int = 0
    # the one-token step's products through ``fused_gemm`` on one row (its pipelined tl.dot K loop) instead of the
    # GEMV kernels. Not yet timed on a GPU (``benchmarks/profile_step.py --ab one_token_gemm``)
    one_token_fused_gemm: bool = False
    # node counts up to which the node-by-node tree verify runs (H200, 21 layers, bf16: 85 / 95 / 153 us at 1 / 2 / 4
    # nodes against the WY/UT kernel's 166 / 179 / 193; at 8 nodes the WY/UT kernel wins)
    tree_small_max: int = 4
    # the WY/UT kernel's solve per padded node count: trees of depth <= this by sweeps, deeper ones by the block solve
    # (absent: the block solve always); at 64 nodes sweeps take 229-356 us by depth, the block solve ~400
    tree_sweeps: Mapping[int, int] = field(default_factory=lambda: {64: 16, 128: 16})
    # the kernels of the hybrids' attention calls (verify passes, prompt chains, the MTP head, the one-token step):
    # "specla" for ``ops.masked_attention``'s kernel where it takes the call, and/or SDPA backends
    # (``torch.nn.attention.SDPBackend`` names, lower case) for the rest; empty: SDPA, torch's choice. On the H200
    # torch's choice for a tree mask is cuDNN's kernel, 117-120 us a call at a 2048-slot cache
    tree_attention_backends: tuple[str, ...] = ("specla",)
    # sampling under the temperature / top-k / top-p warpers alone: the warpers applied inside the kernels, for a
    # drafter's children (``ops.draw_children``: one launch a depth with the draws at vocabularies up to 16K) and the
    # target's probabilities over a verified tree (``ops.warped_probs``), instead of in torch (~5 launches more each,
    # torch.topk's radix select among them, and under top-p a sort of every row)
    draw_warpers: bool = True


_ACTIVE = [KernelTuning()]


def active() -> KernelTuning:
    """The tuning kernels launched or captured now read."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def using(**changes) -> Iterator[KernelTuning]:
    """The active tuning with ``changes`` (``KernelTuning`` field names) for the calls made inside."""
    _ACTIVE.append(replace(active(), **changes))
    try:
        yield _ACTIVE[-1]
    finally:
        _ACTIVE.pop()
