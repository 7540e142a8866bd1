"""Speedup over our CUDA-graph autoregressive decoding as a function of acceptance (tau), at controlled acceptance.

The embedded target's drafts are right ~7 tokens a step because the target repeats itself; real models give tau 3-4.
This benchmark keeps everything real (the 1.3B GDN shape: the trained target inflated, its aligned drafter inflated
beside it, the kernels, the graphs, the drafting and pruning) and varies only how often the drafter agrees with the
target: Gaussian noise of a swept scale is added to the drafter's logits before its softmax, inside its captured
calls, so its top-k changes and its confidences stay those of a real softmax. Sampling at temperature 0.7 and 1.0
lowers tau without noise. Every speculative point is measured with the fallback to autoregressive decoding off (what
speculation itself costs) and, for the default tree, on (what a user gets by default). ``tree`` chooses each
proposal's shape (``loop.shapes``), ``tree_fixed`` drafts the configured 8 / 4 / 63 (or ``--fixed-shape``) every
step; every point is run untimed over all its prompts first, until a pass captures no graph (at most 4 passes), so
that the shapes its acceptance leads the policy to have their graphs captured (a capture costs up to ~0.1 s; each
record counts the captures its timed calls still made). The shape policy's costs and acceptance per shape are
logged last.

    python benchmarks/acceptance_curve.py --eval-dir data/eval --out $OUT

Writes ``acceptance_curve.json`` (records: model_shape, method, noise, temperature, tau, ms_per_token,
graph_ar_ms_per_token, speedup_vs_graph_ar, stock_ms_per_token, speedup_vs_stock, mode, acceptance: device or host
loop) and ``acceptance_curve.png``
(speedup vs tau, one line per method, break-even marked), and prints a table last.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

import specla_hf  # noqa: F401  (patches generate once fla is imported)
from specla_hf.app.loading import checkpoint_home, load_models
from specla_hf.drafters.eagle import _BlockRunner
from specla_hf.loop.autoregressive import autoregressive_decode
from specla_hf.models import adapter_for
from specla_hf.training.inflate import inflate_pair
from specla_kernels import tuning

# method -> (drafter name, generate() keywords)
METHODS = {
    "chain": ("eagle", dict(tree=False, confidence_threshold=0.0)),
    "tree": ("eagle", dict(tree=True, confidence_threshold=0.0)),
    "tree_fixed": ("eagle", dict(tree=True, confidence_threshold=0.0, adaptive_drafting=False)),
    # under sampling, each node's top-k children instead of draws from the drafter (greedy: "tree", not run)
    "tree_topk_drafts": ("eagle", dict(tree=True, confidence_threshold=0.0, sampled_drafts=False)),
    # under sampling, drafts drawn at the target's own temperature (``tree``: at the drafter's calibrated ratio)
    "tree_target_temperature": ("eagle", dict(tree=True, confidence_threshold=0.0, draft_temperature_ratio=1.0)),
    "tree_pruned": ("eagle", dict(tree=True, confidence_threshold=0.05)),
    "dart": ("dart", dict(tree=True, confidence_threshold=0.0)),
}
SETS = {"mt_bench": ("mt_bench.jsonl", lambda r: r["turns"][0]),
        "humaneval": ("humaneval.jsonl", lambda r: r["prompt"]),
        "alpaca": ("alpaca_eval_80.jsonl", lambda r: r["instruction"])}
START = time.perf_counter()
WARM_PASSES = 6           # most passes over a point's prompts after its first, untimed one


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def log(*msg) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s]", *msg, flush=True)


class DraftNoise:
    """Gaussian noise of scale ``scale`` on the drafter's logits (``_BlockRunner.compute`` returns draft
    log-probs): patched in for the benchmark, inside the drafter's captured calls."""

    def __init__(self, device: torch.device):
        self.scale = torch.zeros((), device=device)        # a tensor the captured graphs read: changed in place
        compute = _BlockRunner.compute

        def noisy(runner, *args, **kwargs):
            out = compute(runner, *args, **kwargs)
            noise = torch.randn_like(out.logits) * self.scale
            out.logits.copy_(torch.log_softmax(out.logits + noise, -1))
            return out
        _BlockRunner.compute = noisy

    def set(self, scale: float) -> None:
        self.scale.fill_(scale)


def log_shape_costs(target) -> None:
    """What the shape policy measured (``loop.shapes``): ms per verify bucket (with the step's tail) and per depths
    drafted, for each drafter and setting the target's adapter remembers."""
    for per_drafter in (adapter_for(target).speculation_memory or {}).values():
        for key, memory in per_drafter.items():
            shapes = memory.shapes
            costs = [{k: round(1e3 * v, 3) for k, v in sorted(table.items())}
                     for table in (shapes.verify_seconds, shapes.draft_seconds)]
            log(f"shape costs {key[0]} {key[1][:4]} {key[2]}: verify ms by bucket {costs[0]}, drafting ms by depths "
                f"{costs[1]}")
            if shapes.count is not None:     # what it learnt of each shape: rows depth 1.., columns its budgets
                mean = (shapes.accepted / shapes.count).nan_to_num(-1)
                log(f"    steps observed per shape {shapes.count.round().int().tolist()}, drafts accepted "
                    f"{[[round(v, 2) for v in row] for row in mean.tolist()]} (-1: never observed)")


def speculation_counts(stats: list) -> dict:
    """What the calls' speculative steps drafted (mean draft nodes a step), how many graphs the calls captured, and
    each call's tau, mode and the fallback's reason for it (what a default run decided, prompt by prompt)."""
    return dict(graph_captures=sum(s.graph_captures for s in stats),
                draft_nodes=statistics.mean([n for s in stats for n in s.draft_nodes[:s.speculative_steps]] or [0]),
                calls=[dict(tau=s.tau, mode=s.mode, speculative_steps=s.speculative_steps, reason=s.mode_reason)
                       for s in stats])


def log_calls(record: dict) -> None:
    """Each call of a record: its tau, mode and the fallback's reason."""
    for call in record["calls"]:
        log(f"    tau {call['tau']:.2f} {call['mode']} after {call['speculative_steps']} speculative steps: "
            f"{call['reason']}")


def warmed(one_pass) -> tuple[float, list]:
    """``one_pass() -> (ms, stats)`` once untimed, then again until a pass captures no graph: that pass is the
    result (the last of ``WARM_PASSES`` otherwise, its captures counted in its stats). The shape policy learns during
    a pass, so the next may choose tree sizes the last did not: a timed pass after one clean untimed pass still
    captured 7 graphs (Qwen3.5 0.8B sampling), and one left a run at 0.5x."""
    one_pass()
    for _ in range(WARM_PASSES):
        ms, stats = one_pass()
        if not sum(s.graph_captures for s in stats):
            break
    return ms, stats


def add_tuning_options(ap: argparse.ArgumentParser) -> None:
    """The run's ``KernelTuning`` choices that benchmarks compare (``tuning_changes``)."""
    ap.add_argument("--fused-verify", type=int, default=tuning.active().fused_verify_max_nodes,
                    help="verified trees of up to this many nodes through fused_gemm (tuning's "
                         "fused_verify_max_nodes; 0: cuBLAS GEMMs)")
    ap.add_argument("--warpers-in-torch", action="store_true",
                    help="sampling: the temperature / top-k / top-p warpers in torch (before ops.draw_children "
                         "for the drafter's children, transformers' processors for the target's tree rows) instead "
                         "of inside the kernels")


def tuning_changes(args) -> dict:
    """``tuning.using`` keywords of ``add_tuning_options``' arguments."""
    return dict(fused_verify_max_nodes=args.fused_verify, draw_warpers=not args.warpers_in_torch)


def prompts(eval_dir: Path, per_set: int) -> list[str]:
    out = []
    for file, field in SETS.values():
        rows = [json.loads(line) for line in (eval_dir / file).read_text().splitlines() if line.strip()]
        out += [field(r) for r in rows[:per_set]]
    return out


@functools.cache
def copy_bytes_per_s(device: str) -> float:
    """``device``'s copy rate (bytes read and written per second, best of 5 copies of 1 GiB): the most a kernel
    streaming weights reaches (4.2e12 on an H200). Measured, so that a floor on another GPU is that GPU's."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if src.is_cuda:       # events: the host's launch and sync would weigh on a copy of ~0.3 ms
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            seconds = a.elapsed_time(b) / 1e3
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        best = min(best, seconds)
    del src, dst
    return 2 * (1 << 30) / best


def weight_floor_ms(model) -> float:
    """The one-token step's least time on the model's device: every weight it reads once at ``copy_bytes_per_s``,
    which is all of them but an untied input embedding (the step reads one row of it)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    read = sum(p.numel() * p.element_size() for p in model.parameters())
    return 1e3 * (read - (0 if tied else embedding.numel() * embedding.element_size())) / copy_bytes_per_s(
        str(embedding.device))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(target, ids_list, n_new, **kwargs) -> tuple[float, list]:
    """ms per token over the prompts (the prompt pass included, as users see it), and each call's stats."""
    seconds, tokens, stats = 0.0, 0, []
    for ids in ids_list:
        sync()
        t = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, **kwargs)
        sync()
        seconds += time.perf_counter() - t
        tokens += out.shape[1] - ids.shape[1]
        stats.append(getattr(target, "specla_stats", None) if kwargs.get("assistant_model") is not None else None)
    return 1e3 * seconds / tokens, stats


def ar_ms_torch_warpers(target, ids_list, n_new, **decoding) -> float:
    """SpecLA AR sampling with transformers' warpers inside its step (``draw_warpers`` off) in place of the warp
    kernels, timed as ``run``: what the kernels save the sampled step."""
    with tuning.using(draw_warpers=False):
        run(target, ids_list[:1], 4, specla=True, **decoding)         # its graph
        torch.manual_seed(1)
        return run(target, ids_list, n_new, specla=True, **decoding)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--per-set", type=int, default=4, help="prompts per set (MT-Bench, HumanEval, Alpaca)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--noise", default="0,1,2,3,4,6,9", help="noise scales on the drafter's logits (\"\": none)")
    ap.add_argument("--temperatures", default="0.7,1.0", help="sampling temperatures (\"\": none)")
    ap.add_argument("--top-k", type=int, help="sampling: top-k warper (default: the generation config's, 50)")
    ap.add_argument("--top-p", type=float, help="sampling: top-p warper (default: none; Qwen's configs: 0.95)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--fixed-shape", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    metavar="DEPTH,BUDGET", help="tree_fixed's draft depth and tree budget (default: 8,63)")
    ap.add_argument("--stock-prompts", type=positive, default=2, help="prompts timed with stock generate (it is "
                    "slow; at least 1: every record carries its time)")
    ap.add_argument("--shape", choices=["1.3b", "trained"], default="1.3b",
                    help="1.3b: the trained target inflated to fla's 1.3B shape; trained: the 12.6M target itself")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot-only", type=Path, help="redraw the PNG from an acceptance_curve.json, run nothing")
    add_tuning_options(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fixed_shape:
        depth, budget = args.fixed_shape
        METHODS["tree_fixed"][1].update(draft_depth=depth, tree_budget=budget)
    if args.plot_only:
        saved = json.loads(args.plot_only.read_text())
        plot(saved["records"], args.out / "acceptance_curve.png", saved["meta"])
        return
    with tuning.using(**tuning_changes(args)):
        measure(args)


def measure(args) -> None:
    """The curve: see the module docstring."""
    torch.manual_seed(0)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    small = load_models(device=args.device, dtype=dtype)
    dart = load_models(drafter=str(checkpoint_home() / "specla-gdn-tiny-dart"),
                       device=args.device, dtype=dtype).drafter
    if args.shape == "1.3b":
        target, eagle = inflate_pair(small.target, small.drafter)
        _, dart = inflate_pair(small.target, dart)
    else:
        target, eagle = small.target, small.drafter
    target.generation_config.eos_token_id = None                 # fixed-length runs
    drafters = {"eagle": eagle, "dart": dart}
    tok = small.tokenizer
    ids_list = [tok(t, return_tensors="pt").input_ids[:, :256].to(args.device)
                for t in prompts(args.eval_dir, args.per_set)]
    n = args.max_new_tokens
    sampling = {k: v for k, v in dict(top_k=args.top_k, top_p=args.top_p).items() if v is not None}
    noise = DraftNoise(torch.device(args.device))
    shape = "gdn-1.3b" if args.shape == "1.3b" else "gdn-12.6m"
    meta = {"model_shape": shape, "params": sum(p.numel() for p in target.parameters()),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": dtype,
            "prompts": len(ids_list), "max_new_tokens": n, **tuning_changes(args), "sampling_warpers": sampling,
            "weights": ("trained 12.6M GDN inflated function-preservingly to fla's 1.3B shape" if args.shape == "1.3b"
                        else "the trained 12.6M GDN")}
    log(meta)
    # warm-up: compiles and captures for every method before anything is timed
    for name, (drafter, kw) in METHODS.items():
        run(target, ids_list[:1], 32, do_sample=False, assistant_model=drafters[drafter], autoregressive_fallback=False,
            **kw)
    for temp in [float(x) for x in args.temperatures.split(",") if x]:      # "": greedy only
        run(target, ids_list[:1], 16, do_sample=True, temperature=temp, assistant_model=eagle,
            autoregressive_fallback=False, tree=True, **sampling)
        run(target, ids_list[:1], 16, do_sample=True, temperature=temp, specla=True, **sampling)   # its graphs
    autoregressive_decode(adapter_for(target), ids_list[0], 32)
    run(target, ids_list[:1], 4, do_sample=False)
    log("warm-up done")

    def ar_ms(sample: bool, temperature: float = 1.0) -> float:
        extra = dict(do_sample=True, temperature=temperature, **sampling) if sample else dict(do_sample=False)
        return run(target, ids_list, n, specla=True, **extra)[0]
    ar = {None: ar_ms(False)}
    stock_ms = run(target, ids_list[:args.stock_prompts], n, do_sample=False)[0]
    log(f"graph AR {ar[None]:.3f} ms/token, stock generate {stock_ms:.2f} ms/token")
    records = []

    def record(method, noise_scale, temperature, ms, stats, fallback):
        taus = [s.tau for s in stats]
        base = ar[temperature]
        records.append(dict(model_shape=shape, method=method + (" (default: fallback on)" if fallback else ""),
                            noise=noise_scale, temperature=temperature, tau=statistics.mean(taus),
                            ms_per_token=ms, graph_ar_ms_per_token=base, speedup_vs_graph_ar=base / ms,
                            stock_ms_per_token=stock_ms, speedup_vs_stock=stock_ms / ms,
                            mode=sorted({s.mode for s in stats}), acceptance=sorted({s.acceptance for s in stats}),
                            **speculation_counts(stats)))
        r = records[-1]
        log(f"{r['method']:<34} noise {noise_scale:<4} T {temperature} tau {r['tau']:.2f} {ms:.3f} ms/token "
            f"{r['speedup_vs_graph_ar']:.2f}x graph AR ({r['mode']}, {r['draft_nodes']:.1f} nodes a step, "
            f"{r['graph_captures']} graph captures)")
        if fallback:
            log_calls(r)

    def timed(target, ids_list, n, seed=None, **kwargs):
        # every pass, untimed or timed, samples from the same seed: one that draws other tokens may reach tree sizes
        # the others did not
        def one_pass():
            if seed is not None:
                torch.manual_seed(seed)
            return run(target, ids_list, n, **kwargs)
        return warmed(one_pass)

    for method in args.methods.split(","):
        drafter, kw = METHODS[method]
        if kw.get("sampled_drafts") is False or "draft_temperature_ratio" in kw:    # a sampling rule: under greedy
            continue                                                                   # decoding, another method's
        for scale in [float(x) for x in args.noise.split(",") if x]:       # "": sampling only
            noise.set(scale)
            ms, stats = timed(target, ids_list, n, do_sample=False, assistant_model=drafters[drafter],
                              autoregressive_fallback=False, **kw)
            record(method, scale, None, ms, stats, False)
            if method == "tree":
                ms, stats = timed(target, ids_list, n, do_sample=False, assistant_model=drafters[drafter],
                                  autoregressive_fallback=True, **kw)
                record(method, scale, None, ms, stats, True)
            (args.out / "acceptance_curve.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    noise.set(0.0)
    for temp in [float(x) for x in args.temperatures.split(",") if x]:      # "": greedy only
        ar[temp] = ar_ms(True, temp)
        torch_warpers = meta.setdefault("graph_ar_torch_warpers_ms_per_token", {})
        torch_warpers[temp] = ar_ms_torch_warpers(target, ids_list, n, do_sample=True, temperature=temp, **sampling)
        log(f"graph AR sampling at T {temp}: {ar[temp]:.3f} ms/token ({torch_warpers[temp]:.3f} with transformers' "
            "warpers in its step)")
        for method in args.methods.split(","):
            drafter, kw = METHODS[method]
            for fallback in ((False, True) if method == "tree" else (False,)):
                ms, stats = timed(target, ids_list, n, seed=1, do_sample=True, temperature=temp, **sampling,
                                  assistant_model=drafters[drafter], autoregressive_fallback=fallback, **kw)
                record(method, 0.0, temp, ms, stats, fallback)
        (args.out / "acceptance_curve.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    log_shape_costs(target)
    plot(records, args.out / "acceptance_curve.png", meta)
    print("| method | noise | T | tau | ms/token | graph AR ms/token | vs graph AR | vs stock | mode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['method']} | {r['noise']} | {r['temperature'] or 'greedy'} | {r['tau']:.2f} | "
              f"{r['ms_per_token']:.3f} | {r['graph_ar_ms_per_token']:.3f} | {r['speedup_vs_graph_ar']:.2f}x | "
              f"{r['speedup_vs_stock']:.1f}x | {','.join(r['mode'])} |")


def plot(records: list[dict], path: Path, meta: dict) -> None:
    """Speedup against the drafter's acceptance: a fallback run is placed at the tau its method reached without the
    fallback at the same noise and temperature (its own tau counts the autoregressive steps too)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    own_tau = {(r["method"], r["noise"], r["temperature"]): r["tau"] for r in records}

    def tau_of(r):
        return own_tau.get((r["method"].split(" (")[0], r["noise"], r["temperature"]), r["tau"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method]
        pts = sorted((tau_of(r), r["speedup_vs_graph_ar"]) for r in mine if r["temperature"] is None)
        line = ax.plot(*zip(*pts), marker="o", label=method)[0] if pts else None
        sampled = [(tau_of(r), r["speedup_vs_graph_ar"]) for r in mine if r["temperature"] is not None]
        if sampled:
            ax.scatter(*zip(*sampled), marker="x", color=line.get_color() if line else None)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="break-even (our graph AR)")
    ax.set_xlabel("tau: tokens per verify step of speculation")
    ax.set_ylabel("speedup over our CUDA-graph AR decoding")
    ax.set_title(f"{meta['model_shape']} ({meta['params'] / 1e9:.2f}B, bf16, {meta['device']}): greedy at swept "
                 "draft noise (o), sampling T 0.7 / 1.0 (x)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
