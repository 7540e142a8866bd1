"""GPU kernel timeline of one EAGLE-style proposal and one 16-node verify pass at the 1.3B GDN shape (the trained
target and drafter inflated, bf16, CUDA graphs): each kernel's duration and the idle gap before it, from the
profiler's trace of graph replays. A proposal is the host-driven ``launch`` after a verify step (the accepted path's
feature fusion, the drafter's catch-up on it, 8 depth graphs, the tree selection), so its first kernels wait on the
host; the depths after the first are what the device loop replays.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/draft_timeline.py --out $OUT/timeline

Prints ``duration_us gap_us name`` per kernel and writes ``{proposal,verify16}.rows.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import specla_hf  # noqa: F401  (registers the drafter classes)
from specla_hf.app.loading import load_models
from specla_hf.generation import draft_options
from specla_hf.models.fla_gdn import GDNRunner
from specla_hf.training.inflate import inflate_pair


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = load_models(device="cuda", dtype="bfloat16")
    big, drafter = inflate_pair(models.target, models.drafter)
    H, V = drafter.config.hidden_size, big.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    verified = tuple(torch.randn(1, 32, H, device="cuda", dtype=torch.bfloat16)
                     for _ in drafter.config.feature_layers)
    eagle = drafter.candidate_generator(big, draft_options(tree=True, confidence_threshold=0.0))
    seq = {"ids": torch.randint(0, V, (1, 17), generator=gen)}
    eagle.add_features(tuple(f[:, :16] for f in verified))
    eagle.launch(seq["ids"])

    def proposal():                         # 4 tokens accepted, then the next proposal
        eagle.add_features(verified, [0, 1, 2, 3])
        seq["ids"] = torch.cat([seq["ids"], torch.randint(0, V, (1, 4), generator=gen)], 1)
        eagle.launch(seq["ids"])

    runner = GDNRunner.for_model(big)
    cache = runner.new_cache(1)
    runner.forward(torch.randint(0, V, (1, 64), generator=gen).cuda(), cache, logits_positions=slice(0, 0))
    tree = torch.tensor([[-1] + [0] * 4 + [1] * 4 + [2] * 4 + [5] * 3], device="cuda")
    ids = torch.randint(0, V, (1, 16), generator=gen).cuda()

    def verify():
        runner.forward(ids, cache, parents=tree, hidden_layers=tuple(eagle.feature_layers))
        cache.discard()

    timeline(proposal, "proposal", args.out)
    timeline(verify, "verify16", args.out)


if __name__ == "__main__":
    main()
