"""GPU microbenchmark of a sampled draft depth's draws (``ops.draw_children``) against the greedy depth's top-k and
the torch warpers, launch by launch, as CUDA graph replays (``bench_kernels.bench_graph``; each graph holds 10 calls,
reported per call): the frontier rows of the 1.3B GDN drafter (vocabulary 8192) and of the MTP head's 32K draft
vocabulary, 4 children a row, temperature 0.7 under transformers' default top-k of 50.

- ``draw``: the whole call as the drafter makes it (``ops.draw_children``: the seed drawn on the device, then the
  kernels: one program a row at 8192 entries; at 32K the warpers in slices, then the slices' draws);
- ``draw_no_top_k``: the call without the top-k warper;
- ``draw_bf16``: the call on the rows in bf16 (raw logits as the drafter's LM head gives them);
- ``torch_warpers``: the warpers in torch, then the kernels at temperature 1 (the path of other processors);
- ``greedy_topk``: a greedy depth's ``ops.row_topk`` of the same rows;
- ``top_p`` / ``torch_top_p``: Qwen's sampling settings (temperature 0.7, top-k 20, top-p 0.95) through
  ``ops.draw_children`` against transformers' warpers in torch, then the kernels (current version only).
The target's side of a sampled step, a verified tree's warped probabilities (``ops.warped_probs`` against
transformers' warpers and a softmax, ``torch_``), at 64 nodes of 8192 entries (the 1.3B GDN shape) and at 16 and
64 nodes of 248,320 (Qwen3.5), bf16 as the verify pass gives them, with and without top-p; the long rows also in
slices of 4096 and 16384 (``slices4096_``, ``slices16384_``), with each launch's time. ``--baseline FILE``: the
same draft rows and the target's rows of 8192 entries for another version of ``draw.py`` (e.g.
``git show REV:kernels/specla_kernels/draw.py > FILE``), alternated with the current one. Writes
``--out/bench_draw.json``; tables last.

    python benchmarks/bench_draw.py --out OUT [--baseline FILE]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import bench_graph  # noqa: E402

from specla_kernels import ops  # noqa: E402
from specla_kernels.draw import ONE_PROGRAM_VOCAB, sliced_warp_fits, warped_probs_sliced  # noqa: E402

REPEAT = 10          # calls a graph holds: the replay's own launch cost is spread over them
SHAPES = [(1, 8192), (4, 8192), (1, 32768), (4, 32768)]      # (frontier rows, vocabulary)
K, TEMPERATURE, TOP_K = 4, 0.7, 50
QWEN_TOP_K, QWEN_TOP_P = 20, 0.95
TARGET_SHAPES = [(64, 8192), (16, 248320), (64, 248320)]       # (verified nodes, vocabulary)


def per_call_us(fn) -> float:
    def many():
        for _ in range(REPEAT):
            fn()
    return bench_graph(many) * 1e3 / REPEAT


def load_version(path: Path):
    spec = importlib.util.spec_from_file_location("draw_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_draw(module):
    """A version of ``draw.py``'s ``draw_children`` called as ``ops.draw_children`` is, the seed drawn first."""
    def draw(x, k, temperature, top_k, logq):
        seed = torch.randint(2 ** 31 - 1, (1,), dtype=torch.int64, device=x.device)
        return module.draw_children(x, k, temperature, top_k, logq, seed=seed)
    return draw


def warpers_of(top_k: int, top_p: float = 1.0) -> LogitsProcessorList:
    return LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(top_k)]
                               + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))


def rows_for(draw, logp: torch.Tensor) -> dict:
    """The timed calls of one ``draw(x, k, temperature, top_k, logq)`` on frontier log-probs ``logp``."""
    F, V = logp.shape
    logq = torch.empty_like(logp)
    warpers = warpers_of(TOP_K)
    no_context = torch.empty(F, 0, dtype=torch.long, device=logp.device)
    logits = logp.to(torch.bfloat16)
    return {
        "draw": lambda: draw(logp, K, TEMPERATURE, TOP_K, logq),
        "draw_bf16": lambda: draw(logits, K, TEMPERATURE, TOP_K, logq),
        "draw_no_top_k": lambda: draw(logp, K, TEMPERATURE, 0, logq),
        "torch_warpers": lambda: draw(warpers(no_context, logp.float()), K, 1.0, 0, logq),
    }


def top_p_rows(logp: torch.Tensor) -> dict:
    """The current draws under Qwen's settings, through ``ops`` and through transformers' warpers."""
    logq = torch.empty_like(logp)
    warpers = warpers_of(QWEN_TOP_K, QWEN_TOP_P)
    no_context = torch.empty(logp.shape[0], 0, dtype=torch.long, device=logp.device)
    return {"top_p": lambda: ops.draw_children(logp, K, TEMPERATURE, QWEN_TOP_K, logq, QWEN_TOP_P),
            "torch_top_p": lambda: ops.draw_children(warpers(no_context, logp.float()), K, 1.0, 0, logq)}


def target_record(R: int, V: int, gen: torch.Generator, baseline=None) -> dict:
    """A verified tree's warped probabilities, ``ops.warped_probs`` against transformers' warpers and a softmax
    (and ``baseline``'s ``warped_log_probs``, a module of ``load_version``, on rows of one program);
    rows longer than one program's also in slices of 4096 and 16384 entries where they fit (``warped_probs_sliced``,
    against its default of ``WARP_SLICES``), and the GPU time of each of its three launches (``stage_us``: slices,
    merge, write; the profiler's, outside a graph)."""
    logits = (torch.randn(R, V, generator=gen) * 3).to(torch.bfloat16).cuda()    # the verify pass's dtype
    no_context = torch.empty(R, 0, dtype=torch.long, device="cuda")
    record = dict(nodes=R, vocab=V, temperature=TEMPERATURE)
    for top_k, top_p in [(TOP_K, 1.0), (QWEN_TOP_K, QWEN_TOP_P)]:
        warpers = warpers_of(top_k, top_p)
        name = f"top_k{top_k}" + (f"_top_p{top_p}" if top_p < 1.0 else "")
        calls = {"": lambda: ops.warped_probs(logits, TEMPERATURE, top_k, top_p),
                 "torch_": lambda: warpers(no_context, logits.float()).softmax(-1)}
        if baseline is not None and V <= ONE_PROGRAM_VOCAB:
            out = torch.empty(R, V, device="cuda")
            calls["baseline_"] = lambda: baseline.warped_log_probs(logits, TEMPERATURE, top_k, out, top_p).exp_()
        if V > ONE_PROGRAM_VOCAB:
            for block in (4096, 16384):
                if sliced_warp_fits(V, top_k, block):
                    calls[f"slices{block}_"] = functools.partial(warped_probs_sliced, logits, TEMPERATURE, top_k,
                                                                 top_p, block=block)
            record[f"stage_us_{name}"] = stage_us(lambda: ops.warped_probs(logits, TEMPERATURE, top_k, top_p))
        for prefix, fn in calls.items():
            record[f"{prefix}{name}_us"] = round(per_call_us(fn), 2)
    return record


def stage_us(fn, calls: int = 20) -> dict:
    """Each kernel's mean GPU time a call of ``fn``, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / calls, 2) for e in prof.key_averages() if e.device_time_total > 0}


def table(records: list[dict], first: str) -> None:
    names = sorted({k[:-3] for r in records for k in r if k.endswith("_us")})
    print("\n| " + first + " | " + " | ".join(names) + " |")
    for r in records:
        cells = [("-" if f"{n}_us" not in r else str(min(r[f"{n}_us"])) if isinstance(r[f"{n}_us"], list)
                  else f"{r[f'{n}_us']:.2f}") for n in names]
        print(f"| {' x '.join(str(v) for v in list(r.values())[:2])} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, help="another version of draw.py, timed beside the current one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    versions = {"current": ops.draw_children}          # with its routing of long rows
    baseline = load_version(args.baseline) if args.baseline else None
    if baseline is not None:
        versions["baseline"] = module_draw(baseline)
    gen = torch.Generator().manual_seed(0)
    records, targets = [], []

    def write():
        (args.out / "bench_draw.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                                  records=records, targets=targets), indent=1))
    for F, V in SHAPES:
        logp = torch.log_softmax(torch.randn(F, V, generator=gen) * 3, -1).cuda()
        record = dict(frontier_rows=F, vocab=V, children=K, temperature=TEMPERATURE, top_k=TOP_K,
                      greedy_topk_us=per_call_us(lambda: ops.row_topk(logp, K)))
        for _ in range(2):                            # alternated: a drift of the machine shows as a spread
            for name, draw in versions.items():
                if name == "baseline" and V > ONE_PROGRAM_VOCAB:    # its long rows come warped: ops' routing
                    continue
                for op, fn in rows_for(draw, logp).items():
                    record.setdefault(f"{name}_{op}_us", []).append(round(per_call_us(fn), 2))
        for op, fn in top_p_rows(logp).items():
            record[f"current_{op}_us"] = round(per_call_us(fn), 2)
        records.append(record)
        print(json.dumps(record), flush=True)
        write()
    for R, V in TARGET_SHAPES:
        targets.append(target_record(R, V, gen, baseline))
        print(json.dumps(targets[-1]), flush=True)
        write()
    table(records, "rows x vocab")
    table(targets, "nodes x vocab")


if __name__ == "__main__":
    main()
