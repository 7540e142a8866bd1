"""How often a draft node's children are accepted under sampling: the drafter's top-k children accepted with the
target's probability of each, against children drawn from the drafter and accepted by recursive rejection sampling
(``specla_hf.loop.acceptance``), from teacher-forced distributions.

    python benchmarks/node_acceptance.py --eval-dir EVAL

The target writes ``--new-tokens`` after the first ``--per-set`` prompts of each set at ``--temperature`` (its own
sampled text); on that text the EAGLE-style drafter reads the target's features (depth 1) or its own previous output
(depth 2, the training-time test's second pass), and each position's target law ``p`` and draft law ``q`` at each
sampling temperature (with the top-k warper, ``--top-k``) give the chance that one child (the top-1, or a draw) and
that any of ``--children`` children (the top-k, or draws without replacement, by Monte Carlo) is accepted. fp32 on
the CPU.

``--ratios`` calibrates the drafter's drawing temperature (``SpecLADrafterConfig.draft_temperature_ratio``): the
chance that one drawn child is accepted, ``sum(min(p, q))``, with ``q`` at the target's temperature times each ratio,
and the ratio that maximises it over the temperatures and both depths (a drafter sharper than the target is
accepted more often drawing hotter). ``--write-ratio`` stores that ratio in the drafter's config.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specla_hf  # noqa: F401
from specla_hf.app.prompts import load_prompts
from specla_kernels.reference import rejection_residual, warped_scores_ref, without_draw
from specla_hf.training.train_drafter import continue_text, target_signals

EVAL_FILES = ("mt_bench.jsonl", "humaneval.jsonl", "alpaca_eval_80.jsonl")


def acceptance(p: torch.Tensor, q: torch.Tensor, children: int, draws: int) -> dict[str, float]:
    """Mean acceptance chances over the rows of ``p``, ``q`` ``[R, vocab]``."""
    top = q.topk(children, -1).indices
    drawn = torch.zeros(p.shape[0])
    for _ in range(draws):
        pi, qi = p.clone(), q.clone()
        done = torch.zeros(p.shape[0], dtype=torch.bool)
        for _ in range(children):
            x = torch.multinomial(qi + 1e-30, 1)[:, 0]
            px, qx = (t.gather(1, x[:, None])[:, 0] for t in (pi, qi))
            hit = ~done & (qx > 0) & (torch.rand(p.shape[0]) * qx < px)
            drawn += hit.float()
            done |= hit
            pi, qi = rejection_residual(pi, qi), without_draw(qi, x)
    return {"top-1": float(p.gather(1, top[:, :1]).mean()), "drawn 1": float(torch.minimum(p, q).sum(1).mean()),
            f"top-{children}": float(p.gather(1, top).sum(1).mean()), f"drawn {children}": float((drawn / draws).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="checkpoints/specla-gdn-tiny")
    ap.add_argument("--drafter", default="checkpoints/specla-gdn-tiny-drafter")
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--per-set", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7, help="of the target's text")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0], help="of the acceptance")
    ap.add_argument("--top-k", type=int, default=50, help="the top-k warper of both laws (default: generate()'s when "
                    "the generation config sets none; 0: none)")
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0],
                    help="drafter temperature ratios to compare (module docstring)")
    ap.add_argument("--write-ratio", action="store_true", help="store the best ratio in the drafter's config.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for f in EVAL_FILES:
            for _, text in load_prompts(args.eval_dir / f)[:args.per_set]:
                ids = tokenizer(text, return_tensors="pt").input_ids[:, -64:]
                rows.append(continue_text(target, ids, args.new_tokens, args.temperature, gen))
        length = min(r.shape[1] for r in rows)
        x = torch.cat([r[:, -length:] for r in rows])
        sig = target_signals(drafter, target, x, contextlib.nullcontext())
        fused = drafter.fuse(sig["features"])
        h1 = drafter(fused, sig["embeds"])
        h2 = drafter(torch.cat([fused[:, :1], h1[:, :-1]], 1), sig["embeds"])
        head = target.get_output_embeddings()
        logq = {d: torch.log_softmax(head(drafter.norm(h)).float(), -1) for d, h in ((1, h1), (2, h2))}
    prompt_tail = length - args.new_tokens           # positions inside the prompt: left out
    top_k = args.top_k

    def law(scores: torch.Tensor, temperature: float) -> torch.Tensor:
        """The rows of ``scores`` past the prompt under the temperature and top-k warpers, as probabilities."""
        return warped_scores_ref(scores[:, prompt_tail:].flatten(0, 1), temperature, top_k).softmax(-1)

    torch.manual_seed(0)
    one_draw = {r: [] for r in args.ratios}
    for t in args.temperatures:
        p = law(sig["logp"].detach(), t)
        for depth, lq in logq.items():
            for r in args.ratios:
                q = law(lq, t * r)
                one_draw[r].append(float(torch.minimum(p, q).sum(1).mean()))
                if r == 1.0 or len(args.ratios) == 1:
                    rates = acceptance(p, q, args.children, args.draws)
                    print(f"T {t} depth {depth}: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items()), flush=True)
            print(f"T {t} top-k {top_k} depth {depth}, one drawn child accepted, by drafter temperature ratio: " +
                  ", ".join(f"{r:g} {one_draw[r][-1]:.3f}" for r in args.ratios), flush=True)
    mean = {r: sum(v) / len(v) for r, v in one_draw.items()}
    best = max(args.ratios, key=mean.get)
    print(f"best ratio {best:g}: one drawn child accepted {mean[best]:.3f} on average"
          + (f", against {mean[1.0]:.3f} at 1" if 1.0 in mean else ""), flush=True)
    if args.write_ratio:        # the JSON itself: the config as loaded here says float32
        path = Path(args.drafter) / "config.json"
        config = json.loads(path.read_text())
        config["draft_temperature_ratio"] = best
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"wrote draft_temperature_ratio {best:g} into {path}")


if __name__ == "__main__":
    main()
