"""GPU benchmark: stock HF generate vs our CUDA-graph autoregressive decoding vs SpecLA chain / tree / tree+pruning.

Same machine, same run, same prompts, greedy. For the trained target and its function-preserving inflation to fla's
1.3B GDN shape, per prompt set: ms/token and tokens/s per method, tau, draft vs verify time, the fraction of emitted
tokens identical to our plain decoding, peak memory, and the decode-only time (the target's prompt pass, timed
alone per prompt, subtracted); plus a fp32 exact-equality check. Writes JSON, a markdown table
and a PNG plot under --out, and prints the table last.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \
        python benchmarks/bench_generate.py --eval-dir .device/eval --out $OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import specla_hf
from specla_hf.loop.autoregressive import autoregressive_decode
from specla_hf.app.loading import load_models
from specla_hf.models import adapter_for
from specla_hf.training.inflate import inflate_pair
from specla_kernels import tuning

METHODS = {   # name -> generate() keywords (None: our CUDA-graph AR; "hf": stock generate)
    "hf_generate": "hf",
    "graph_ar": None,
    # speculation itself, to the end of each call (benchmarks/acceptance_curve.py measures the default fallback)
    "specla_chain": dict(tree=False, confidence_threshold=0.0, autoregressive_fallback=False),
    "specla_tree": dict(tree=True, confidence_threshold=0.0, autoregressive_fallback=False),
    "specla_tree_pruned": dict(tree=True, confidence_threshold=0.05, autoregressive_fallback=False),
}


def load_prompts(eval_dir: Path, per_set: int) -> dict[str, list[str]]:
    sets = {"mt_bench": ("mt_bench.jsonl", lambda r: r["turns"][0]),
            "humaneval": ("humaneval.jsonl", lambda r: r["prompt"]),
            "alpaca": ("alpaca_eval_80.jsonl", lambda r: r["instruction"])}
    out = {}
    for name, (file, field) in sets.items():
        rows = [json.loads(line) for line in (eval_dir / file).read_text().splitlines() if line.strip()]
        out[name] = [field(r) for r in rows[:per_set]]
    return out


START = time.perf_counter()


def log(*msg) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s]", *msg, flush=True)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    _sync()
    t = time.perf_counter()
    result = fn()
    _sync()
    return result, time.perf_counter() - t


def _peak_memory() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def run_method(name, target, drafter, ids, n_new):
    kw = METHODS[name]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if kw is None:
        seq, dt = timed(lambda: autoregressive_decode(adapter_for(target), ids, n_new))
        stats = None
    elif kw == "hf":
        seq, dt = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                                do_sample=False))
        stats = None
    else:
        seq, dt = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                                do_sample=False, assistant_model=drafter, **kw))
        stats = target.specla_stats
    return seq[0, ids.shape[1]:].tolist(), dt, stats, _peak_memory()


def prefill_seconds(target, ids) -> float:
    """The target's prompt pass (every method runs one, stock HF included): median of 3. Subtracted from a call's
    time it gives the decode-only time per token, which is what speculative decoding changes."""
    runner = adapter_for(target)
    times = [timed(lambda: runner.forward(ids[:, :-1], runner.new_cache(1), logits_positions=slice(0, 0)))[1]
             for _ in range(3)]
    return statistics.median(times)


def bench_target(label, target, drafter, tok, prompts, n_new, hf_prompts):
    rows = {}
    # warm-up: compile, autotune, and capture the graphs of every tree bucket and drafter shape before timing
    for text in (prompts["mt_bench"][0], prompts["humaneval"][0]):
        sample = tok(text, return_tensors="pt").input_ids[:, :256].to(target.device)
        for name in METHODS:
            if name != "hf_generate":
                _, dt, _, _ = run_method(name, target, drafter, sample, 64)
                log(label, "warm-up", name, f"{dt:.1f}s")
    run_method("hf_generate", target, drafter, sample, 4)
    log(label, "warm-up done")
    for set_name, texts in prompts.items():
        per = {m: [] for m in METHODS}
        for i, text in enumerate(texts):
            ids = tok(text, return_tensors="pt").input_ids[:, :256].to(target.device)
            prefill_s = prefill_seconds(target, ids)
            ref = hf = None
            for name in METHODS:
                if name == "hf_generate" and i >= hf_prompts:
                    continue
                toks, dt, stats, mem = run_method(name, target, drafter, ids, n_new)
                if name == "hf_generate":
                    hf = toks
                if name == "graph_ar":
                    ref = toks
                rec = {"ms_per_token": 1e3 * dt / len(toks), "tokens": len(toks), "seconds": dt, "peak_mem": mem,
                       "decode_ms_per_token": 1e3 * (dt - prefill_s) / len(toks), "prefill_s": prefill_s}
                if name == "graph_ar" and hf is not None:      # our baseline must decode what stock HF decodes
                    rec["match_hf"] = sum(a == b for a, b in zip(toks, hf)) / len(hf)
                if ref is not None and name != "hf_generate":
                    rec["match_ar"] = sum(a == b for a, b in zip(toks, ref)) / len(ref)
                    rec["identical_ar"] = toks == ref
                if stats is not None:
                    rec.update(tau=stats.tau, steps=stats.steps, mode=stats.mode, draft_s=stats.draft_time,
                               verify_s=stats.verify_time,
                               draft_nodes=statistics.mean(stats.draft_nodes),
                               rejected_per_step=stats.rejected_nodes_per_step)
                per[name].append(rec)
        rows[set_name] = per
        log(label, set_name, {m: round(statistics.median(r["ms_per_token"] for r in v), 3)
                              for m, v in per.items() if v})
    return rows


def summarise(results):
    lines = ["| target | prompt set | method | ms/token | tok/s | vs HF generate | vs graph AR | decode ms/token "
             "| decode vs graph AR | tau | draft/verify s | rejected nodes/step | = AR tokens | peak MiB |",
             "|" + "---|" * 14]
    for label, sets in results.items():
        for set_name, per in sets.items():
            med = {m: statistics.median(r["ms_per_token"] for r in v) for m, v in per.items() if v}
            dec = {m: statistics.median(r["decode_ms_per_token"] for r in v) for m, v in per.items() if v}
            for m, v in per.items():
                if not v:
                    continue
                ms = med[m]
                tau = f"{statistics.median(r['tau'] for r in v):.2f}" if "tau" in v[0] else "-"
                dv = (f"{sum(r['draft_s'] for r in v):.2f}/{sum(r['verify_s'] for r in v):.2f}"
                      if "draft_s" in v[0] else "-")
                rej = f"{statistics.mean(r['rejected_per_step'] for r in v):.1f}" if "tau" in v[0] else "-"
                match = f"{100 * statistics.mean(r['match_ar'] for r in v):.1f}%" if "match_ar" in v[0] else "-"
                if "match_hf" in v[0]:
                    match += f" (= HF {100 * statistics.mean(r['match_hf'] for r in v if 'match_hf' in r):.1f}%)"
                lines.append(f"| {label} | {set_name} | {m} | {ms:.2f} | {1e3 / ms:.0f} | "
                             f"{med['hf_generate'] / ms:.1f}x | {med['graph_ar'] / ms:.2f}x | {dec[m]:.2f} | "
                             f"{dec['graph_ar'] / dec[m]:.2f}x | {tau} | {dv} | {rej} | "
                             f"{match} | {max(r['peak_mem'] for r in v) / 2**20:.0f} |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (label, sets) in zip(axes[0], results.items()):
        methods = [m for m in METHODS if m != "hf_generate"]
        for j, set_name in enumerate(sets):
            vals = [1e3 / statistics.median(r["ms_per_token"] for r in sets[set_name][m]) for m in methods]
            ax.bar([i + 0.25 * j for i in range(len(methods))], vals, width=0.25, label=set_name)
        ax.set_xticks(range(len(methods)), methods, rotation=20)
        ax.set_ylabel("tokens/s (median over prompts)")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fp32_equality(target, drafter, tok, texts, n_new, hf_prompts: int = 3):
    """fp32: SpecLA greedy output (chain and tree) must be token-identical to our plain greedy decoding, and that
    to stock HF ``generate`` (on the first ``hf_prompts``: it is slow). Prompts keep their first 64 tokens: fla's
    chunked prompt kernel (longer prompts) compiles and tunes its fp32 variants for every new length class, minutes
    on a cold H200, and the prompt pass is the same code for every method compared here."""
    target.generation_config.eos_token_id = None
    same = ar_hf = 0
    for i, text in enumerate(texts):
        ids = tok(text, return_tensors="pt").input_ids[:, :64].to(target.device)
        ref = autoregressive_decode(adapter_for(target), ids, n_new)
        same += all(torch.equal(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                                do_sample=False, assistant_model=drafter, tree=tree,
                                                confidence_threshold=0.0, autoregressive_fallback=False), ref)
                    for tree in (False, True))
        if i < hf_prompts:
            ar_hf += torch.equal(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                                 do_sample=False), ref)
        log(f"fp32 prompt {i + 1}/{len(texts)}: {same} identical so far")
    return {"prompts": len(texts), "identical": same, "ar_equals_stock_hf": f"{ar_hf}/{min(hf_prompts, len(texts))}"}


def check_kernels(meta: dict) -> None:
    """The Triton tree kernels against their torch reference on this GPU; on failure use the reference path (still
    inside CUDA graphs) and record why, rather than benchmark wrong numbers."""
    from specla_kernels import ops, reference
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        B, N, H, K, V = 1, 23, 6, 256, 512
        r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
        q, k, v = r(B, N, H, K).bfloat16(), r(B, N, H, K).bfloat16(), r(B, N, H, V).bfloat16()
        g = -torch.rand(B, N, H, device="cuda", generator=gen)
        beta = torch.rand(B, N, H, device="cuda", generator=gen)
        parents = torch.tensor([[-1] + [int(torch.randint(0, i, ())) for i in range(1, N)]], device="cuda")
        S0 = r(B, H, V, K) * 0.1
        got = ops.tree_gated_delta_rule(q, k, v, g, beta, parents, S0)
        ref = reference.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, S0)
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
        meta["kernel_check_rel_err"] = errs
        if not all(e < 1e-2 for e in errs):
            raise RuntimeError(f"tree kernel relative errors {errs}")
        meta["tree_ops"] = "triton"
    except Exception as e:  # noqa: BLE001 - any failure means: do not time the kernel
        meta["tree_ops"] = f"torch reference (Triton kernel failed: {type(e).__name__}: {str(e)[:200]})"
        ops.use_triton = lambda x: False
    print("tree ops:", meta["tree_ops"], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-prompts", type=int, default=2)
    ap.add_argument("--stages", default="large,small,fp32,fp32-large",
                    help="comma-separated: large (1.3B shape, bf16), small (trained target, bf16), fp32, fp32-large "
                         "(greedy identity in fp32 on each)")
    ap.add_argument("--tree-shapes", default="",
                    help="extra SpecLA tree methods, comma-separated depth/topk/budget (e.g. 7/4/31,8/3/31): tree "
                         "shapes compared in the same run as the default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    for shape in filter(None, args.tree_shapes.split(",")):
        depth, topk, budget = (int(x) for x in shape.split("/"))
        METHODS[f"specla_tree_{depth}x{topk}b{budget}"] = dict(tree=True, confidence_threshold=0.0, draft_depth=depth,
                                                               tree_topk=topk, tree_budget=budget)
    models = load_models(args.target, args.drafter, device=args.device,
                         dtype="bfloat16" if args.device == "cuda" else "float32")
    target, drafter, tok = models.target, models.drafter, models.tokenizer
    target.generation_config.eos_token_id = None          # fixed-length runs, like the AR baseline
    prompts = load_prompts(args.eval_dir, args.per_set)
    meta = {"target": models.target_name, "drafter": models.drafter_name, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "max_new_tokens": args.max_new_tokens,
            "specla": specla_hf.__version__,
            # the one-token step's GEMV launches come from this table where it covers them (benchmarks/tune_step.py)
            "gemv_step_configs": list(tuning.active().gemv_step_configs)}
    if args.device == "cuda":
        check_kernels(meta)
    print(meta, flush=True)
    results = {}

    def save():   # after every stage, so that a run cut short still brings its numbers back
        (args.out / "bench_generate.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        if results:
            (args.out / "bench_generate.md").write_text(summarise(results) + "\n")

    # the 1.3B shape first: it is the headline, and a run cut short keeps it
    if "large" in stages:
        # an aligned drafter is inflated beside the target: it drafts what it drafts for the small target, at the
        # cost of a drafter of the large width
        large, large_drafter = inflate_pair(target, drafter)
        large.generation_config.eos_token_id = None
        n_params = sum(p.numel() for p in large.parameters())
        meta["large_params"] = n_params
        label = f"inflated 1.3B shape ({n_params / 1e9:.2f}B)"
        meta["large_drafter_params"] = sum(p.numel() for p in large_drafter.parameters())
        meta["large_drafter"] = type(large_drafter).__name__
        results[label] = bench_target("large", large, large_drafter, tok, prompts, args.max_new_tokens,
                                      args.hf_prompts)
        save()
        del large, large_drafter
    if "small" in stages:
        results["trained (12.6M)"] = bench_target("trained", target, drafter, tok, prompts, args.max_new_tokens,
                                                   args.hf_prompts)
        save()
    del target, drafter, models
    small = load_models(args.target, args.drafter, device=args.device, dtype="float32")
    texts = [t for ts in prompts.values() for t in ts]
    if "fp32" in stages:
        meta["fp32_equality"] = fp32_equality(small.target, small.drafter, tok, texts[:20], 64)
        log("fp32 equality:", meta["fp32_equality"])
        save()
    if "fp32-large" in stages:
        large, large_drafter = inflate_pair(small.target, small.drafter)
        meta["fp32_equality_large"] = fp32_equality(large, large_drafter, tok, texts[:5], 64)
        log("fp32 equality (1.3B shape):", meta["fp32_equality_large"])
    save()
    print(json.dumps(meta))
    if results:
        plot(results, args.out / "bench_generate.png")
        print(summarise(results))


if __name__ == "__main__":
    main()
