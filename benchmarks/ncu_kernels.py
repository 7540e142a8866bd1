"""Run each kernel of the one-token step and of verification once, eagerly, at the 1.3B shape, so Nsight Compute can
read its hardware counters: the one-token step's five fused GEMVs, fla's one-token recurrence, the tree verify at 16 and 64
nodes (the drafted tree's shape) and the all-layer commit of 16 and 64 nodes.

    python benchmarks/ncu_kernels.py          # first: compiles, and tunes the GEMVs (cached with
                                              # TRITON_CACHE_AUTOTUNING=1, so the profiled run does not re-tune)
    ncu --clock-control none --kernel-name regex:'gemv|tree_gdn|commit_kernel|fused_recurrent' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats python benchmarks/ncu_kernels.py

Each kernel runs ``--repeat`` times (default 2, after one warm-up launch) with the same inputs.
"""
from __future__ import annotations

import argparse

import torch

from bench_gemv import products
from bench_kernels import LAYERS, drafted_tree, layer_inputs
from specla_kernels import reference as ref
from specla_kernels.commit import commit_, root_path
from specla_kernels.gemv import gemv
from specla_kernels.tree_delta import tree_ancestors, tree_gated_delta_rule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    torch.backends.cuda.matmul.allow_tf32 = False
    calls = []
    cases, _ = products()
    for name, (w, x, kw) in cases.items():
        calls.append((name, lambda w=w, x=x, kw=kw: gemv(w, x, **kw)))
    gen = torch.Generator().manual_seed(0)
    one = layer_inputs(1, gen, "cuda")
    calls.append(("fla one-token recurrence", lambda: fla_recurrent(
        q=one["q"], k=one["k"], v=one["v"], g=one["g"], beta=one["beta"], initial_state=one["state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True)))
    for n in (16, 64):
        parents = drafted_tree(n, gen).to("cuda")
        anc = tree_ancestors(parents)
        layers = [layer_inputs(n, gen, "cuda") for _ in range(LAYERS)]
        L0 = layers[0]
        calls.append((f"tree verify {n}", lambda L=L0, p=parents, a=anc: tree_gated_delta_rule(
            L["q"], L["k"], L["v"], L["g"], L["beta"], p, L["state"], ancestors=a)))
        factors = [tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"])[1:]
                   for L in layers]
        path = root_path(anc, ref.tree_depth(ref.tree_ancestors(parents))[0].argmax().reshape(1))
        calls.append((f"commit {n}", lambda path=path, ls=layers, fs=factors: commit_(
            *path, states=([L["state"] for L in ls], [kh for kh, _ in fs], [u for _, u in fs], [L["g"] for L in ls]),
            windows=([L["x"] for L in ls], [L["window"] for L in ls]))))
    for name, fn in calls:
        fn()                                   # compile / tune outside what is profiled
    torch.cuda.synchronize()
    for name, fn in calls:
        torch.cuda.nvtx.range_push(name)
        for _ in range(args.repeat):
            fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("ran:", ", ".join(name for name, _ in calls))


if __name__ == "__main__":
    main()
