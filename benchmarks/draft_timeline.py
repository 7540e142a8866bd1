"""GPU kernel timeline of one proposal and one 16-node verify pass (bf16, CUDA graphs): the EAGLE-style drafter at the
1.3B GDN shape (the trained target and drafter inflated), or with ``--shape 0.8b`` / ``9b`` the MTP head of a
random-weight Qwen3.5 over a 32K draft vocabulary (``hybrid_bench``'s models). Each kernel's duration and the idle
gap before it, from the profiler's trace of graph replays. A proposal is the host-driven ``launch`` after a verify
step (the accepted path's feature fusion, the drafter's catch-up on it, 8 depth graphs, the tree selection), so its
first kernels wait on the host; the depths after the first are what the device loop replays. ``--temperature``
(with ``--top-k``, default transformers' 50, and ``--top-p``) draws each node's children as sampled decoding does
(``sample_drafts``: ``ops.draw_children``) instead of taking its top-k.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/draft_timeline.py --out $OUT/timeline [--shape 0.8b]

Prints ``duration_us gap_us name`` per kernel and writes ``{proposal,verify16}.rows.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

import specla_hf  # noqa: F401  (registers the drafter classes)
from specla_hf.app.loading import load_models
from specla_hf.generation import draft_options
from specla_hf.models import adapter_for
from specla_hf.training.inflate import inflate_pair

DRAFT_VOCAB = 32768   # the MTP head's draft vocabulary, as hybrid_bench's default


def timeline(fn, name: str, out: Path) -> None:
    """Profile one call of ``fn`` (after five unprofiled ones) and print its kernels in stream order."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    trace = out / f"{name}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    rows, prev_end = [], None
    for e in kernels:
        gap = 0.0 if prev_end is None else e["ts"] - prev_end
        rows.append((e["name"][:70], round(e["dur"], 2), round(gap, 2)))
        prev_end = e["ts"] + e["dur"]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(r[1] for r in rows)
    print(f"== {name}: {len(rows)} kernels, span {span:.1f} us, busy {busy:.1f} us, gaps {span - busy:.1f} us")
    for r in rows:
        print(f"{r[1]:8.2f} {r[2]:7.2f}  {r[0]}")
    (out / f"{name}.rows.json").write_text(json.dumps(rows))


def models(shape: str):
    """The target, its drafter, and the drafter's hidden size for ``shape``."""
    if shape == "1.3b":
        loaded = load_models(device="cuda", dtype="bfloat16")
        big, drafter = inflate_pair(loaded.target, loaded.drafter)
        return big, drafter, drafter.config.hidden_size
    from hybrid_bench import random_pair
    target, drafters = random_pair(shape, torch.bfloat16, "cuda")
    drafters["mtp"].restrict_vocabulary(torch.arange(DRAFT_VOCAB))
    return target, drafters["mtp"], target.config.hidden_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=["1.3b", "0.8b", "9b"], default="1.3b")
    ap.add_argument("--temperature", type=float, help="draw the drafts under these warpers (default: greedy top-k)")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, drafter, H = models(args.shape)
    V = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    proposer = drafter.candidate_generator(target, draft_options(tree=True, confidence_threshold=0.0))
    proposer.reserve(256)
    if args.temperature is not None:         # the warpers generate() would build
        warpers = [TemperatureLogitsWarper(args.temperature), TopKLogitsWarper(args.top_k)]
        if args.top_p < 1:
            warpers.append(TopPLogitsWarper(args.top_p))
        proposer.sample_drafts(LogitsProcessorList(warpers))
    verified = tuple(torch.randn(1, 32, H, device="cuda", dtype=torch.bfloat16) for _ in proposer.feature_layers)
    seq = {"ids": torch.randint(0, V, (1, 17), generator=gen)}
    proposer.add_features(tuple(f[:, :16] for f in verified))
    proposer.launch(seq["ids"])

    def proposal():                         # 4 tokens accepted, then the next proposal
        proposer.add_features(verified, [0, 1, 2, 3])
        seq["ids"] = torch.cat([seq["ids"], torch.randint(0, V, (1, 4), generator=gen)], 1)
        proposer.launch(seq["ids"])

    runner = adapter_for(target)
    cache = runner.new_cache(1, max_length=256)
    runner.forward(torch.randint(0, V, (1, 64), generator=gen).cuda(), cache, logits_positions=slice(0, 0))
    tree = torch.tensor([[-1] + [0] * 4 + [1] * 4 + [2] * 4 + [5] * 3], device="cuda")
    ids = torch.randint(0, V, (1, 16), generator=gen).cuda()

    def verify():
        runner.forward(ids, cache, parents=tree, hidden_layers=tuple(proposer.feature_layers))
        cache.discard()

    timeline(proposal, "proposal", args.out)
    timeline(verify, "verify16", args.out)


if __name__ == "__main__":
    main()
