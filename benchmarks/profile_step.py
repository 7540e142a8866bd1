"""GPU: where the time of one decode step goes, at the 1.3B GDN shape (the trained target inflated, bf16, batch 1).

Times, as the decoding loops run them (CUDA-graph replays through ``GDNRunner`` / the drafter's runner, CUDA events,
median of many replays after warm-up):
- ``ar_step``: the target consuming one token (our autoregressive step); ``prompt_pass_128``: a 128-token prompt
  consumed as graphed chains, and ``prompt_pass_128_eager`` through fla's chunked kernels;
- ``verify_N``: the target verifying a random tree of N nodes (padded to its bucket), pending nodes then discarded;
- ``pdl_ab`` (``--ab pdl``): ``ar_step``, ``ar_loop32`` (32 greedy steps back to back), ``verify_4/16/32/64`` and
  ``draft_tree9`` from runners captured under each setting (programmatic dependent launch on and off), in rotating
  order (``--ab-only``: only these and the prompt passes, a short run);
- ``commit``: committing a 6-node path of a 32-node tree (state + conv window, all layers);
- ``draft_root`` / ``draft_tree9`` / ``draft_catchup4``: the inflated aligned drafter's calls, and
  ``draft_step_tree`` / ``draft_step_chain``: its whole share of a step as the loop issues it (feature fusion,
  catch-up with the root, every depth, the selection);
and, from one eager target step, one eager verify pass of 16 and of 64 nodes and one eager 9-node drafter call under
``torch.profiler``, the kernels they launch (count, summed GPU time): the gap between that sum and the graph replay
is launch/dependency overhead inside the graph, the gap between the sum and the weight-bandwidth floor is kernel
inefficiency; and whole decoding calls (AR, SpecLA tree and chain) under the profiler: wall vs GPU-busy time per
step and the loop's host phases (Chrome traces beside the JSON). Writes ``--out/profile_step.json`` and prints a
table last.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \
        python benchmarks/profile_step.py --out $OUT/profile
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

import specla_hf  # noqa: F401  (registers the drafter classes)
from acceptance_curve import weight_floor_ms
from specla_hf.app.loading import load_models
from specla_hf.drafters.eagle import _BlockRunner
from specla_hf.models.fla_gdn import GDNRunner
from specla_hf.runtime.transfer import copy_in
from specla_hf.training.inflate import inflate_pair
from specla_kernels import tuning


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


def host_us(fn, reps: int = 50) -> float:
    """Median host microseconds to issue ``fn()`` (the GPU drained between calls, outside the timing): what the
    host pays per call when nothing makes it wait, e.g. a CUDA-graph launch."""
    import time
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t))
    torch.cuda.synchronize()
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


def loop_profile(fn, trace: Path) -> dict:
    """One whole decoding call under ``torch.profiler`` (CPU and CUDA), read from its Chrome trace: wall time, the
    time the GPU was busy (union of kernel and copy intervals), and per SpecLA loop phase (the ``specla.*`` host
    ranges) its host time, the GPU time busy under it and the CUDA runtime calls in it (syncs, copies, launches).
    The profiler inflates host time (it records every op): read phases against each other, not as absolute cost;
    ``wall_unprofiled_ms`` is the same call without it, so ``wall_unprofiled_ms - gpu_busy_ms`` is about how long the
    GPU waits for the host (kernel times do not change under the profiler). The trace itself is kept gzipped beside
    the JSON for a closer look."""
    import gzip
    import time
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall_unprofiled = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    with gzip.open(f"{trace}.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace.unlink()
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))

    def busy(a: float, b: float) -> float:                  # GPU-busy microseconds inside [a, b]
        total, end = 0.0, a
        for x, y in gpu:
            if y > end and x < b:
                total += min(y, b) - max(x, end)
                end = min(y, b)
        return total

    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    phases = collections.defaultdict(lambda: {"calls": 0, "host_ms": 0.0, "gpu_busy_ms": 0.0,
                                              "runtime_ms": collections.Counter()})
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("specla."):
            p, a, b = phases[e["name"]], e["ts"], e["ts"] + e["dur"]
            p["calls"] += 1
            p["host_ms"] += e["dur"] / 1e3
            p["gpu_busy_ms"] += busy(a, b) / 1e3
            for r in runtime:
                if a <= r["ts"] < b:
                    p["runtime_ms"][r["name"]] += r["dur"] / 1e3
    span = (gpu[0][0], gpu[-1][1]) if gpu else (0.0, 0.0)
    return {"wall_ms": 1e3 * wall, "wall_unprofiled_ms": 1e3 * wall_unprofiled, "gpu_busy_ms": busy(*span) / 1e3,
            "phases": {k: {**v, "runtime_ms": dict(v["runtime_ms"].most_common(5))} for k, v in phases.items()}}


def ar_tokens(runner: GDNRunner, token: torch.Tensor, cache, n: int) -> None:
    """``n`` greedy steps as ``autoregressive_decode`` runs them (graph replay, argmax, next input)."""
    for _ in range(n):
        token = runner.forward(token, cache).logits[:, -1].argmax(-1, keepdim=True)


def setting_ab(big, drafter, prompt: torch.Tensor, token: torch.Tensor, gen: torch.Generator,
               settings: dict[str, Callable[[], None]], rounds: int = 4) -> dict:
    """Launch settings side by side (``settings``: name -> a function that applies it; each module global they
    change is read when a kernel is launched or captured): runners built and captured under each setting (own graphs
    and caches), then timed on the same inputs in rounds whose order rotates (medians), so that drift and order fall
    on all: the target's step, 32 greedy steps back to back (``ar_loop32``), verify passes of 4, 16, 32 and 64 nodes
    and the drafter's pass over a 9-node tree. Run before anything starts the profiler (its callbacks stay and slow
    later launches)."""
    trees = {n: (torch.randint(0, big.config.vocab_size, (1, n), generator=gen), random_tree(n, gen))
             for n in (4, 16, 32, 64)}
    H, dev = drafter.config.hidden_size, big.device
    feats9 = torch.randn(1, 9, H, generator=gen).to(dev, big.dtype)
    toks9 = torch.randint(0, big.config.vocab_size, (1, 9), generator=gen).to(dev)
    tree9 = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 1, 1]], device=dev)
    setups = {}
    for name, setting in settings.items():
        with _applied(setting):
            setups[name] = _build_setup(big, drafter, prompt, token, trees, feats9, toks9, tree9)
    times = {k: collections.defaultdict(list) for k in setups}
    names = list(setups)
    for r in range(rounds):
        # the order rotates: with PDL "on" always timed first, the drafter pass (no PDL kernel in it, so PDL cannot be
        # the cause) measured 0.334 ms "on" and 0.247 ms "off"
        for k in names[r % len(names):] + names[:r % len(names)]:
            for name, call in setups[k].items():
                times[k][name].append(cuda_ms(call, reps=10 if name == "ar_loop32" else 50))
    return {k: {name: statistics.median(v) for name, v in t.items()} for k, t in times.items()}


def _build_setup(big, drafter, prompt, token, trees, feats9, toks9, tree9) -> dict:
    """Runners for one setting, each call run once (captured now, under the setting); the calls to time."""
    runner = GDNRunner(big)
    cache = runner.new_cache(1)
    runner.forward(prompt, cache, logits_positions=slice(0, 0))
    drunner = _BlockRunner(drafter, big)
    dcache = drunner.new_cache(1)

    def verify(ids, parents, runner=runner, cache=cache):
        runner.forward(ids, cache, parents=parents, hidden_layers=(1, 2, 21))
        cache.discard()

    def draft_tree9(drunner=drunner, dcache=dcache):
        drunner.forward((feats9, toks9), dcache, parents=tree9)
        dcache.discard()
    calls = {"ar_step": lambda runner=runner, cache=cache: runner.forward(token, cache),
             "ar_loop32": lambda runner=runner, cache=cache: ar_tokens(runner, token, cache, 32),
             **{f"verify_{n}": lambda t=t: verify(*t) for n, t in trees.items()}, "draft_tree9": draft_tree9}
    for call in calls.values():
        call()                                          # captured now, under this setting
    return calls


def _setting(**values) -> dict:
    """``tuning.KernelTuning`` changes (and torch's preferred BLAS library) from the keys ``pdl``, ``pdl_small``,
    ``split_rows``, ``split_cols``, ``row_config``, ``fused_verify``, ``one_token_gemm``, ``step_configs`` (whether
    the table ``benchmarks/tune_step.py`` wrote is used; by default it is unless a GEMV launch key is given, which
    it would override), ``small_max``, ``sweeps``, ``blas``; the others keep their defaults. (Also compared here and
    removed, H200: an L2 prefetch of the next GEMV's weights, 0 / 4 / 12 / 24 MiB: step 1.188 / 1.214 / 1.264 /
    1.325 ms; a one-token recurrence kernel of our own with PDL against fla's: 1.183 vs 1.148 ms; PDL off for the
    row-owner GEMVs only: 1.175 vs 1.136 ms.)"""
    names = {"pdl": "pdl", "pdl_small": "pdl_small_kernels", "split_rows": "gemv_split_max_rows",
             "split_cols": "gemv_split_cols", "row_config": "gemv_row_config", "small_max": "tree_small_max",
             "sweeps": "tree_sweeps", "fused_verify": "fused_verify_max_nodes",
             "one_token_gemm": "one_token_fused_gemm"}
    changes = {names[k]: v for k, v in values.items() if k in names}
    launch_keys = {"split_rows", "split_cols", "row_config"} & values.keys()
    if not values.get("step_configs", not launch_keys):
        changes["gemv_step_configs"] = {}
    return dict(tuning=changes, blas=values.get("blas", _BLAS))


@contextlib.contextmanager
def _applied(setting: dict):
    """Kernels launched or captured inside run under ``setting`` (``_setting``)."""
    torch.backends.cuda.preferred_blas_library(setting["blas"])
    try:
        with tuning.using(**setting["tuning"]):
            yield
    finally:
        torch.backends.cuda.preferred_blas_library(_BLAS)


_BLAS = torch.backends.cuda.preferred_blas_library()    # the library verify and drafter passes' GEMMs use
AB = {  # name -> its settings; a setting repeated last shows what the build order alone does
    "step_configs": {"autotuner": _setting(step_configs=False), "step-tuned table": _setting(),
                     "autotuner again": _setting(step_configs=False)},
    "pdl": {"on": _setting(pdl=True), "off": _setting(pdl=False), "on again": _setting(pdl=True)},
    "split": {"default": _setting(), "<= 4096 rows, 512 columns": _setting(split_rows=4096,
              split_cols=512), "none": _setting(split_rows=0), "default again": _setting()},
    # the node-by-node tree verify inside the model: a graphed 4-node pass with it measured 1.81 ms against 1.71 for
    # 8 nodes (with the WY/UT kernel the 4-node pass had been 2-3% under the 8-node one), though the kernel alone wins
    # at 4 nodes
    "small": {"default": _setting(), "no node-by-node kernel": _setting(small_max=0), "default again": _setting()},
    # the verify pass's small kernels (tree conv, gates, tree verify, gated norm) launched with PDL
    "pdl_small": {"default": _setting(), "small kernels with PDL": _setting(pdl_small=True),
                  "default again": _setting()},
    # the verify pass's GEMMs (~1.0 ms of a 64-node pass's 1.75 ms of kernels, H200) through cuBLASLt's choice
    "blas": {"default": _setting(), "cuBLASLt": _setting(blas="cublaslt"), "default again": _setting()},
    # the verify pass's products as fused_gemm kernels with the norms, SwiGLU and residual adds fused (7 launches a
    # layer against 14), up to 16 and up to 64 nodes, against cuBLAS
    "fused_verify": {"cuBLAS": _setting(), "fused up to 16 nodes": _setting(fused_verify=16),
                     "fused up to 64 nodes": _setting(fused_verify=64), "cuBLAS again": _setting()},
    # the one-token step's products through fused_gemm on one row (a pipelined tl.dot K loop) against the GEMVs
    "one_token_gemm": {"GEMV": _setting(), "fused_gemm": _setting(one_token_gemm=True), "GEMV again": _setting()},
    # the tree verify's solve by depth sweeps where tuning's tree_sweeps has them (64, 128 nodes), against the block solve
    "sweep": {"default": _setting(), "block solve only": _setting(sweeps={}), "default again": _setting()},
    # the row-owner products (gate_up, lm_head) with a third stage in flight, or split-K like the others (on plain
    # products on the H200 split-K streamed at 4.1 TB/s, the row-owner kernel with two stages at 3.1)
    "rows": {"default": _setting(),
             "3 stages, (4 rows, 2 per SM, 8 warps)": _setting(row_config=dict(BN=4, PER_SM=2, STAGES=3, num_warps=8)),
             "3 stages, (2 rows, 4 per SM, 4 warps)": _setting(row_config=dict(BN=2, PER_SM=4, STAGES=3, num_warps=4)),
             "every product split-K": _setting(split_rows=1 << 20), "default again": _setting()},
}
# fused_verify up to 16 nodes alone: a third of the autotuning on a machine without a compile cache
AB["fused_verify_16"] = {k: v for k, v in AB["fused_verify"].items() if k != "fused up to 64 nodes"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ab", default="pdl", help="comma-separated settings compared side by side before the "
                    f"profile ({', '.join(AB)}; empty: none)")
    ap.add_argument("--ab-only", action="store_true", help="only the prompt passes and the --ab comparisons")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = load_models(device="cuda", dtype="bfloat16")
    small, small_drafter = models.target, models.drafter
    big, drafter = inflate_pair(small, small_drafter)
    cfg = big.config
    big.generation_config.eos_token_id = None             # fixed-length loops
    weight_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    res = {"params": sum(p.numel() for p in big.parameters()), "weight_bytes": weight_bytes,
           "drafter_params": sum(p.numel() for p in drafter.parameters())}

    def save() -> None:                 # after each part, so that a run cut short keeps what it measured
        (args.out / "profile_step.json").write_text(json.dumps(res, indent=1))

    runner = GDNRunner.for_model(big)
    cache = runner.new_cache(1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 128), generator=gen).cuda()
    runner.forward(prompt, cache, logits_positions=slice(0, 0))
    token = prompt[:, -1:]
    # the 128-token prompt pass: graphed chains (the default with graphs) vs fla's eager chunked kernels
    eager = GDNRunner(big, cuda_graphs=False)
    res["prompt_pass_128"] = cuda_ms(lambda: runner.forward(prompt, runner.new_cache(1), logits_positions=slice(0, 0)),
                                     reps=10)
    res["prompt_pass_128_eager"] = cuda_ms(lambda: eager.forward(prompt, eager.new_cache(1),
                                                                 logits_positions=slice(0, 0)), reps=10)
    del eager
    for what in filter(None, args.ab.split(",")):
        ab = res[f"{what}_ab"] = setting_ab(big, drafter, prompt, token, gen, AB[what])
        print(f"| {what} | " + " | ".join(next(iter(ab.values()))) + " |")
        for k, v in ab.items():
            print(f"| {k} | " + " | ".join(f"{t:.3f}" for t in v.values()) + " |")
    save()
    if args.ab_only:
        return
    res["ar_step"] = cuda_ms(lambda: runner.forward(token, cache))
    res["ar_step_host_us"] = host_us(lambda: runner.forward(token, cache))
    res["profile"] = kernel_profile(lambda: runner.compute(token, cache, None, None, ()))

    for n in (16, 64):
        tree = random_tree(n, gen).cuda()
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).cuda()

        def eager_verify(ids=ids, tree=tree):
            runner.compute(ids, cache, tree, None, (1, 2, 21))
            cache.discard()
        res[f"profile_verify{n}"] = kernel_profile(eager_verify)
    save()

    for n in (4, 8, 16, 25, 32, 64):
        # host tensors, as the decoding loop passes them (padded to the bucket and copied in by the runner)
        parents = random_tree(n, gen)
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)

        def verify():
            runner.forward(ids, cache, parents=parents, hidden_layers=(1, 2, 21))
            cache.discard()
        res[f"verify_{n}"] = cuda_ms(verify)
        res[f"verify_{n}_host_us"] = host_us(verify)
    # the pieces of a verify call's host time (64-node bucket): the graph launch alone, one host-to-GPU input copy
    g = runner.graphs.last_tree
    res["verify_64_graph_launch_host_us"] = host_us(g.call.replay)
    host_parents = torch.full(tuple(g.parents.shape), -1)
    res["copy_in_host_us"] = host_us(lambda: copy_in(g.parents, host_parents))

    parents = torch.tensor([[-1, 0, 1, 2, 3, 4] + [int(torch.randint(0, i, (), generator=gen)) for i in range(6, 32)]])
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=gen).cuda()
    commits = []
    for _ in range(30):
        runner.forward(ids, cache, parents=parents.cuda())
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cache.commit(5)
        b.record()
        b.synchronize()
        commits.append(a.elapsed_time(b))
    res["commit"] = statistics.median(commits[5:])
    save()

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

    def eager_draft9():
        drunner.compute((feats9, toks9), dcache, tree, None, ())
        dcache.discard()
    res["profile_draft9"] = kernel_profile(eager_draft9)
    save()
    # the drafter's share of a step as the loop issues it, for the default tree and chain, after 4 accepted tokens:
    # the fusion of the accepted path's target features, the catch-up on those positions with the root, every
    # depth's graph and the selection
    from specla_hf.generation import draft_options
    verified = tuple(torch.randn(1, 32, H, device="cuda", dtype=torch.bfloat16) for _ in drafter.config.feature_layers)
    for name, tree_mode in (("draft_step_tree", True), ("draft_step_chain", False)):
        eagle = drafter.candidate_generator(big, draft_options(tree=tree_mode, confidence_threshold=0.0))
        seq = {"ids": torch.randint(0, cfg.vocab_size, (1, 17), generator=gen)}
        eagle.add_features(tuple(f[:, :16] for f in verified))
        eagle.launch(seq["ids"])

        def draft_step():
            eagle.add_features(verified, [0, 1, 2, 3])
            seq["ids"] = torch.cat([seq["ids"], torch.randint(0, cfg.vocab_size, (1, 4), generator=gen)], 1)
            eagle.launch(seq["ids"])
        res[name] = cuda_ms(draft_step)
    res["floor_ms"] = weight_floor_ms(big)

    # whole decoding calls, 48 new tokens after a 64-token prompt: where the wall time of a step goes
    from specla_hf.loop.autoregressive import autoregressive_decode
    prompt = prompt[:, :64]
    n_new = 48
    res["loop_ar"] = loop_profile(lambda: autoregressive_decode(runner, prompt, n_new), args.out / "trace_ar.json")
    for name, kw in (("loop_tree", dict(tree=True, confidence_threshold=0.0)),
                     ("loop_tree_default", dict(tree=True)), ("loop_chain_default", dict(tree=False))):
        gen_kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, do_sample=False,
                      assistant_model=drafter, **kw)
        res[name] = loop_profile(lambda: big.generate(prompt, **gen_kw), args.out / f"trace_{name[5:]}.json")
        stats = big.specla_stats
        res[name].update(steps=stats.steps, tau=stats.tau, nodes_per_step=statistics.mean(stats.draft_nodes))
        save()
    print(json.dumps(res["profile"], indent=1))
    print(json.dumps(res["profile_verify16"], indent=1))
    print(json.dumps(res["profile_verify64"], indent=1))
    print(json.dumps(res["profile_draft9"], indent=1))
    print("| call | ms |\n|---|---|")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"| {k} | {v:.3f} |")
    for name in ("profile", "profile_verify16", "profile_verify64", "profile_draft9"):
        p = res[name]
        print(f"| {name}: eager kernels | {p['kernels']} (summed GPU time {p['gpu_ms']:.3f} ms) |")
    for name in ("loop_ar", "loop_tree", "loop_tree_default", "loop_chain_default"):
        p = res[name]
        per = p.get("steps", n_new)
        print(f"| {name}: per step wall (unprofiled) / GPU busy | {p['wall_ms'] / per:.3f} "
              f"({p['wall_unprofiled_ms'] / per:.3f}) / {p['gpu_busy_ms'] / per:.3f} ms (tau {p.get('tau', 1):.2f}) |")
        for k, v in p["phases"].items():
            print(f"|   {k} | host {v['host_ms'] / per:.3f} ms/step, GPU busy under it {v['gpu_busy_ms'] / per:.3f} |")


if __name__ == "__main__":
    main()
