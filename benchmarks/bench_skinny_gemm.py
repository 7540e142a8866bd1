"""GPU microbenchmark of the tree passes' plain products on a few token rows: cuBLAS against ``ops.skinny_gemm``.

    python benchmarks/bench_skinny_gemm.py OUT.json [--rows 4,16,32,64] [--table kernels/specla_kernels/skinny_gemm_launches.json]

For each product of a verify pass at the GDN 1.3B shape and the Qwen3.5 0.8B shape (bf16, random weights) and each
row count, it times, as CUDA-graph replays of copies of the weight run back to back (the weights stream from HBM as
a model's layers do; medians of 60 replays): cuBLAS through ``F.linear`` (torch's default BLAS), the same through
cuBLASLt, the transposed call ``W @ x.T`` (another cuBLAS tile choice), ``fused_gemm`` without prologue or epilogue,
``skinny_gemm`` at its default launch and at every launch of ``LAUNCHES`` x K slices. Each kernel is checked against
``skinny_gemm_ref`` first. Writes one record per (shape, product, rows) with every timing and the fastest launch;
``--table`` writes the fastest launches as the kernel's launch table.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specla_kernels import fused_gemm as fg, reference as ref, skinny_gemm as sg

# (columns, K step, warps, stages): the compiles; K slices are a launch argument
LAUNCHES = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 4, 5), (64, 256, 4, 3),
            (64, 128, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3)]
SLICES = (1, 2, 3, 4, 6, 8, 12)
COPY_BYTES = 512 * 2**20    # weight copies a graph streams through (at most 21): L2 holds none of them

# [N, K] of each product of a verify pass
SHAPES = {
    "gdn-1.3b": {"in_proj": (9228, 2048), "o_proj": (2048, 3072), "gate_up": (11264, 2048), "down": (2048, 5632),
                 "lm_head": (8192, 2048)},
    "qwen3.5-0.8b": {"gdn in_proj": (8224, 1024), "gdn out_proj": (1024, 2048), "attn qkv": (5120, 1024),
                     "attn o_proj": (1024, 2048), "gate_up": (7168, 1024), "down": (1024, 3584),
                     "lm_head": (248320, 1024)},
}


def bench(fns) -> float:
    """Median us per call of a CUDA-graph replay of ``fns`` run in turn."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(60):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / len(fns) * 1e3


def with_blas(library: str, fn):
    """``fn`` run (and captured) with torch's preferred BLAS library set to ``library``."""
    def run():
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def measure(shape: str, name: str, N: int, K: int, M: int, gen: torch.Generator) -> dict:
    w = (torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    copies = [w] + [w.clone() for _ in range(min(20, COPY_BYTES // w.nbytes))]
    want = ref.skinny_gemm_ref(x, w).float()

    def rel_err(y):
        return ((y.float() - want).norm() / want.norm()).item()

    rec = dict(model_shape=shape, product=name, M=M, N=N, K=K, MB=w.nbytes / 2**20, copies=len(copies),
               check={"skinny_default": rel_err(sg.skinny_gemm(x, w)), "fused_gemm": rel_err(fg.fused_gemm(w, x))})
    us = {"cublas": bench([lambda c=c: F.linear(x, c) for c in copies]),
          "cublaslt": bench([with_blas("cublaslt", lambda c=c: F.linear(x, c)) for c in copies]),
          "cublas_transposed": bench([lambda c=c: c @ x.T for c in copies]),
          "fused_gemm": bench([lambda c=c: fg.fused_gemm(c, x) for c in copies]),
          "skinny_default": bench([lambda c=c: sg.skinny_gemm(x, c) for c in copies])}
    launches = {}
    for bn, bk, nw, st in LAUNCHES:
        for s in SLICES:
            if s > 1 and K // s < 2 * bk:
                continue
            launch = dict(BN=bn, BK=bk, S=s, num_warps=nw, num_stages=st)
            key = json.dumps(launch)
            try:
                err = rel_err(sg.skinny_gemm(x, w, launch))
                if err > 1e-2:
                    launches[key] = f"wrong: rel err {err:.3g}"
                    continue
                launches[key] = bench([lambda c=c: sg.skinny_gemm(x, c, launch) for c in copies])
            except Exception as e:                     # a launch that does not fit shared memory or registers
                launches[key] = f"{type(e).__name__}: {str(e)[:120]}"
    timed = {k: v for k, v in launches.items() if isinstance(v, float)}
    best = min(timed, key=timed.get)
    us["skinny_best"] = timed[best]
    rec.update(us_per_product=us, best_launch=json.loads(best), launches=launches,
               GBps={k: rec["MB"] * 2**20 / v / 1e3 for k, v in us.items()})
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="4,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--table", help="write the fastest launches here as skinny_gemm's launch table")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | product | rows | MB | cuBLAS | cuBLASLt | W @ x.T | fused_gemm | skinny default | skinny best | "
          "best launch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for name, (N, K) in SHAPES[shape].items():
            for M in map(int, args.rows.split(",")):
                rec = measure(shape, name, N, K, M, gen)
                records.append(rec)
                u = rec["us_per_product"]
                print(f"| {shape} | {name} | {M} | {rec['MB']:.1f} | " + " | ".join(
                    f"{u[k]:.1f}" for k in ("cublas", "cublaslt", "cublas_transposed", "fused_gemm", "skinny_default",
                                            "skinny_best")) + f" | {rec['best_launch']} |", flush=True)
                with open(args.out, "w") as f:
                    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=records), f,
                              indent=1)
    if args.table:
        table = {f"{r['N']}x{r['K']}@{max(16, 1 << (r['M'] - 1).bit_length())}": r["best_launch"] for r in records}
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
