"""Qwen3.5 hybrid decoding speed, batch 1: stock transformers ``generate`` vs SpecLA's autoregressive decoding
(``generate(specla=True)``) vs SpecLA chain and tree drafting with the MTP head and the EAGLE-style drafter.

Shapes (``--shapes``):
- ``trained``: the embedded ``checkpoints/specla-qwen35-tiny`` (4.1M) with its own MTP head (``mtp.*`` in the
  checkpoint) and its aligned drafter, on the MT-Bench / HumanEval / Alpaca prompts: tau is real.
- ``0.8b``: a Qwen3.5-0.8B-like text config (hidden 1024, 24 layers of which 6 attention, 8 / 2 KV heads of 256, GDN
  16 / 16 heads of 128, vocab 248,320, tied embeddings), random weights and a random MTP head: what a step costs at
  that shape; random drafts are rejected, so tau is ~1 there.
- ``9b``: transformers' default ``Qwen3_5TextConfig`` (9B), random weights, as ``0.8b``.

    python benchmarks/hybrid_bench.py --eval-dir data/eval --out $OUT

Writes ``hybrid_bench.json`` (records: model_shape, method, drafter, tau, ms_per_token, graph_ar_ms_per_token (SpecLA's
autoregressive decoding; ``ar_cuda_graphs`` says whether it ran as CUDA graphs), stock_ms_per_token, the ratios,
weight_floor_ms) and ``hybrid_bench.png``, and prints a table last. Every speculative run has the fallback to
autoregressive decoding off (what speculation costs), except the ``tree_default`` method (what a user gets).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

import specla_hf
from acceptance_curve import log, prompts, run
from specla_hf.models import adapter_for

CHECKPOINTS = Path(specla_hf.__file__).resolve().parents[1] / "checkpoints"
HBM_BYTES_PER_S = 4.8e12          # H200: every weight read once per token is the autoregressive floor
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, intermediate_size=3584, vocab_size=248320, tie_word_embeddings=True),
    "9b": {},
}
# method -> generate() keywords (with the drafter as assistant_model)
METHODS = {
    "chain": dict(tree=False, confidence_threshold=0.0, autoregressive_fallback=False),
    "tree": dict(tree=True, confidence_threshold=0.0, autoregressive_fallback=False),
    "tree_default": dict(tree=True),
}


def random_pair(shape: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, dict]:
    """A random-weight Qwen3.5 of ``shape`` and its random MTP head."""
    config = Qwen3_5TextConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3_5ForCausalLM(config).to(dtype).eval()
        mtp = specla_hf.MTPDrafter(config).to(dtype).eval()
    return target, {"mtp": mtp}


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


def bench_shape(shape: str, target, drafters: dict, ids_list: list, n_new: int, stock_prompts: int) -> list[dict]:
    target.generation_config.eos_token_id = None                  # fixed-length runs
    params = sum(p.numel() for p in target.parameters())
    # warm-up: every method on every prompt before anything is timed (fla's prompt kernels autotune for each new
    # prompt length, and the first method timed would pay for all)
    run(target, ids_list, 4, do_sample=False)
    run(target, ids_list, 4, do_sample=False, specla=True)
    for drafter in drafters.values():
        for kw in METHODS.values():
            run(target, ids_list, 4, do_sample=False, assistant_model=drafter, **kw)
    stock, _ = run(target, ids_list[:stock_prompts], n_new, do_sample=False)
    ar, _ = run(target, ids_list, n_new, do_sample=False, specla=True)
    base = dict(model_shape=shape, params=params, weight_floor_ms=1e3 * params * target.dtype.itemsize / HBM_BYTES_PER_S,
                stock_ms_per_token=stock, graph_ar_ms_per_token=ar, ar_cuda_graphs=adapter_for(target).graphs is not None)
    records = [dict(base, method="stock", drafter=None, tau=1.0, ms_per_token=stock),
               dict(base, method="specla_ar", drafter=None, tau=1.0, ms_per_token=ar)]
    log(f"{shape}: stock {stock:.2f} ms/token, SpecLA AR {ar:.2f} ms/token")
    for name, drafter in drafters.items():
        for method, kw in METHODS.items():
            ms, stats = run(target, ids_list, n_new, do_sample=False, assistant_model=drafter, **kw)
            records.append(dict(base, method=method, drafter=name, tau=tau_of(stats), ms_per_token=ms,
                                mode=sorted({s.mode for s in stats})))
            log(f"{shape}: {name} {method}: tau {records[-1]['tau']:.2f}, {ms:.2f} ms/token")
    for r in records:
        r["speedup_vs_ar"], r["speedup_vs_stock"] = ar / r["ms_per_token"], stock / r["ms_per_token"]
    return records


def table(records: list[dict]) -> str:
    lines = ["| shape | method | drafter | tau | ms/token | vs SpecLA AR | vs stock |", "|" + "---|" * 7]
    lines += [f"| {r['model_shape']} | {r['method']} | {r['drafter'] or '-'} | {r['tau']:.2f} | "
              f"{r['ms_per_token']:.2f} | {r['speedup_vs_ar']:.2f}x | {r['speedup_vs_stock']:.1f}x |" for r in records]
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["model_shape"] for r in records))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in records if r["model_shape"] == shape]
        labels = [r["method"] if r["drafter"] is None else f"{r['drafter']} {r['method']}\ntau {r['tau']:.2f}"
                  for r in rows]
        ax.bar(range(len(rows)), [r["ms_per_token"] for r in rows], color="tab:blue")
        ax.axhline(rows[0]["weight_floor_ms"], color="grey", ls="--", label="weight floor")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7)
        ax.set_ylabel("ms per token (lower is better)")
        ax.set_title(f"Qwen3.5 {shape} ({rows[0]['params'] / 1e6:.1f}M params)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--shapes", default="trained,0.8b,9b")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per set (MT-Bench, HumanEval, Alpaca)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stock-prompts", type=int, default=2, help="prompts timed with stock generate (it is slow)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "specla-qwen35-tiny")
    ids_list = [tok(t, return_tensors="pt").input_ids[:, :256].to(args.device)
                for t in prompts(args.eval_dir, args.per_set)]
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": str(dtype),
            "prompts": len(ids_list), "max_new_tokens": args.max_new_tokens, "torch": torch.__version__}
    records = []
    for shape in args.shapes.split(","):
        target, drafters = (trained_pair(dtype, args.device) if shape == "trained" else random_pair(shape, dtype, args.device))
        records += bench_shape(shape, target, drafters, ids_list, args.max_new_tokens, args.stock_prompts)
        (args.out / "hybrid_bench.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
        del target, drafters
        if args.device == "cuda":
            torch.cuda.empty_cache()
    plot(records, args.out / "hybrid_bench.png")
    print(table(records))


if __name__ == "__main__":
    main()
