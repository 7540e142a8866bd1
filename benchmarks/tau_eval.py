"""Acceptance (tau) of a target and drafter pair on held-out prompts, chain and tree, greedy, checked against plain
decoding: any target ``AutoModelForCausalLM`` loads and SpecLA drives (fla GDN or a GDN hybrid), any drafter for it.

    python benchmarks/tau_eval.py --target checkpoints/specla-qwen35-tiny \\
        --drafters checkpoints/specla-qwen35-tiny-drafter mtp --eval-dir EVAL --out tau.json

``EVAL`` holds the prompt sets (``mt_bench.jsonl``, ``humaneval.jsonl``, ``alpaca_eval_80.jsonl``; the first
``--per-set`` prompts of each, as raw text); ``layer-skip`` drafts with the target's first block, ``mtp`` with the MTP
head in the target's checkpoint. tau counts the tokens a verify pass emits: accepted drafts plus the target's own,
over all prompts together. Every prompt decodes to ``--max-new-tokens`` (no EOS), in float32 (on a CPU one thread;
on a GPU with TF32 off, so that the comparison with plain decoding is exact). ``--temperatures 0.7 1.0`` adds tau
under sampling at each temperature, in the configured shapes (``adaptive_drafting=False``: acceptance, not the shape
a device's timings choose), with drafts drawn from the drafter (the default) and its top-k drafts
(``sampled_drafts=False``), each prompt with the same seed under both; ``--draft-temperature-ratios`` adds drafts
drawn at those ratios of the drafter's temperature to the target's (``draft_temperature_ratio``; the drafter's own
calibrated ratio otherwise).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specla_hf  # noqa: F401  (generate(assistant_model=...) and the CPU paths)
from specla_hf.app.choices import LAYER_SKIP, MTP
from specla_hf.app.loading import layer_skip_drafter
from specla_hf.app.prompts import load_prompts
from specla_hf.training.train_drafter import continue_text

EVAL_FILES = ("mt_bench.jsonl", "humaneval.jsonl", "alpaca_eval_80.jsonl")
# (name, generate() drafting keywords): the chain and the tree generate() drafts by default, speculating throughout
CONFIGS = [("chain", dict(tree=False, confidence_threshold=0.0)), ("tree", dict(tree=True, confidence_threshold=0.0))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafters", nargs="+", required=True, help=f"drafter folders, {LAYER_SKIP!r} or {MTP!r}")
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--per-set", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stock-prompts", type=int, default=None,
                    help="prompts decoded plainly by the stock forward (default: all; see main)")
    ap.add_argument("--temperatures", type=float, nargs="*", default=[],
                    help="also measure tau under sampling at these temperatures (module docstring)")
    ap.add_argument("--draft-temperature-ratios", type=float, nargs="*", default=[],
                    help="under sampling, also drafts drawn at these temperature ratios (module docstring)")
    ap.add_argument("--tree-budget", type=int, default=None,
                    help="the tree's draft nodes a step (default: the configured 63; the shape policy on a GPU "
                         "verifies 16-32-node buckets at realistic acceptance)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.tree_budget is not None:
        CONFIGS[1][1]["tree_budget"] = args.tree_budget
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target.generation_config.eos_token_id = None
    # the attention mask goes along: the prompts start with <|endoftext|>, the pad token, which generate() would
    # otherwise take for padding
    prompts = [(f, tokenizer(text, return_tensors="pt").to(args.device))
               for f in EVAL_FILES for _, text in load_prompts(args.eval_dir / f)[:args.per_set]]
    # plain greedy decoding: the model's own cached forward (fla's generate() takes no prompt on a CPU: it packs it)
    # on the first --stock-prompts, where SpecLA's autoregressive decoding must equal it, which stands in for it on
    # the rest (on a GPU the stock forward is launch-bound: ~50 ms a token even for the 4M hybrid)
    stock_prompts = len(prompts) if args.stock_prompts is None else args.stock_prompts
    plain, ar_equals_stock = [], 0
    for i, (_, p) in enumerate(prompts):
        ar = target.generate(**p, max_new_tokens=args.max_new_tokens, do_sample=False, specla=True)
        if i < stock_prompts:
            with torch.no_grad():
                plain.append(continue_text(target, p["input_ids"], args.max_new_tokens, 0.0, None))
            ar_equals_stock += int(torch.equal(ar, plain[-1]))
        else:
            plain.append(ar)
    print(f"SpecLA's autoregressive decoding equals the stock forward's on {ar_equals_stock}/{stock_prompts} prompts",
          flush=True)
    results = {}
    for name in args.drafters:
        drafter = load_drafter(target, name, args)
        results[name] = evaluate(target, drafter, prompts, plain, args.max_new_tokens)
        results[name].update(evaluate_sampling(target, drafter, prompts, args.max_new_tokens, args.temperatures,
                                                 args.draft_temperature_ratios))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "prompts": len(prompts),
                                        "device": str(target.device),
                                        "ar_equals_stock": f"{ar_equals_stock}/{stock_prompts}", "results": results},
                                       indent=1) + "\n")


def load_drafter(target, name: str, args) -> torch.nn.Module:
    if name == LAYER_SKIP:
        return layer_skip_drafter(target)
    if name == MTP:
        return specla_hf.MTPDrafter.from_pretrained(args.target, dtype=torch.float32, device=args.device)
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(args.device).eval()


def evaluate(target, drafter, prompts: list, plain: list, max_new_tokens: int) -> dict:
    """tau and identity with ``plain``, chain and tree, of ``drafter`` on ``prompts`` (all the sets together and per
    set)."""
    results = {}
    for name, drafting in CONFIGS:
        per_set: dict[str, list[int]] = {f: [0, 0] for f in EVAL_FILES}          # accepted drafts, verify steps
        identical, draft_s, t0 = 0, 0.0, time.time()
        for (f, p), want in zip(prompts, plain):
            out = target.generate(**p, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
                                  autoregressive_fallback=False, **drafting)
            stats = target.specla_stats
            per_set[f][0] += sum(stats.accepted)
            per_set[f][1] += stats.steps
            identical += int(torch.equal(out, want))
            draft_s += stats.draft_time
        accepted, steps = (sum(v[i] for v in per_set.values()) for i in (0, 1))
        results[name] = {"tau": (accepted + steps) / steps, "steps": steps, "identical": f"{identical}/{len(prompts)}",
                         "tau_per_set": {f: (a + s) / s for f, (a, s) in per_set.items() if s},
                         "draft_ms_per_step": 1000 * draft_s / steps, "seconds": time.time() - t0,
                         "options": drafting}
        print(f"{type(drafter).__name__} {name:<6} tau {results[name]['tau']:.2f} over {steps} verify steps, identical to plain "
              f"{results[name]['identical']}, per set " +
              ", ".join(f"{f.split('.')[0]} {t:.2f}" for f, t in results[name]["tau_per_set"].items()), flush=True)
    return results


def evaluate_sampling(target, drafter, prompts: list, max_new_tokens: int, temperatures: list[float],
                      ratios: list[float]) -> dict:
    """tau of ``drafter`` under sampling at each temperature, chain and tree in their configured shapes, with drafts
    drawn from the drafter and with its top-k drafts (module docstring)."""
    results = {}
    for temperature in temperatures:
        for name, drafting in CONFIGS:
            rules = [("sampled", {}), *((f"sampled at ratio {r:g}", dict(draft_temperature_ratio=r)) for r in ratios),
                     ("top-k", dict(sampled_drafts=False))]
            for drafts, rule in rules:
                accepted = steps = 0
                for seed, (_, p) in enumerate(prompts):
                    torch.manual_seed(seed)
                    target.generate(**p, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                    assistant_model=drafter, autoregressive_fallback=False, adaptive_drafting=False,
                                    **rule, **drafting)
                    accepted += sum(target.specla_stats.accepted)
                    steps += target.specla_stats.steps
                key = f"{name} T{temperature:g} {drafts}"
                results[key] = {"tau": (accepted + steps) / steps, "steps": steps, "temperature": temperature,
                                "drafts": drafts, "options": {**drafting, **rule, "adaptive_drafting": False}}
                print(f"{type(drafter).__name__} {key:<22} tau {results[key]['tau']:.2f} over {steps} verify steps",
                      flush=True)
    return results


if __name__ == "__main__":
    main()
