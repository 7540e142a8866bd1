"""GPU: where the time of one decode step goes, at the 1.3B GDN shape (the trained target inflated, bf16, batch 1).

Times, as the decoding loops run them (CUDA-graph replays through ``GDNRunner`` / the drafter's runner, CUDA events,
median of many replays after warm-up):
- ``ar_step``: the target consuming one token (our autoregressive step);
- ``verify_N``: the target verifying a random tree of N nodes (padded to its bucket), pending nodes then discarded;
- ``commit``: committing a 6-node path of a 32-node tree (state + conv window, all layers);
- ``draft_root`` / ``draft_expand4`` / ``draft_catchup4``: the inflated aligned drafter's calls;
and, from one eager target step under ``torch.profiler``, the kernels it launches (count, summed GPU time): the gap
between that sum and the graph replay is launch/dependency overhead inside the graph, the gap between the sum and the
weight-bandwidth floor is kernel inefficiency. Writes ``--out/profile_step.json`` and prints a table last.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \
        python benchmarks/profile_step.py --out $OUT/profile
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

import torch

import specla_hf  # noqa: F401  (registers the drafter classes)
from specla_hf.defaults import load_models
from specla_hf.eagle import _BlockRunner
from specla_hf.gdn import GDNRunner
from specla_hf.inflate import inflate_pair


def cuda_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` (each call timed with its own pair of CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([[-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]])


def kernel_profile(fn) -> dict:
    """Kernels of one eager call of ``fn``: count and summed GPU time, overall and the top names."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            per_name[e.name][0] += 1
            per_name[e.name][1] += e.device_time / 1e3          # us -> ms
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"kernels": sum(c for c, _ in per_name.values()), "gpu_ms": sum(t for _, t in per_name.values()),
            "top": [{"name": n[:90], "count": c, "ms": round(t, 4)} for n, (c, t) in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = load_models(device="cuda", dtype="bfloat16")
    small, small_drafter = models.target, models.drafter
    big, drafter = inflate_pair(small, small_drafter)
    cfg = big.config
    weight_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    res = {"params": sum(p.numel() for p in big.parameters()), "weight_bytes": weight_bytes,
           "drafter_params": sum(p.numel() for p in drafter.parameters())}

    runner = GDNRunner.for_model(big)
    cache = runner.new_cache(1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 128), generator=gen).cuda()
    runner.forward(prompt, cache, logits_positions=slice(0, 0))
    token = prompt[:, -1:]
    res["ar_step"] = cuda_ms(lambda: runner.forward(token, cache))
    res["profile"] = kernel_profile(lambda: runner._forward(token, cache, None, None, ()))
    tree16 = random_tree(16, gen).cuda()
    ids16 = torch.randint(0, cfg.vocab_size, (1, 16), generator=gen).cuda()

    def eager_verify():
        runner._forward(ids16, cache, tree16, None, (1, 2, 21))
        cache.discard()
    res["profile_verify16"] = kernel_profile(eager_verify)

    for n in (4, 8, 16, 25, 32, 64):
        parents = random_tree(n, gen).cuda()
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).cuda()

        def verify():
            runner.forward(ids, cache, parents=parents, hidden_layers=(1, 2, 21))
            cache.discard()
        res[f"verify_{n}"] = cuda_ms(verify)

    parents = torch.tensor([[-1, 0, 1, 2, 3, 4] + [int(torch.randint(0, i, (), generator=gen)) for i in range(6, 32)]])
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=gen).cuda()
    commits = []
    for _ in range(30):
        runner.forward(ids, cache, parents=parents.cuda())
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cache.commit(5, path_length=6)
        b.record()
        b.synchronize()
        commits.append(a.elapsed_time(b))
    res["commit"] = statistics.median(commits[5:])

    drunner = _BlockRunner.for_drafter(drafter, big)
    dcache = drunner.new_cache(1)
    H = drafter.config.hidden_size
    feats = torch.randn(1, 4, H, device="cuda", dtype=torch.bfloat16)
    toks = torch.randint(0, cfg.vocab_size, (1, 4), generator=gen).cuda()
    drunner.forward((feats, toks), dcache, logits_positions=slice(0, 0))
    res["draft_catchup4"] = cuda_ms(lambda: drunner.forward((feats, toks), dcache, logits_positions=slice(0, 0)))
    root = torch.tensor([[-1]], device="cuda")
    tree = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 1, 1]], device="cuda")
    feats9 = torch.randn(1, 9, H, device="cuda", dtype=torch.bfloat16)
    toks9 = torch.randint(0, cfg.vocab_size, (1, 9), generator=gen).cuda()

    def draft_call(f, t, p):
        def call():
            drunner.forward((f, t), dcache, parents=p)
            dcache.discard()
        return call
    res["draft_root"] = cuda_ms(draft_call(feats[:, :1], toks[:, :1], root))
    res["draft_tree9"] = cuda_ms(draft_call(feats9, toks9, tree))
    res["floor_ms"] = weight_bytes / 4.2e12 * 1e3            # all weights once at the measured ~4.2 TB/s copy rate

    (args.out / "profile_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["profile"], indent=1))
    print(json.dumps(res["profile_verify16"], indent=1))
    print("| call | ms |\n|---|---|")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"| {k} | {v:.3f} |")
    for name in ("profile", "profile_verify16"):
        p = res[name]
        print(f"| {name}: eager kernels | {p['kernels']} (summed GPU time {p['gpu_ms']:.3f} ms) |")


if __name__ == "__main__":
    main()
