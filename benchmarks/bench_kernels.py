"""GPU microbenchmark of the SpecLA Triton kernels at the fla 1.3B GDN shape (21 layers, 6 heads, K=256, V=512, bf16,
batch 1). It checks, then times, and prints a markdown table last; with ``$OUT`` set it writes the numbers to
``$OUT/bench_kernels.json``.

    python benchmarks/bench_kernels.py [--quick] [--commit-only] [--depths 1,2,4,8,16]

For N in {1, 4, 16, 32, 64, 128} draft nodes it times, each as a CUDA graph replay (median of
``triton.testing.do_bench``, which flushes L2 before every replay), for one layer and for all 21 layers (each layer its
own state and inputs, 63 MiB of states in all):
- ``tree``: our tree verify on a random tree (writes o, u, k_hat; no per-node state): ``--tree deep`` (the default)
  a main chain with side branches, ``--tree drafted`` the shape the default drafter submits (depth 8, up to 4
  children a node), which sets how many sweeps the sweep solve takes;
- ``fla chain``: fla's ``fused_recurrent_gated_delta_rule`` on a chain of N tokens (outputs only);
- ``snapshot``: the tree verified the snapshot way: fla's fused_recurrent once per node from its parent's state,
  writing a full [HV, V, K] fp32 state per node;
- ``tree`` includes building the tree's ancestor mask once (``tree_ancestors``), which every layer reads, as a
  verify pass does;
- ``commit``: ``commit_`` of the tree's deepest path, every layer's state and window in one launch, the path handed
  over as the device loop's acceptance step hands it (a buffer as long as the tree is deep); ``commit_host``: the
  same with the path in the host loop's commit graph's buffer; ``commit_sweep``: ``commit`` at other state tile
  shapes.
and it reports bytes moved against the measured device-to-device copy bandwidth, and factor vs snapshot memory.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import triton

from specla_kernels import reference as ref
from specla_kernels.commit import PATH_CHUNK, commit_, root_path
from specla_kernels.ops import commit_state_
from specla_kernels.tree_conv import tree_conv
from specla_kernels import tuning
from specla_kernels.tree_delta import tree_ancestors, tree_config, tree_gated_delta_rule

LAYERS, H, HV, K, V, B = 21, 6, 6, 256, 512, 1
CONV_D, CONV_W = 2 * H * K + HV * V, 4            # q|k|v raw projections share one depthwise conv of width 4
NODES = (1, 4, 16, 32, 64, 128)
# launch shapes of the WY/UT kernel tried beside tree_config's default, per padded node count BN
# (BK = 32 and 8 warps: the shapes with few register spills, benchmarks/kernel_resources.py)
SWEEP = {16: [dict(BV=32), dict(num_warps=4), dict(BV=32, num_warps=4), dict(BK=64), dict(BK=16),
              dict(num_stages=2), dict(num_stages=4)],
         32: [dict(BV=16), dict(num_warps=2), dict(num_warps=8), dict(BV=64), dict(BK=64), dict(BV=64, num_warps=8),
              dict(num_stages=2), dict(num_stages=4), dict(num_warps=2, num_stages=4)],
         64: [dict(num_warps=8), dict(BV=16), dict(BV=64), dict(BV=16, num_warps=8), dict(BK=32),
              dict(BK=32, num_warps=8), dict(BK=32, BV=16), dict(BV=64, num_warps=8), dict(BK=16, num_warps=8),
              dict(num_stages=2), dict(num_stages=4), dict(BK=32, num_stages=4)],
         128: [dict(BC=32), dict(num_warps=4), dict(num_warps=16), dict(BV=16), dict(BV=64), dict(BK=32),
               dict(BK=16, BV=16)]}
# the other solve at each size (tuning's tree_sweeps): depth sweeps where the default is the block solve, at its shape
# and at V slices and warps its fewer [BN, BN] tiles may favour, and the block solve where the default sweeps shallow
# trees (the shapes above are swept with that default). A tree deeper than the SWEEP_MAX used takes the block solve
_SWEEPS_EXTRA = {16: [{}, dict(BV=32)], 32: [{}, dict(BV=16)]}
for _bn in SWEEP:
    SWEEP[_bn] += [dict(SWEEP_MAX=0)] if _bn in tuning.active().tree_sweeps else [dict(SWEEP_MAX=16, **e) for e in _SWEEPS_EXTRA[_bn]]
# up to 8 nodes: the node-by-node kernel at other V slices and warps, and the WY/UT kernel
SMALL_SWEEP = [dict(SMALL=True, BV=bv, num_warps=w)
               for bv, w in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8))]
# state tiles [BV, BK] of one commit program (and path nodes per dot, BP). Not swept, measured on the H200 against the
# then default's 54.9 / 50.4 us at 16 / 1 nodes (21 layers): 2 warps [64, 64] 57.1 / 56.6 us, [32, 64] 55.5 / 51.9;
# 1 warp [64, 64] 59.1 / 56.9; whole state rows [16, 256] 68.9 (2 warps) and 61.7 (4), [32, 256] 62.0 (4), [32, 128]
# 65.9 (2): fewer warps or contiguous rows do not raise the commit's DRAM rate
# Each entry is a whole tile (it replaces commit_tile's): state tiles with and without the alignment hint (ALIGN=1:
# 32-bit accesses), path chunks of 16 and 32 nodes (BP), 8 warps
COMMIT_SWEEP = [dict(BV=bv, BK=bk, BP=16, ALIGN=align, num_warps=4)
                for bv, bk in ((64, 64), (32, 64), (64, 128), (128, 64)) for align in (16, 1)] + [
    dict(BV=64, BK=64, BP=32, ALIGN=16, num_warps=4), dict(BV=64, BK=64, BP=16, ALIGN=16, num_warps=8)]
DTYPE = torch.bfloat16
DEVICE = "cuda"


def bench_graph(fn, rep_ms: int = 60) -> float:
    """Median milliseconds of one replay of a CUDA graph that holds ``fn()`` (warmed up and compiled first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")


def deep_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """A tree drafted the EAGLE way looks like a main chain with side branches: extend the chain with probability
    0.7, else branch off a random earlier node."""
    p = []
    for i in range(n):
        if i == 0:
            p.append(-1)
        elif torch.rand(1, generator=gen).item() < 0.7:
            p.append(i - 1)
        else:
            p.append(int(torch.randint(-1, i - 1, (1,), generator=gen)))
    return torch.tensor([p], dtype=torch.long)


def drafted_tree(n: int, gen: torch.Generator, depth: int = 8, topk: int = 4) -> torch.Tensor:
    """The shape the default drafter submits (``DraftBuffers.select_tree``): nodes in depth order, ``topk`` children
    of the root, the other nodes spread evenly over depths 2..``depth`` (as far as ``topk`` children a node allow),
    each a child of a random node of the depth above with room for one more (the first ones, the drafter's best, more
    often)."""
    p, above, left = [-1] + [0] * min(topk, n - 1), range(1, min(topk, n - 1) + 1), n - 1 - min(topk, n - 1)
    for d in range(depth - 1, 0, -1):
        c = min(-(-left // d), topk * len(above))
        kids = [0] * len(above)
        for _ in range(c):
            free = [j for j, k in enumerate(kids) if k < topk]
            j = free[int(torch.multinomial(torch.tensor([1.0 / (1 + j) for j in free]), 1, generator=gen))]
            kids[j] += 1
            p.append(above[j])
        above, left = range(len(p) - c, len(p)), left - c
    return torch.tensor([p], dtype=torch.long)


def comb_tree(n: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """A chain of ``depth + 1`` nodes with the other nodes as leaves on random chain nodes above its last: a tree of
    exactly that depth (root 0), whatever ``n`` is, so the depth-sweep solve takes ``depth`` sweeps."""
    if not 0 <= depth < n:
        raise ValueError(f"a tree of {n} nodes has a depth in [0, {n - 1}], not {depth}")
    chain = list(range(-1, depth))
    # a leaf hangs off a chain node above the last (depth 0: more roots, a forest of single nodes)
    leaves = torch.randint(0, depth, (n - depth - 1,), generator=gen).tolist() if depth else [-1] * (n - 1)
    return torch.tensor([chain + leaves], dtype=torch.long)


def depth_sweep(n: int, depths: list[int], gen: torch.Generator, dev: str) -> list[dict]:
    """The tree verify of ``n`` nodes on trees of each depth (``comb_tree``), 1 and 21 layers, each checked against
    the reference: the default, the sweeps (``tree_delta._sweep_solve``: the slope is the cost of a sweep) and the
    block solve; at the first depth also q.k in the K loop
    (``LATE_QK=False``, which Triton 3.6 got wrong at 64 nodes: its error is reported), to split the verify's time."""
    layers = [layer_inputs(n, gen, dev) for _ in range(LAYERS)]
    L0, rows = layers[0], []
    solves = [{}, dict(SWEEP_MAX=16), dict(SWEEP_MAX=0)]
    runs = [(d, over) for d in depths for over in solves] + [(depths[0], dict(LATE_QK=False))]
    for d, over in runs:
        parents = comb_tree(n, d, gen).to(dev)
        anc = tree_ancestors(parents)
        o, _, u = tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents, L0["state"],
                                        config=over)
        o_r, _, u_r = ref.tree_gated_delta_rule_ref(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents,
                                                    L0["state"])

        def run(ls):
            return lambda: [tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"],
                                                  ancestors=anc, config=over) for L in ls]
        rows.append(dict(N=n, depth=d, config=over, o_err=rel(o, o_r), u_err=rel(u, u_r),
                         tree_1_ms=bench_graph(run(layers[:1])), tree_21_ms=bench_graph(run(layers))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def layer_inputs(n: int, gen: torch.Generator, dev: str) -> dict:
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev)
    return dict(q=rnd(B, n, H, K).to(DTYPE), k=rnd(B, n, H, K).to(DTYPE), v=rnd(B, n, HV, V).to(DTYPE),
                g=-torch.rand(B, n, HV, generator=gen).to(dev) * 0.3, beta=torch.rand(B, n, HV, generator=gen).to(dev),
                state=rnd(B, HV, V, K) * 0.5, x=rnd(B, n, CONV_D).to(DTYPE), window=rnd(B, CONV_D, CONV_W).to(DTYPE))


def handed_paths(ancestors: torch.Tensor, accepted: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The accepted node's path (one sequence) as ``commit_`` is handed it: ``loop`` as the device loop's acceptance
    step hands it over (``greedy_accept``: a buffer as long as the tree is deep, padded with the accepted node),
    ``host`` as the host loop's commit graphs hold it (``ForwardGraphs.commit``: a buffer of one chunk of nodes where
    the path fits one, else as long as the tree)."""
    nodes, length = root_path(ancestors, accepted)
    n, path_len = nodes.shape[1], int(length[0])

    def buffer(width: int) -> torch.Tensor:
        return torch.where(torch.arange(width, device=nodes.device) < path_len, nodes[:, :width], accepted)
    depth = int(ref.tree_depth(ancestors).max()) + 1
    return dict(loop=(buffer(depth), length),
                host=(buffer(n if path_len > PATH_CHUNK else min(n, PATH_CHUNK)), length))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def save(out: dict) -> None:
    """``$OUT/bench_kernels.json``, when ``$OUT`` is set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_kernels.json"), "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and no launch-shape sweep")
    ap.add_argument("--nodes", help="comma-separated node counts (default: 1,16,64 with --quick, else "
                    f"{','.join(map(str, NODES))})")
    ap.add_argument("--tree", choices=("deep", "drafted"), default="deep", help="the tree verified and committed")
    ap.add_argument("--no-snapshot", action="store_true", help="skip the snapshot baseline (N fla launches per "
                    "layer: the slowest part of a run at 64-128 nodes)")
    ap.add_argument("--depths", help="comma-separated tree depths: only the tree verify at each --nodes count on trees "
                    "of those depths (comb_tree), to split its time into the depth sweeps and the rest")
    ap.add_argument("--commit-only", action="store_true", help="only the commit, its sweep and the state stream's "
                    "floor (the tree verify is still run once for the factors and checked)")
    args = ap.parse_args()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    dev = DEVICE
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    nodes = [int(n) for n in args.nodes.split(",")] if args.nodes else (1, 16, 64) if args.quick else NODES
    out: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     tree=args.tree, shape=dict(layers=LAYERS, H=H, HV=HV, K=K, V=V, batch=B, dtype=str(DTYPE)),
                     rows=[])

    # ---- ceilings: copy bandwidth and the cost of launching 21 trivial kernels from a graph
    src = torch.randn(256 * 2**20, device=dev)                                 # 1 GiB
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    copy_bw = 2 * src.numel() * 4 / (t_copy * 1e-3)
    del src, dst
    tiny = torch.zeros(16, device=dev)
    t_launch21 = bench_graph(lambda: [tiny.add_(1) for _ in range(LAYERS)])
    # the commit's floor: torch's in-place multiply of the 21 layers' states (one read and one write of 63 MiB)
    states = [torch.randn(B, HV, V, K, device=dev) for _ in range(LAYERS)]
    t_rmw = bench_graph(lambda: torch._foreach_mul_(states, 0.999))
    del states
    out.update(copy_bw_GBps=copy_bw / 1e9, graph_21_trivial_kernels_ms=t_launch21, state_rmw_21_ms=t_rmw)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; 21 trivial kernels from a graph: {t_launch21 * 1e3:.1f} us; "
          f"torch._foreach_mul_ of the 21 states: {t_rmw * 1e3:.1f} us", flush=True)

    if args.depths:
        out["depth_sweep"] = [r for n in nodes for r in depth_sweep(n, [int(d) for d in args.depths.split(",")],
                                                                    gen, dev)]
        save(out)
        print("\n| N | depth | config | tree 1L us | tree 21L us | o err | u err |\n|---|---|---|---|---|---|---|")
        for r in out["depth_sweep"]:
            print(f"| {r['N']} | {r['depth']} | {r['config']} | {r['tree_1_ms'] * 1e3:.1f} "
                  f"| {r['tree_21_ms'] * 1e3:.1f} | {r['o_err']:.1e} | {r['u_err']:.1e} |")
        return
    state_bytes = HV * V * K * 4
    for n in nodes:
        t0 = time.time()
        parents = (deep_tree if args.tree == "deep" else drafted_tree)(n, gen).to(dev)
        chain = ref.chain_parents(n, B, device=dev)
        layers = [layer_inputs(n, gen, dev) for _ in range(LAYERS)]
        L0 = layers[0]

        # ---- check: kernel vs reference on the tree, kernel vs fla on the chain
        o, k_hat, u = tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents, L0["state"])
        o_r, k_r, u_r = ref.tree_gated_delta_rule_ref(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents,
                                                      L0["state"])
        o_c, _, _ = tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], chain, L0["state"])
        o_f, _ = fla_recurrent(q=L0["q"], k=L0["k"], v=L0["v"], g=L0["g"], beta=L0["beta"], initial_state=L0["state"],
                               use_qk_l2norm_in_kernel=True, state_v_first=True)
        depth = ref.tree_depth(ref.tree_ancestors(parents))[0]
        accepted = depth.argmax().reshape(1)                                  # commit the deepest path
        state0 = L0["state"].clone()          # the timed commits below rewrite the states in place
        s_k = state0.clone()
        commit_state_(s_k, k_hat, u, L0["g"], parents, accepted)
        s_r = ref.commit_state_ref(L0["state"], k_r, u_r, L0["g"], parents, accepted)
        checks = dict(o_vs_ref=rel(o, o_r), u_vs_ref=rel(u, u_r), k_hat_vs_ref=rel(k_hat, k_r),
                      chain_o_vs_fla=rel(o_c, o_f), commit_vs_ref=rel(s_k, s_r))
        ok = checks["o_vs_ref"] < 1e-2 and checks["chain_o_vs_fla"] < 1e-2 and max(
            checks["u_vs_ref"], checks["k_hat_vs_ref"], checks["commit_vs_ref"]) < 1e-3
        path_len = int(ref.tree_ancestors(parents)[0, int(accepted)].sum())

        # ---- launch shapes for one layer: each checked against the reference, then timed; the best valid one is
        # timed on all layers below beside the default
        sweep, best = [], None
        default = tree_config(n, V, DTYPE)
        shapes = (SWEEP[default["BN"]] if n > 8 else SMALL_SWEEP if not default["SMALL"] else
                  SMALL_SWEEP + [dict(SMALL=False)])
        for over in [{}] + ([] if args.quick or args.commit_only else shapes):
            o_t, _, u_t = tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"], parents, L0["state"],
                                                config=over)
            err = max(rel(o_t, o_r) / 10, rel(u_t, u_r))                     # o is bf16: 10x looser
            fn = lambda: tree_gated_delta_rule(L0["q"], L0["k"], L0["v"], L0["g"], L0["beta"],  # noqa: E731
                                               parents, L0["state"], config=over)
            t = bench_graph(fn, rep_ms=25)
            sweep.append(dict(config=over, ms=t, err=err))
            if err < 1e-3 and (best is None or t < best["ms"]):
                best = sweep[-1]

        # ---- times: one layer and all layers, each a CUDA graph
        def tree(ls, over=None):
            def run():
                anc = tree_ancestors(parents)
                return [tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"],
                                              ancestors=anc, config=over) for L in ls]
            return run

        def fla_chain(ls):
            return lambda: [fla_recurrent(q=L["q"], k=L["k"], v=L["v"], g=L["g"], beta=L["beta"],
                                          initial_state=L["state"], use_qk_l2norm_in_kernel=True, state_v_first=True)
                            for L in ls]

        par = parents[0].tolist()

        def snapshot(ls):
            def run():
                for L in ls:
                    states = []
                    for i in range(n):
                        s0 = L["state"] if par[i] < 0 else states[par[i]]
                        _, s = fla_recurrent(q=L["q"][:, i:i + 1], k=L["k"][:, i:i + 1], v=L["v"][:, i:i + 1],
                                             g=L["g"][:, i:i + 1], beta=L["beta"][:, i:i + 1], initial_state=s0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                             state_v_first=True)
                        states.append(s)
            return run

        factors = []
        for L in layers:
            _, kh, uu = tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"])
            factors.append((kh, uu))

        paths = handed_paths(tree_ancestors(parents), accepted)

        def commit(ls, tile=None, path="loop"):   # every layer's state and window in one launch, as the cache commits
            fs = factors[:len(ls)]
            return lambda: commit_(*paths[path], tile=tile,
                                   states=([L["state"] for L in ls], [kh for kh, _ in fs], [uu for _, uu in fs],
                                           [L["g"] for L in ls]),
                                   windows=([L["x"] for L in ls], [L["window"] for L in ls]))

        def conv(ls):
            w = torch.randn(CONV_D, CONV_W, device=dev)
            return lambda: [tree_conv(L["x"], w, None, L["window"], parents) for L in ls]

        row = dict(N=n, path_len=path_len, checks=checks, ok=ok, config=tree_config(n, V, DTYPE), sweep=sweep,
                   best=best["config"] if best else None)
        for name, make in [("tree", tree), ("fla_chain", fla_chain), ("snapshot", snapshot), ("commit", commit),
                           ("commit_host", functools.partial(commit, path="host")), ("conv", conv)]:
            if name == "snapshot" and args.no_snapshot or args.commit_only and not name.startswith("commit"):
                continue
            row[f"{name}_1_ms"] = bench_graph(make(layers[:1]))
            row[f"{name}_21_ms"] = bench_graph(make(layers))
        row["commit_sweep"] = []
        for t in COMMIT_SWEEP:
            s_t = state0.clone()                  # each tile shape checked on layer 0, then timed on all layers
            try:
                commit_(*paths["loop"], tile=t, states=([s_t], [factors[0][0]], [factors[0][1]], [L0["g"]]))
            except triton.runtime.errors.OutOfResources as e:       # e.g. [64, 256] at 128 nodes: shared memory
                row["commit_sweep"].append(dict(tile=t, error=str(e)))
                continue
            row["commit_sweep"].append(dict(tile=t, err=rel(s_t, s_r), ms_21=bench_graph(commit(layers, t))))
        if best and not args.commit_only:
            row["tree_best_1_ms"] = bench_graph(tree(layers[:1], best["config"]))
            row["tree_best_21_ms"] = bench_graph(tree(layers, best["config"]))
        # bytes the tree verify must move per layer: state read once, inputs read, o/u/k_hat written
        tree_bytes = state_bytes + n * (2 * H * K * 2 + HV * V * 2 + 2 * HV * 4 + HV * V * 2 + HV * V * 4 + H * K * 4)
        commit_bytes = 2 * state_bytes + path_len * (HV * V * 4 + H * K * 4)
        t_tree = row.get("tree_best_21_ms", row.get("tree_21_ms", float("nan")))
        row.update(tree_bytes=tree_bytes, tree_GBps=tree_bytes * LAYERS / (t_tree * 1e-3) / 1e9,
                   commit_bytes=commit_bytes,
                   commit_GBps=commit_bytes * LAYERS / (row["commit_21_ms"] * 1e-3) / 1e9)
        out["rows"].append(row)
        print(json.dumps(row), f"({time.time() - t0:.0f}s)", flush=True)
        save(out)                                   # after every row: a run cut short keeps what it measured
        del layers, factors
        torch.cuda.empty_cache()

    # ---- memory per draft node, all layers: compact factors vs a full snapshot
    factor_node = LAYERS * (H * K * 4 + HV * V * 4 + HV * 4)
    conv_node = LAYERS * CONV_D * 2                    # raw pre-conv inputs kept for the window commit
    snapshot_node = LAYERS * (state_bytes + CONV_D * CONV_W * 2)
    out.update(factor_bytes_per_node=factor_node, conv_input_bytes_per_node=conv_node,
               snapshot_bytes_per_node=snapshot_node)
    save(out)

    us, nan = 1e3, float("nan")
    print(f"\n{out['device']}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
          f"{copy_bw / 1e9:.0f} GB/s; 21 trivial kernels from one graph {t_launch21 * us:.1f} us; times are medians "
          "of CUDA-graph replays (L2 flushed), in us; torch._foreach_mul_ of the 21 states (the commit's floor) "
          f"{out['state_rmw_21_ms'] * us:.1f}")
    print("\n| N | tree 1L | tree 21L | fla chain 21L | tree/fla | snapshot 21L | commit 1L | commit 21L "
          "| commit 21L, host loop | conv 21L | tree GB/s | commit GB/s | path | check | best launch shape (1L, 21L) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        r = {"tree_1_ms": nan, "tree_21_ms": nan, "fla_chain_21_ms": nan, "conv_21_ms": nan, **r}  # --commit-only
        tb = r.get("tree_best_21_ms", r["tree_21_ms"])
        best = (f"{r['best']} {r['tree_best_1_ms'] * us:.1f}, {r['tree_best_21_ms'] * us:.1f}" if "tree_best_1_ms"
                in r else "-")
        print(f"| {r['N']} | {r['tree_1_ms'] * us:.1f} | {r['tree_21_ms'] * us:.1f} | {r['fla_chain_21_ms'] * us:.1f} "
              f"| {tb / r['fla_chain_21_ms']:.2f} | {r.get('snapshot_21_ms', nan) * us:.1f} "
              f"| {r['commit_1_ms'] * us:.1f} "
              f"| {r['commit_21_ms'] * us:.1f} | {r.get('commit_host_21_ms', nan) * us:.1f} "
              f"| {r['conv_21_ms'] * us:.1f} | {r['tree_GBps']:.0f} "
              f"| {r['commit_GBps']:.0f} | {r['path_len']} | {'ok' if r['ok'] else 'FAIL'} | {best} |")
    for r in out["rows"]:
        print(f"commit 21L at N = {r['N']}, us (rel err vs reference): "
              + ", ".join(f"{c['tile']} " + (f"{c['ms_21'] * us:.1f} ({c['err']:.0e})" if "ms_21" in c else
                                              "out of resources") for c in r["commit_sweep"]))
    print(f"\nper draft node, 21 layers: factors {factor_node / 2**20:.3f} MiB (+ raw conv inputs "
          f"{conv_node / 2**20:.3f} MiB) vs snapshot {snapshot_node / 2**20:.1f} MiB: "
          f"{100 * factor_node / snapshot_node:.2f}% ({100 * (factor_node + conv_node) / snapshot_node:.2f}% with conv "
          "inputs)")
    print("tree/fla compares the best valid launch shape on all layers with fla; check: o, u, k_hat, commit vs the "
          "torch reference and o on a chain vs fla")

if __name__ == "__main__":
    sys.exit(main())
