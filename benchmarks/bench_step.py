"""GPU: the one-launch one-token step (``specla_kernels.decode_step``) at several launch shapes against the per-product
step (four GEMVs and fla's recurrence per layer) on the 1.3B-shaped target, bf16, all as CUDA graphs: greedy tokens
and logits against the per-product step's, then graph replays timed in rotating rounds.

    python benchmarks/bench_step.py [--steps 32] [--out DIR]

Prints, step by step, each stage's result as it finishes (a stage that hangs shows where), and writes
``bench_step.json`` to ``--out`` (or ``$OUT``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import specla_hf  # noqa: F401
from specla_hf import gdn
from specla_hf.defaults import load_models
from specla_hf.inflate import inflate_pair
from specla_kernels.decode_step import DecodeStep


def greedy(runner: gdn.GDNRunner, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """``steps`` greedy one-token steps after ``prompt``: the tokens and each step's logits."""
    cache = runner.new_cache(1)
    runner.forward(prompt, cache, logits_positions=slice(0, 0))
    token, tokens, logits = prompt[:, -1:], [], []
    for _ in range(steps):
        out = runner.forward(token, cache).logits[0, -1].float()
        logits.append(out.clone())
        token = out.argmax().view(1, 1)
        tokens.append(int(token))
    return tokens, logits


def replay_ms(runner: gdn.GDNRunner, token: torch.Tensor, reps: int = 200) -> float:
    """Median ms of one graphed one-token step (events around each replay)."""
    cache = runner.new_cache(1)
    runner.forward(token, cache)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.forward(token, cache)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# launch shapes of the one-launch step (specla_kernels.decode_step.LAUNCH keys) timed beside the per-product step
# (session 15, H200: per product 1.116 ms; one launch 2.039, <= 128 registers 1.888, 2x weight tile 1.851, 4 warps
# and <= 128 registers 1.913; all 32/32 tokens equal)
VARIANTS = {"one launch, 2x weight tile": dict(tile_elems=16384),
            "one launch, 2x weight tile, no barriers (wrong results)": dict(tile_elems=16384, sync=False),
            "one launch, 4 warps, <= 128 registers": dict(num_warps=4, tile_elems=4096, maxnreg=128, max_per_sm=4),
            "one launch, 4 warps, <= 128 registers, no barriers (wrong results)": dict(
                num_warps=4, tile_elems=4096, maxnreg=128, max_per_sm=4, sync=False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    t0 = time.time()
    say = lambda *a: print(f"[{time.time() - t0:6.1f}s]", *a, flush=True)     # noqa: E731
    models = load_models(device="cuda", dtype="bfloat16")
    big, _ = inflate_pair(models.target, models.drafter)
    prompt = torch.randint(0, big.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    runners, res = {}, {}
    for name, launch in {"per product": None, **VARIANTS}.items():
        gdn.STEP_KERNEL = launch is not None           # read when the step graph is captured
        runner = runners[name] = gdn.GDNRunner(big)
        if launch is not None:
            if runner._step_kernel is None:
                raise SystemExit("the one-launch step does not take this model (gdn.supports_one_launch_step)")
            runner._step_kernel = DecodeStep(runner._step_shape, **launch)
        tokens, logits = greedy(runner, prompt, args.steps)
        torch.cuda.synchronize()
        res[name] = dict(tokens=tokens, logits=logits)
        extra = {} if launch is None else dict(spin_limit_hit=runner._step_kernel.failed(),
                                               per_sm=runner._step_kernel.per_sm, n_regs=runner._step_kernel.n_regs)
        say(name, "tokens", tokens[:8], "...", extra)
        res[name].update(extra)
    base = res["per product"]
    summary = {}
    for name, r in res.items():
        # the logits of the steps before the first differing token (after it the inputs differ)
        same = next((i for i, (x, y) in enumerate(zip(r["tokens"], base["tokens"])) if x != y), args.steps)
        rel = max([((a - b).norm() / b.norm()).item() for a, b in zip(r["logits"][:same + 1], base["logits"])])
        summary[name] = dict(same_tokens_before_first_difference=same, max_rel_logits_vs_per_product=rel,
                             **{k: v for k, v in r.items() if k not in ("tokens", "logits")})
        say(name, summary[name])
    token = prompt[:, -1:]
    times = {name: [] for name in runners}
    for rnd in range(4):
        names = list(times)
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:     # the order rotates
            times[name].append(replay_ms(runners[name], token))
    for name, t in times.items():
        summary[name]["step_ms"] = statistics.median(t)
        say(name, "step ms (rounds):", [round(x, 4) for x in t])
    gdn.STEP_KERNEL = False
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_step.json").write_text(json.dumps(summary, indent=1))
    print("| step (graphed) | same tokens | max rel. logits diff | programs per SM | registers | step ms |")
    print("|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['same_tokens_before_first_difference']}/{args.steps} | "
              f"{s['max_rel_logits_vs_per_product']:.2e} | {s.get('per_sm', '-')} | {s.get('n_regs', '-')} | "
              f"{s['step_ms']:.3f} |")


if __name__ == "__main__":
    main()
