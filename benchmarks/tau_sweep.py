"""Acceptance (tau) and verify width of draft-tree shapes, for choosing the tree to verify.

Greedy generation with the embedded target and its aligned drafter over held-out prompts (the eval sets), for a grid
of (draft depth, top-k, budget, confidence threshold). tau and node counts do not depend on the device (up to
rounding), so this runs anywhere; with ``--verify-costs`` (a ``profile_step.json`` from the GPU) it also prints the
verify cost of each shape's node bucket, to set against tau.

    python benchmarks/tau_sweep.py --eval-dir DIR --out tau_sweep.json

``DIR`` holds the prompt sets as ``benchmarks/bench_generate.py`` reads them (``mt_bench.jsonl``, ``humaneval.jsonl``,
``alpaca_eval_80.jsonl``; see ``docs/results.md``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from specla_hf.models.graphed import tree_bucket
from specla_hf.app.loading import load_models
from specla_hf.app.prompts import load_prompts

EVAL_FILES = ("mt_bench.jsonl", "humaneval.jsonl", "alpaca_eval_80.jsonl")


def shapes(depths=(4, 6, 8), topks=(2, 4), budgets=(16, 24, 32), thresholds=(0.0, 0.02, 0.05),
           chains: bool = True) -> list[dict]:
    chain = [dict(tree=False, draft_depth=d, confidence_threshold=0.0) for d in depths] if chains else []
    trees = [dict(tree=True, draft_depth=d, tree_topk=k, tree_budget=b, confidence_threshold=t)
             for d, k, b, t in itertools.product(depths, topks, budgets, thresholds)
             if b <= k + k * k * (d - 1)]                 # no more budget than the drafter proposes
    return chain + trees


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--verify-costs", type=Path, default=None, help="profile_step.json (verify_N in ms)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--depths", type=_ints, default=(4, 6, 8), help="comma-separated draft depths")
    ap.add_argument("--topks", type=_ints, default=(2, 4), help="comma-separated tree top-k values")
    ap.add_argument("--budgets", type=_ints, default=(16, 24, 32), help="comma-separated tree budgets")
    ap.add_argument("--thresholds", type=lambda t: tuple(float(x) for x in t.split(",")), default=(0.0, 0.02, 0.05))
    ap.add_argument("--no-chains", action="store_true", help="trees only")
    ap.add_argument("--ngram-weights", type=lambda t: tuple(float(x) for x in t.split(",")), default=None,
                    help="DART drafters: comma-separated bigram weights to sweep (default: the drafter's own)")
    ap.add_argument("--drafter", default=None, help="a drafter folder or hub id for the embedded target (default: "
                    "its aligned EAGLE drafter), e.g. checkpoints/specla-gdn-tiny-dart")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = load_models(drafter=args.drafter, device="cpu", dtype="float32")
    target, drafter, tok = models.target, models.drafter, models.tokenizer
    target.generation_config.eos_token_id = None
    texts = [text for f in EVAL_FILES for _, text in load_prompts(args.eval_dir / f)[:args.per_set]]
    prompts = [tok(t, return_tensors="pt") for t in texts]
    costs = json.loads(args.verify_costs.read_text()) if args.verify_costs else {}
    rows = []
    grid = shapes(args.depths, args.topks, args.budgets, args.thresholds, chains=not args.no_chains)
    weights = args.ngram_weights or (getattr(drafter.config, "ngram_weight", None),)
    if args.ngram_weights and not hasattr(drafter.config, "ngram_weight"):
        raise SystemExit("--ngram-weights needs a DART drafter (--drafter checkpoints/specla-gdn-tiny-dart)")
    grid = [(w, shape) for w in weights for shape in grid]
    for weight, shape in tqdm(grid, desc="tree shapes"):
        if weight is not None:
            drafter.config.ngram_weight = weight        # read by each generate call's DartDrafter
        taus, nodes, draft_ms = [], [], []
        for p in prompts:
            target.generate(**p, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter,
                            **shape)
            st = target.specla_stats
            taus.append(st.tau)
            nodes.append(sum(st.draft_nodes) / st.steps)
            draft_ms.append(st.draft_time / st.steps * 1e3)
        # drafting time per step on this CPU, one thread: what the drafter's passes cost here, not on a GPU
        row = {**shape, "ngram_weight": weight, "tau": statistics.mean(taus),
               "nodes_per_step": statistics.mean(nodes), "cpu_draft_ms_per_step": statistics.mean(draft_ms)}
        bucket = tree_bucket(round(row["nodes_per_step"]) + 1)
        if f"verify_{bucket}" in costs:
            row["verify_ms_at_bucket"] = costs[f"verify_{bucket}"]
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"drafter": models.drafter_name, "prompts": len(prompts),
                                        "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
    print(f"drafter: {models.drafter_name}")
    print("| drafting | depth | top-k | budget | threshold | bigram weight | tau | nodes / step | "
          "CPU draft ms / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["tau"]):
        kind = "tree" if r["tree"] else "chain"
        print(f"| {kind} | {r['draft_depth']} | {r.get('tree_topk', 1)} | {r.get('tree_budget', r['draft_depth'])} | "
              f"{r['confidence_threshold']} | {r['ngram_weight']} | {r['tau']:.2f} | {r['nodes_per_step']:.1f} | "
              f"{r['cpu_draft_ms_per_step']:.1f} |")


if __name__ == "__main__":
    main()
