"""Qwen3.5 hybrid decoding speed, batch 1: stock transformers ``generate`` vs SpecLA's autoregressive decoding
(``generate(specla=True)``) vs SpecLA chain and tree drafting with the MTP head and the EAGLE-style drafter.

Shapes (``--shapes``):
- ``trained``: the embedded ``checkpoints/specla-qwen35-tiny`` (4.1M) with its own MTP head (``mtp.*`` in the
  checkpoint) and its aligned drafter, on the MT-Bench / HumanEval / Alpaca prompts: tau is real.
- ``0.8b``: a Qwen3.5-0.8B-like text config (hidden 1024, 24 layers of which 6 attention, 8 / 2 KV heads of 256, GDN
  16 / 16 heads of 128, vocab 248,320, tied embeddings), random weights and a random MTP head, at controlled
  acceptance (``OracleDrafts``, ``--noise``): the head runs in full, then its draft log-probs are replaced by an
  oracle's, noised at a swept scale, so tau is set while every cost stays real.
- ``9b``: transformers' default ``Qwen3_5TextConfig`` (9B), random weights, as ``0.8b``.

    python benchmarks/hybrid_bench.py --eval-dir data/eval --out $OUT

Writes ``hybrid_bench.json`` (records: model_shape, method, drafter, noise (controlled acceptance), tau, ms_per_token,
graph_ar_ms_per_token (SpecLA's autoregressive decoding, the prompt pass included; ``ar_cuda_graphs`` says whether it
ran as CUDA graphs), graph_ar_step_ms (its decode step alone), stock_ms_per_token, the ratios, weight_floor_ms (a decode
step's least time, ``acceptance_curve.weight_floor_ms``)) and ``hybrid_bench.png``, and prints a table last. Every speculative run has the fallback to
autoregressive decoding off (what speculation costs), except the ``tree_default`` method (what a user gets).
``--temperature`` (with ``--top-k`` / ``--top-p``) samples instead, against SpecLA AR sampling alike (records carry
the warpers' settings), and times that AR step also with transformers' warpers in place of the warp kernels
(``specla_ar_torch_warpers``); ``--methods`` picks the speculative methods.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

import specla_hf
from acceptance_curve import (add_tuning_options, ar_ms_torch_warpers, copy_bytes_per_s, log, log_calls,
                              log_shape_costs, positive, prompts, run, speculation_counts, tuning_changes, warmed,
                              weight_floor_ms)
from specla_hf.drafters.mtp import _MTPRunner
from specla_hf.models import adapter_for
from specla_kernels import tuning

CHECKPOINTS = Path(specla_hf.__file__).resolve().parents[1] / "checkpoints"
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, intermediate_size=3584, vocab_size=248320, tie_word_embeddings=True),
    "9b": {},
}
# by how much a random target's argmax must lead (``make_decisive``): a logit plus 5% of its own size, about six bf16
# rounding steps, so the one-token path and the verify pass cannot round it apart
DECISIVE_MARGIN = (1.0, 0.05)
# method -> generate() keywords (with the drafter as assistant_model)
METHODS = {
    "chain": dict(tree=False, confidence_threshold=0.0, autoregressive_fallback=False),
    "tree": dict(tree=True, confidence_threshold=0.0, autoregressive_fallback=False),
    # the configured 8 / 4 / 63 every step, not the shape policy's choice (``loop.shapes``)
    "tree_fixed": dict(tree=True, confidence_threshold=0.0, autoregressive_fallback=False, adaptive_drafting=False),
    "tree_default": dict(tree=True),
}


class OracleDrafts:
    """Controlled acceptance for a random-weight target: the MTP head computes its draft log-probs (its real cost,
    inside its captured calls), which are then replaced by ``log_softmax(BOOST * onehot(successor[token]) + noise)``
    with Gaussian noise of scale ``scale``. ``successor`` maps a token to the one that follows it in the target's own
    greedy continuation of the prompt (``expect``, before each prompt), so a draft is right where that bigram
    successor is the target's next token and stays on top of the noise; the noise scale sets how often. BOOST keeps
    the oracle token's confidence near a real drafter's (~0.9 against 248K tokens at no noise). The random target
    must decide its argmax clearly for this to work in bf16 (``random_pair``). A context: the MTP runner drafts the
    oracle's drafts inside it only (a later shape's head, of another vocabulary, must not read these)."""

    BOOST = 15.0

    def __init__(self, vocab_size: int, device: torch.device):
        self.scale = torch.zeros((), device=device)      # tensors the captured graphs read: changed in place
        self.successor = torch.zeros(vocab_size, dtype=torch.long, device=device)
        self.draft_index = torch.arange(vocab_size, device=device)      # a token's row among the head's logits
        self.compute = _MTPRunner.compute

    def __enter__(self) -> OracleDrafts:
        compute = self.compute

        def oracle(runner, inputs, cache, parents, logits_positions, hidden_layers, log_probs=True):
            out = compute(runner, inputs, cache, parents, logits_positions, hidden_layers, log_probs=log_probs)
            tokens = inputs[1] if logits_positions is None else inputs[1][:, logits_positions]
            rows = self.draft_index[self.successor[tokens]]
            hot = torch.zeros_like(out.logits).scatter_(-1, rows[..., None], self.BOOST)
            # log-probs serve as logits too (sampled drafting asks for logits): both draw the oracle's distribution
            out.logits.copy_(torch.log_softmax(hot + torch.randn_like(hot) * self.scale, -1))
            return out
        _MTPRunner.compute = oracle
        return self

    def __exit__(self, *exc) -> None:
        _MTPRunner.compute = self.compute

    def restrict(self, head, continuations: list[torch.Tensor], size: int) -> torch.Tensor:
        """Restrict ``head`` to a draft vocabulary of ``size`` tokens: the ``continuations``' (every successor the
        oracle drafts), then the lowest other ids (the cost of a draft vocabulary of that size, whichever tokens a
        corpus would pick). Returns it."""
        seen = torch.cat([c[0] for c in continuations]).unique().cpu()
        others = torch.ones(len(self.draft_index), dtype=torch.bool)
        others[seen] = False
        vocab = torch.cat([seen, others.nonzero()[:size - len(seen), 0]]).sort().values
        head.restrict_vocabulary(vocab)
        self.draft_index[vocab.to(self.draft_index.device)] = torch.arange(len(vocab), device=self.draft_index.device)
        return vocab

    def expect(self, sequence: torch.Tensor) -> None:
        """The target's greedy ``sequence [1, L]`` (prompt and continuation): each token's successor in it (the last
        one where a token recurs)."""
        successor = torch.zeros_like(self.successor, device="cpu")
        seq = sequence[0].cpu()
        successor[seq[:-1]] = seq[1:]
        self.successor.copy_(successor)


def random_pair(shape: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, dict]:
    """A random-weight Qwen3.5 of ``shape`` and its random MTP head, the target made decisive (``make_decisive``)."""
    config = Qwen3_5TextConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3_5ForCausalLM(config).to(dtype).eval()
        mtp = specla_hf.MTPDrafter(config).to(dtype).eval()
    make_decisive(target)
    return target, {"mtp": mtp}


@torch.no_grad()
def make_decisive(target, most: float = 4096.0) -> float:
    """Scale the random target's embedding (and, untied, give its head the same rows: the cost is the same) until its
    argmax leads the runner-up by ``DECISIVE_MARGIN`` on 9 of 10 positions of a random prompt: the residual stream is
    then dominated by the current token's embedding. With plain random weights the argmax is a near-tie among 248K
    logits that bf16 rounds apart between the one-token path and the verify pass (at the 0.8B-like shape cut to 4
    layers on a CPU, the oracle's tau at no noise was 1.04-1.5 in bf16 and 7.0 in fp32; 8.0, every output equal to
    stock, with a scaled embedding), and the layers' contributions grow with the width (the 9B shape needs a larger
    scale than the 0.8B one). Such a target repeats itself; what a step costs does not depend on weight values (no
    routing in a dense model). Returns the scale."""
    embedding = target.model.embed_tokens.weight
    ids = torch.randint(0, embedding.shape[0], (1, 64), generator=torch.Generator().manual_seed(0)).to(embedding.device)
    scale = 1.0
    while True:
        top = target(ids).logits[0].float().topk(2, -1).values
        margin = DECISIVE_MARGIN[0] + DECISIVE_MARGIN[1] * top[:, 0].abs()
        if (top[:, 0] - top[:, 1] > margin).float().mean() >= 0.9 or scale >= most:
            break
        embedding.mul_(2.0)
        scale *= 2.0
        if not target.config.tie_word_embeddings:
            target.lm_head.weight.copy_(embedding)
    log(f"random target: embedding scaled by {scale:g}")
    return scale


def trained_pair(dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, dict]:
    folder = CHECKPOINTS / "specla-qwen35-tiny"
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    drafters = {"mtp": specla_hf.MTPDrafter.from_pretrained(folder, dtype=dtype, device=device)}
    eagle = CHECKPOINTS / "specla-qwen35-tiny-drafter"
    if eagle.exists():
        drafters["eagle"] = AutoModelForCausalLM.from_pretrained(eagle, dtype=dtype).to(device).eval()
    return target, drafters


def tau_of(stats: list) -> float:
    accepted, steps = sum(sum(s.accepted) for s in stats), sum(s.steps for s in stats)
    return (accepted + steps) / steps


def profile_call(target, ids, n_new: int, path: Path, **kwargs) -> None:
    """The GPU kernels of one ``generate`` call on ``ids`` (default: SpecLA's autoregressive decoding; graph replays
    included: CUPTI records their kernels), by total GPU time, with the kernel launches per token."""
    from torch.profiler import ProfilerActivity, profile
    kwargs = dict(kwargs or dict(specla=True), attention_mask=torch.ones_like(ids))     # a pad id may be a token
    target.generate(ids, max_new_tokens=n_new, do_sample=False, **kwargs)          # captured before profiling
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        target.generate(ids, max_new_tokens=n_new, do_sample=False, **kwargs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3
    head = (f"{len(kernels)} kernels, {gpu_ms:.2f} ms of GPU time for {n_new} tokens (prompt pass included): "
            f"{len(kernels) / n_new:.0f} kernels and {gpu_ms / n_new:.3f} ms per token\n")
    path.write_text(head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30) + "\n")
    log(head.strip())


def bench_shape(shape: str, target, drafters: dict, ids_list: list, n_new: int, stock_prompts: int,
                noises: list[float] | None = None, profile_dir: Path | None = None,
                draft_vocab: int | None = None, sampling: dict | None = None,
                methods: list[str] | None = None) -> list[dict]:
    """Stock, SpecLA AR and every drafter x method on ``ids_list``; with ``noises`` (random shapes), the MTP head's
    drafts come from ``OracleDrafts`` at each noise scale, over a draft vocabulary of ``draft_vocab`` tokens if
    given. With ``sampling`` (``generate`` keywords: temperature, top_k, top_p) the speculative methods sample, each
    pass from the same seed, and are compared with SpecLA AR sampling alike; stock and the oracle's continuations
    stay greedy."""
    decoding = dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)
    methods = {m: METHODS[m] for m in (methods or METHODS)}
    with OracleDrafts(target.config.vocab_size, target.device) if noises else contextlib.nullcontext() as oracle:
        target.generation_config.eos_token_id = None                  # fixed-length runs
        params = sum(p.numel() for p in target.parameters())
        continuations = ([target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                          do_sample=False, specla=True) for ids in ids_list] if oracle else None)
        vocab = None
        if oracle and draft_vocab and draft_vocab < target.config.vocab_size:
            # before the warm-up: the head's graphs are captured again
            vocab = oracle.restrict(drafters["mtp"], continuations, draft_vocab)
        # warm-up: every method on every prompt before anything is timed (fla's prompt kernels autotune for each new
        # prompt length, and the first method timed would pay for all)
        run(target, ids_list, 4, do_sample=False)
        run(target, ids_list, 4, do_sample=False, specla=True)
        if sampling:
            run(target, ids_list, 4, specla=True, **decoding)
        for drafter in drafters.values():
            for kw in methods.values():
                run(target, ids_list, 4, assistant_model=drafter, **decoding, **kw)
        stock, _ = run(target, ids_list[:stock_prompts], n_new, do_sample=False)
        ar, _ = run(target, ids_list, n_new, do_sample=False, specla=True)
        torch.manual_seed(1)
        ar_decoding = run(target, ids_list, n_new, specla=True, **decoding)[0] if sampling else ar
        # a decode step's time, the prompt pass left out (the difference with a quarter of the tokens): the weight
        # floor is per step
        short, _ = run(target, ids_list, n_new // 4, do_sample=False, specla=True)
        ar_step = (ar * n_new - short * (n_new // 4)) / (n_new - n_new // 4)
        if profile_dir is not None:
            profile_call(target, ids_list[0], n_new, profile_dir / f"profile_ar_{shape}.txt")
        base = dict(model_shape=shape, params=params, draft_vocab=None if vocab is None else len(vocab),
                    weight_floor_ms=weight_floor_ms(target), stock_ms_per_token=stock, graph_ar_ms_per_token=ar,
                    graph_ar_step_ms=ar_step,
                    ar_cuda_graphs=adapter_for(target).graphs is not None)
        records = [dict(base, method="stock", drafter=None, noise=None, tau=1.0, ms_per_token=stock),
                   dict(base, method="specla_ar", drafter=None, noise=None, tau=1.0, ms_per_token=ar)]
        if sampling:
            torch_warpers = ar_ms_torch_warpers(target, ids_list, n_new, **decoding)
            records += [dict(base, method=method, drafter=None, noise=None, tau=1.0, **sampling, ms_per_token=ms)
                        for method, ms in (("specla_ar", ar_decoding), ("specla_ar_torch_warpers", torch_warpers))]
            log(f"{shape}: SpecLA AR sampling ({sampling}) {ar_decoding:.2f} ms/token, {torch_warpers:.2f} with "
                "transformers' warpers in its step")
        log(f"{shape}: stock {stock:.2f} ms/token, SpecLA AR {ar:.2f} ms/token ({ar_step:.3f} ms a decode step, "
            f"{ar_step / base['weight_floor_ms']:.2f}x the weight floor of {base['weight_floor_ms']:.3f} ms)")
        for name, drafter in drafters.items():
            for noise in (noises or [None]) if name == "mtp" else [None]:
                for method, kw in methods.items():
                    if noise is not None:
                        oracle.scale.fill_(noise)

                    def over_prompts():
                        ms, stats = 0.0, []
                        torch.manual_seed(1)
                        for i, ids in enumerate(ids_list):
                            if noise is not None:
                                oracle.expect(continuations[i])
                            one, one_stats = run(target, [ids], n_new, assistant_model=drafter, **decoding, **kw)
                            ms, stats = ms + one / len(ids_list), stats + one_stats
                        return ms, stats
                    # every method grows trees (tree buckets, graphs) the short warm-up did not reach
                    ms, stats = warmed(over_prompts)
                    records.append(dict(base, method=method, drafter=name, noise=noise, tau=tau_of(stats),
                                        ms_per_token=ms, mode=sorted({s.mode for s in stats}), **(sampling or {}),
                                        **speculation_counts(stats)))
                    if profile_dir is not None and method == "tree" and noises and noise == noises[-1]:
                        profile_call(target, ids_list[-1], n_new, profile_dir / f"profile_tree_{shape}.txt",
                                     assistant_model=drafter, **kw)
                    log(f"{shape}: {name} {method} noise {noise}: tau {records[-1]['tau']:.2f}, {ms:.2f} ms/token, "
                        f"{records[-1]['draft_nodes']:.1f} nodes a step, {records[-1]['graph_captures']} captures")
                    if kw.get("autoregressive_fallback", True):
                        log_calls(records[-1])
        log_shape_costs(target)
        for r in records:      # against SpecLA AR decoding alike (greedy or sampling)
            same = ar_decoding if "temperature" in r else ar
            r["speedup_vs_ar"], r["speedup_vs_stock"] = same / r["ms_per_token"], stock / r["ms_per_token"]
        return records


def table(records: list[dict]) -> str:
    lines = ["| shape | method | drafter | noise | T | tau | ms/token | vs SpecLA AR | vs stock |", "|" + "---|" * 9]
    lines += [f"| {r['model_shape']} | {r['method']} | {r['drafter'] or '-'} | {r.get('noise', '-')} | "
              f"{r.get('temperature') or 'greedy'} | {r['tau']:.2f} | "
              f"{r['ms_per_token']:.2f} | {r['speedup_vs_ar']:.2f}x | {r['speedup_vs_stock']:.1f}x |" for r in records]
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """One panel per shape: speedup over SpecLA AR against tau, one line per drafter and method (a point per noise
    scale at the random shapes), break-even marked; the title gives the AR step against the weight floor and
    stock."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["model_shape"] for r in records))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in records if r["model_shape"] == shape]
        first = rows[0]
        for drafter, method in dict.fromkeys((r["drafter"], r["method"]) for r in rows if r["drafter"]):
            line = sorted((r["tau"], r["speedup_vs_ar"]) for r in rows if (r["drafter"], r["method"]) == (drafter, method))
            ax.plot(*zip(*line), marker="o", label=f"{drafter} {method}")
        ax.axhline(1.0, color="grey", ls="--", label="SpecLA AR (break-even)")
        ax.set_xlabel("tau (tokens per verify step)")
        ax.set_ylabel("speedup over SpecLA AR")
        ax.set_title(f"Qwen3.5 {shape} ({first['params'] / 1e6:.0f}M): AR {first['graph_ar_ms_per_token']:.2f} ms/token"
                     f"\n(a decode step {first['graph_ar_step_ms'] / first['weight_floor_ms']:.2f}x floor), "
                     f"{first['stock_ms_per_token'] / first['graph_ar_ms_per_token']:.0f}x faster than stock",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--shapes", default="trained,0.8b,9b")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per set (MT-Bench, HumanEval, Alpaca)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stock-prompts", type=positive, default=2, help="prompts timed with stock generate (it is "
                    "slow; at least 1: every record carries its time)")
    ap.add_argument("--noise", default="0,2.75,3,3.25,3.5,4",
                    help="controlled acceptance at the random shapes: noise scales on the oracle's drafts")
    ap.add_argument("--profile", action="store_true", help="write each shape's AR kernel profile (CUDA)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tree-attention", default="specla",
                    help="the attention calls' kernels (verify, prompt chains, the MTP head, the one-token step), "
                         "comma-separated: specla (our masked-attention kernel), SDPA backends (e.g. "
                         "cudnn_attention, efficient_attention, math); empty: SDPA, torch's choice")
    ap.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy decoding)")
    ap.add_argument("--top-k", type=int, help="sampling: top-k warper (default: the generation config's)")
    ap.add_argument("--top-p", type=float, help="sampling: top-p warper (Qwen's configs: 0.95)")
    ap.add_argument("--methods", default=",".join(METHODS), help="speculative methods, comma-separated")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the MTP head's draft vocabulary at the random shapes (0: the whole vocabulary)")
    add_tuning_options(ap)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    backends = tuple(b for b in args.tree_attention.split(",") if b)
    with tuning.using(tree_attention_backends=backends, **tuning_changes(args)):
        bench(args, backends)


def bench(args, backends: tuple[str, ...]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "specla-qwen35-tiny")
    ids_list = [tok(t, return_tensors="pt").input_ids[:, :256].to(args.device)
                for t in prompts(args.eval_dir, args.per_set)]
    sampling = {k: v for k, v in dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).items()
                if v is not None} if args.temperature is not None else None
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": str(dtype),
            "prompts": len(ids_list), "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
            "tree_attention_backends": list(backends) or "torch's choice", "draft_vocab": args.draft_vocab or None,
            **tuning_changes(args), "sampling": sampling,
            "copy_bytes_per_s": copy_bytes_per_s(str(torch.device(args.device)))}
    records = []
    for shape in args.shapes.split(","):
        target, drafters = (trained_pair(dtype, args.device) if shape == "trained" else random_pair(shape, dtype, args.device))
        noises = None if shape == "trained" else [float(x) for x in args.noise.split(",")]
        records += bench_shape(shape, target, drafters, ids_list, args.max_new_tokens, args.stock_prompts, noises,
                               args.out if args.profile else None, args.draft_vocab, sampling,
                               args.methods.split(","))
        (args.out / "hybrid_bench.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
        del target, drafters
        if args.device == "cuda":
            torch.cuda.empty_cache()
    plot(records, args.out / "hybrid_bench.png")
    print(table(records))


if __name__ == "__main__":
    main()
