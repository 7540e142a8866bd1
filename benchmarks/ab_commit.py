"""GPU A/B of the all-layer commit: another version of ``commit.py`` against the working tree's, in one run.

    git show REV:kernels/specla_kernels/commit.py > .device/commit_base.py    # here, before the device call
    python benchmarks/ab_commit.py --base .device/commit_base.py [--tiles JSON]   # on the GPU machine

For each case (drafted trees as the default drafter submits them, and deep ones: a main chain with side branches) it
builds 21 layers of 1.3B-shape inputs (``bench_kernels.layer_inputs``), verifies them with the working tree's kernel
for the factors, and commits the tree's deepest path, every layer's state and conv window in one launch:
- ``base``: the other version as it is called (a version from before the path was handed over takes the accepted
  node and the ancestor mask);
- ``loop``: the working tree's kernel with the path as the device loop's acceptance step hands it over, ``host``
  as the host loop's commit graphs hold it (``bench_kernels.handed_paths``);
- each of ``--tiles`` (``commit_tile`` overrides) with either path.
Each setup's states and windows are checked on layer 0 against the torch reference, then every setup is timed as one
CUDA graph (L2 flushed before each replay) in alternating rounds, so that drift hits every setup alike; the median of
the rounds is reported. With ``$OUT`` set the rows go to ``$OUT/ab_commit.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_tree_verify import load_module  # noqa: E402
from bench_kernels import (LAYERS, bench_graph, deep_tree, drafted_tree, handed_paths, layer_inputs,  # noqa: E402
                           rel)

from specla_kernels import commit  # noqa: E402
from specla_kernels import reference as ref  # noqa: E402
from specla_kernels.tree_delta import tree_ancestors, tree_gated_delta_rule  # noqa: E402

CASES = [("drafted", n) for n in (1, 4, 16, 32, 64, 128)] + [("deep", n) for n in (16, 64, 128)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other version's commit.py")
    ap.add_argument("--tiles", default="[]", help="JSON list of commit_tile overrides to add (both paths)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    base = load_module(args.base)
    tiles = json.loads(args.tiles)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kind, n in CASES:
        parents = (drafted_tree if kind == "drafted" else deep_tree)(n, gen).cuda()
        anc = tree_ancestors(parents)
        depth = ref.tree_depth(ref.tree_ancestors(parents.cpu()))[0]
        accepted = depth.argmax().reshape(1).cuda()                        # the deepest path
        path_len = int(depth.max()) + 1
        layers = [layer_inputs(n, gen, "cuda") for _ in range(LAYERS)]
        for L in layers:
            L["k_hat"], L["u"] = tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents,
                                                       L["state"])[1:]
        L0 = layers[0]
        want = (ref.commit_state_ref(L0["state"], L0["k_hat"], L0["u"], L0["g"], parents, accepted),
                ref.commit_window_ref(L0["x"], L0["window"], parents, accepted))
        loop, host = handed_paths(anc, accepted).values()

        def parts(ls):
            return dict(states=tuple([L[name] for L in ls] for name in ("state", "k_hat", "u", "g")),
                        windows=([L["x"] for L in ls], [L["window"] for L in ls]))
        setups = [("base", lambda ls: base.commit_(parents, accepted, ancestors=anc, **parts(ls))),
                  ("loop", lambda ls: commit.commit_(*loop, **parts(ls))),
                  ("host", lambda ls: commit.commit_(*host, **parts(ls)))] + [
            (f"{name} {t}", lambda ls, t=t, p=p: commit.commit_(*p, tile=t, **parts(ls)))
            for t in tiles for name, p in (("loop", loop), ("host", host))]
        runs = []
        for name, fn in setups:
            saved = (L0["state"].clone(), L0["window"].clone())
            fn(layers[:1])
            err = (rel(L0["state"], want[0]), bool(torch.equal(L0["window"], want[1])))
            L0["state"].copy_(saved[0])
            L0["window"].copy_(saved[1])
            runs.append(dict(setup=name, state_err=err[0], window_equal=err[1], ms=[]))
        for _ in range(args.rounds):
            for (name, fn), run in zip(setups, runs):
                run["ms"].append(bench_graph(lambda fn=fn: fn(layers), rep_ms=40))
        for run in runs:
            run["median_us"] = 1e3 * sorted(run["ms"])[len(run["ms"]) // 2]
        rows.append(dict(tree=kind, N=n, path_len=path_len, runs=runs))
        print(f"{kind} N={n} path {path_len}: " + "; ".join(
            f"{r['setup']} {r['median_us']:.1f} us (state err {r['state_err']:.1e}, window "
            f"{'ok' if r['window_equal'] else 'WRONG'})" for r in runs), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "ab_commit.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print("\n| tree | N | path | " + " | ".join(r["setup"] for r in rows[0]["runs"]) + " |")
    print("|---|---|---|" + "---|" * len(rows[0]["runs"]))
    for row in rows:
        print(f"| {row['tree']} | {row['N']} | {row['path_len']} | "
              + " | ".join(f"{r['median_us']:.1f}" for r in row["runs"]) + " |")


if __name__ == "__main__":
    main()
