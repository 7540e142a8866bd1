"""GPU A/B of the tree verify: another version of ``tree_delta.py`` against the working tree's, in one run.

    git show REV:kernels/specla_kernels/tree_delta.py > .device/tree_delta_base.py    # here, before the device call
    python benchmarks/ab_tree_verify.py --base .device/tree_delta_base.py               # on the GPU machine

For each case (a tree shape, node count and, for comb trees, depth) it builds 21 layers of 1.3B-shape bf16 inputs
(``bench_kernels.layer_inputs``), checks each kernel's ``o``, ``u`` and ``k̂`` on layer 0 against the torch
reference, then times every setup as one CUDA graph of the 21 layers (L2 flushed before each replay), in alternating
rounds so that drift hits every setup alike, and reports the median of the rounds. ``--variants`` adds launch
configs of the working tree's kernel (``tree_gated_delta_rule``'s ``config``) to every case. The machine's device
needs no network: the base file travels with the repo. With ``$OUT`` set the rows go to ``$OUT/ab_tree_verify.json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import LAYERS, bench_graph, comb_tree, deep_tree, drafted_tree, layer_inputs, rel  # noqa: E402

from specla_kernels import reference as ref  # noqa: E402
from specla_kernels import tree_delta  # noqa: E402

# (tree, nodes, depth of a comb tree): drafted trees as the default drafter submits them (depth 8), comb trees of a
# given depth (the slope is a depth sweep's cost), deep trees (a main chain with side branches: the block solve)
CASES = [("drafted", 64, None), ("comb", 64, 1), ("comb", 64, 4), ("comb", 64, 8), ("comb", 64, 16), ("comb", 64, 24),
         ("deep", 64, None), ("drafted", 32, None), ("comb", 32, 4), ("drafted", 16, None), ("drafted", 128, None),
         ("deep", 128, None), ("deep", 16, None), ("deep", 32, None)]


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("tree_delta_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree(kind: str, n: int, depth: int | None, gen: torch.Generator) -> torch.Tensor:
    if kind == "comb":
        return comb_tree(n, depth, gen)
    return drafted_tree(n, gen) if kind == "drafted" else deep_tree(n, gen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other version's tree_delta.py")
    ap.add_argument("--variants", default="[]", help="JSON list of configs of the working tree's kernel to add")
    ap.add_argument("--variant-nodes", default="", help="node counts the variants run at (comma-separated; all)")
    ap.add_argument("--nodes", default="", help="only the cases of these node counts (comma-separated; all)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    base = load_module(args.base)
    variants = json.loads(args.variants)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    rows = []
    nodes = {int(x) for x in args.nodes.split(",") if x}
    variant_nodes = {int(x) for x in args.variant_nodes.split(",") if x}
    for kind, n, comb_depth in CASES:
        if nodes and n not in nodes:
            continue
        parents = tree(kind, n, comb_depth, gen).cuda()
        depth = int(ref.tree_depth(ref.tree_ancestors(parents.cpu())).max())
        layers = [layer_inputs(n, gen, "cuda") for _ in range(LAYERS)]
        L0 = layers[0]
        want = ref.tree_gated_delta_rule_ref(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents, L0["state"])
        setups = [("base", base, {}), ("working tree", tree_delta, {})] + [
            ("working tree", tree_delta, c) for c in variants if not variant_nodes or n in variant_nodes]
        runs = []
        for name, module, config in setups:
            got = module.tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents, L0["state"],
                                               config=config)
            anc = module.tree_ancestors(parents)

            def fn(module=module, config=config, anc=anc):
                return [module.tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"],
                                                     ancestors=anc, config=config) for L in layers]
            runs.append(dict(tree=kind, N=n, depth=depth, kernel=name, config=config, fn=fn, times_us=[],
                             **{f"{x}_err": rel(a, b) for x, a, b in zip(("o", "k_hat", "u"), got, want)}))
        for _ in range(args.rounds):
            for r in runs:
                r["times_us"].append(bench_graph(r["fn"], rep_ms=40) * 1e3)
        for r in runs:
            del r["fn"]
            r["us_21"] = sorted(r["times_us"])[len(r["times_us"]) // 2]
            rows.append(r)
            print(json.dumps(r), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "ab_tree_verify.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}; 21 layers in one CUDA graph, median of {args.rounds} alternating rounds")
    print("\n| tree | N | depth | kernel | config | 21L us | o err | u err |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['N']} | {r['depth']} | {r['kernel']} | {r['config'] or '-'} | {r['us_21']:.1f} "
              f"| {r['o_err']:.1e} | {r['u_err']:.1e} |")


if __name__ == "__main__":
    main()
