"""GPU microbenchmark of the decode step's fused GEMVs (``specla_kernels.gemv``) at the fla 1.3B GDN shape, bf16.

    python benchmarks/bench_gemv.py [--configs | --scaling]

For each product of a one-token step (input projection with norm + conv, output projection with gated norm, MLP
gate|up with residual add + norm, down projection with SwiGLU + residual, LM head with norm), it checks the fused
kernel against ``gemv_ref``, then times it and cuBLAS's plain ``F.linear`` on the same weight, 21 copies of it run
back to back in one CUDA graph as a model's 21 layers run (so weights stream from HBM; medians of 60 replays), and
reports the weight bandwidth of each; the fused chain once more with programmatic dependent launch off (each kernel
waiting for the previous one to end), once with the row-owner kernel and once with split-K at each of ``SPLITS``
columns per program. cuBLAS does the product only: the fused ops it leaves out are separate kernels in the unfused
step. With ``$OUT`` set it writes ``$OUT/bench_gemv.json``. ``--configs`` also times the row-owner kernel at each
of its tuned launch shapes; ``--scaling`` times plain products of 1024..32768 rows instead (``scaling``) and writes
``$OUT/bench_gemv_scaling.json``. ``--fused-gemm ROWS`` times the verify pass's products on ``ROWS`` token rows
instead (``fused_gemm_rows``): ``fused_gemm`` at its autotuner's pick and at every listed launch that fits, against
cuBLAS's product alone, and writes ``$OUT/bench_fused_gemm_ROWS.json``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from specla_kernels import fused_gemm as fg, reference as ref, tuning
from specla_kernels.gemv import _configs, _kinds, _tuned_kernel, _tuned_split, gemv

HID, H, HV, KD, VD, INTER, VOCAB, W, LAYERS = 2048, 6, 6, 256, 512, 5632, 16384, 4, 21
CONV = 2 * H * KD + HV * VD
SPLITS = (512, 1024, 2048)          # columns per split-K program (2048 = one slice of a 2048-wide row)


def bench(fns) -> float:
    """Median ms per call of a CUDA-graph replay of ``fns`` run in turn (compiled / tuned first). Each holds its own
    copy of the weight, 21 in all, as the 21 layers of a model do: the weights stream from HBM, none stays in L2."""
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
    return sorted(times)[len(times) // 2] / len(fns)


def products(dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> tuple[dict, torch.Tensor]:
    """The one-token step's five products at the 1.3B shape, random weights and inputs: ``{name: (weight, input,
    gemv keyword arguments)}`` and the input projection's conv window (its epilogue rewrites it in place)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen, device=dev) * s).to(dt)  # noqa: E731
    h, res, nw = rnd(HID), rnd(HID), rnd(HID).abs() + 0.5
    proj_rows = -(-(CONV + HV * VD + 2 * HV) // 64) * 64
    window = rnd(CONV, W)
    cases = {
        "in_proj (norm, conv)": (rnd(proj_rows, HID, s=HID ** -0.5), h,
                                 dict(norm=(nw, 1e-6), conv=(window, rnd(CONV, W), None))),
        "o_proj (gated norm)": (rnd(HID, HV * VD, s=(HV * VD) ** -0.5), rnd(HV * VD),
                                dict(norm=(rnd(VD).abs() + 0.5, 1e-5), gate=rnd(HV * VD))),
        "gate_up (add, norm)": (rnd(2 * INTER, HID, s=HID ** -0.5), h,
                                dict(norm=(nw, 1e-6), add=res, add_out=torch.empty_like(h))),
        "down (swiglu, residual)": (rnd(HID, INTER, s=INTER ** -0.5), rnd(2 * INTER), dict(swiglu=True, residual=res)),
        "lm_head (norm)": (rnd(VOCAB, HID, s=HID ** -0.5), h, dict(norm=(nw, 1e-6))),
    }
    return cases, window


def scaling() -> list[dict]:
    """Per-product time against size: a plain product (no prologue or epilogue) of 2048 columns and 1024..32768 rows,
    each kernel (row-owner, split-K at 1024 columns) and cuBLAS, 21 copies back to back in one graph. A line fitted
    to time vs bytes splits each product's time into a fixed part (launch, ramp, tail, the PDL hand-over) and a
    streaming rate."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(HID, generator=gen, device="cuda").to(torch.bfloat16)
    rows = []
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        copies = [(torch.randn(n, HID, generator=gen, device="cuda") * HID ** -0.5).to(torch.bfloat16)
                  for _ in range(LAYERS)]
        mb = n * HID * 2 / 2**20
        row = dict(N=n, K=HID, MB=mb)
        for name, fn in (("rows", lambda c: gemv(c, x, split=0)), ("split1024", lambda c: gemv(c, x, split=1024)),
                         ("cublas", lambda c: F.linear(x, c))):
            row[f"{name}_us"] = bench([lambda c=c: fn(c) for c in copies]) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
        del copies
    for name in ("rows", "split1024", "cublas"):
        t = torch.tensor([r[f"{name}_us"] for r in rows], dtype=torch.float64)
        b = torch.tensor([r["MB"] * 2**20 for r in rows], dtype=torch.float64)
        slope, icpt = torch.linalg.lstsq(torch.stack([b, torch.ones_like(b)], 1), t[:, None]).solution[:, 0].tolist()
        print(f"{name}: fixed {icpt:.2f} us per product, streaming {1e-3 / slope:.0f} GB/s")
    return rows


def fused_gemm_rows(M: int) -> list[dict]:
    """The verify pass's products (``products``' five, their prologues and residual epilogue; no conv, which a tree
    runs in ``tree_conv``) on ``M`` rows: ``fused_gemm`` at the autotuner's pick and at each launch it would time,
    cuBLAS's product alone (the ops fused into ``fused_gemm`` are separate kernels beside it), 21 weight copies in one
    graph. Where the verify pass's ~15 us a product above cuBLAS goes: the launch, or the kernel."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    rows = []
    for name, (w, _, kw) in products()[0].items():
        N, K = w.shape
        kw = {k: v for k, v in kw.items() if k != "conv"}
        x = rnd(M, 2 * K if kw.get("swiglu") else K)
        if "gate" in kw:
            kw["gate"] = rnd(M, K)
        if "add" in kw:
            kw["add"], kw["add_out"] = rnd(M, K), torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        if "residual" in kw:
            kw["residual"] = rnd(M, N)
        want = ref.fused_gemm_ref(w, x, **kw).float()
        err = ((fg.fused_gemm(w, x, **kw).float() - want).norm() / want.norm()).item()
        copies = [w] + [w.clone() for _ in range(LAYERS - 1)]
        rhs = x[:, :K]
        mb = w.numel() * w.element_size() / 2**20
        row = dict(name=name.replace(", conv", ""), M=M, N=N, K=K, MB=mb, rel_err=err,
                   cublas_us=bench([lambda c=c: F.linear(rhs, c) for c in copies]) * 1e3,
                   tuned_us=bench([lambda c=c: fg.fused_gemm(c, x, **kw) for c in copies]) * 1e3, launches={})
        # the launches the autotuner would time (those that fit, else its one small launch)
        for cfg in fg._prune(fg._configs(), dict(x=x, K=K), MP=max(16, triton.next_power_of_2(M)),
                             PRO=_kinds(**kw)[0], HD=kw["norm"][0].numel() if "gate" in kw else 1):
            launch = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            label = " ".join(f"{k}={v}" for k, v in launch.items())
            try:
                row["launches"][label] = bench([lambda c=c: fg.fused_gemm(c, x, **kw, config=launch)
                                                for c in copies]) * 1e3
            except triton.runtime.errors.OutOfResources as e:      # the shared-memory estimate let it through
                row["launches"][label] = f"out of resources: {e}"
        timed = {k: v for k, v in row["launches"].items() if isinstance(v, float)}
        row["best"] = min(timed, key=timed.get) if timed else None
        row["best_us"] = timed[row["best"]] if timed else None
        for k in ("cublas", "tuned", "best"):
            us = row[f"{k}_us"]
            row[f"{k}_GBps"] = None if us is None else mb * 2**20 / us / 1e3
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
        del copies
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scaling", action="store_true", help="only the time-vs-size line of plain products")
    ap.add_argument("--configs", action="store_true", help="also each row-owner launch shape")
    ap.add_argument("--fused-gemm", type=int, metavar="ROWS", help="only the verify pass's products on ROWS rows")
    args = ap.parse_args()
    if args.fused_gemm:
        rows = fused_gemm_rows(args.fused_gemm)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"bench_fused_gemm_{args.fused_gemm}.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows), f, indent=1)
        print(f"\n| product, {args.fused_gemm} rows | MB | cuBLAS us (GB/s) | fused, autotuned us (GB/s) | fused, best "
              "listed launch us (GB/s) | its launch |\n|---|---|---|---|---|---|")
        for r in rows:
            cell = lambda k: "-" if r[f"{k}_us"] is None else f"{r[f'{k}_us']:.1f} ({r[f'{k}_GBps']:.0f})"  # noqa: E731
            print(f"| {r['name']} | {r['MB']:.1f} | {cell('cublas')} | {cell('tuned')} | {cell('best')} | {r['best']} |")
        return
    if args.scaling:
        out = dict(device=torch.cuda.get_device_name(), scaling=scaling())
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_gemv_scaling.json"), "w") as f:
                json.dump(out, f, indent=1)
        return
    cases, window = products()
    rows = []
    for name, (w, x, kw) in cases.items():
        rows.append(measure(name, w, x, kw, window, args.configs))
        print(json.dumps(rows[-1]), flush=True)
    configs = {f"{k} -> {v}" for tuned in (_tuned_kernel, _tuned_split) for k, v in tuned.cache.items()}
    layer = {m: sum(r[f"{m}_us"] for r in rows if not r["name"].startswith("lm_head"))
             for m in ("fused", "fused_no_pdl", "rows", "cublas", *(f"split{c}" for c in SPLITS))}
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows,
               layer_us=layer, tuned_configs=sorted(configs))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gemv.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{out['device']}, triton {triton.__version__}; per product, over 21 weight copies in one CUDA graph")
    print("\n| product | N x K | MB | fused us | fused GB/s | fused, no PDL us | row-owner kernel us | "
          + " | ".join(f"split-K {c} us" for c in SPLITS) + " | cuBLAS us (product only) | cuBLAS GB/s | rel err |")
    print("|---" * (9 + len(SPLITS)) + "|")
    for r in rows:
        print(f"| {r['name']} | {r['N']} x {r['K']} | {r['MB']:.1f} | {r['fused_us']:.1f} "
              f"| {r['fused_GBps']:.0f} | {r['fused_no_pdl_us']:.1f} | {r['rows_us']:.1f} | "
              + " | ".join(f"{r[f'split{c}_us']:.1f}" for c in SPLITS)
              + f" | {r['cublas_us']:.1f} | {r['cublas_GBps']:.0f} | {r['rel_err']:.1e} |")
    print("one layer's four products: " + ", ".join(f"{m} {t:.1f} us (x21: {21 * t / 1e3:.3f} ms)"
                                                     for m, t in layer.items()))
    for c in sorted(configs):
        print("tuned", c)
    for r in rows:
        for name, t in r["row_configs_us"].items():
            print(f"{r['name']}: {name}: {t:.1f} us")


def measure(name: str, w: torch.Tensor, x: torch.Tensor, kw: dict, window: torch.Tensor,
            row_configs: bool = False) -> dict:
    """Check the fused product against ``gemv_ref``, then time it (with and without PDL) and cuBLAS's bare product
    over 21 copies of ``w``; with ``row_configs`` the row-owner kernel at each launch shape it is tuned over too."""
    saved = window.clone()
    y = gemv(w, x, **kw)
    window_k = window.clone()
    window.copy_(saved)
    want = ref.gemv_ref(w, x, **kw)
    err = ((y.float() - want.float()).norm() / want.float().norm()).item()
    if "conv" in kw:
        err = max(err, ((window_k.float() - window.float()).norm() / window.float().norm()).item())
    rhs = x[:w.shape[1]]
    copies = [w] + [w.clone() for _ in range(LAYERS - 1)]
    t_fused = bench([lambda c=c: gemv(c, x, **kw) for c in copies])
    with tuning.using(pdl=False):          # the same chain, each kernel waiting for the previous one to end
        t_no_pdl = bench([lambda c=c: gemv(c, x, **kw) for c in copies])
    t_rows = bench([lambda c=c: gemv(c, x, **kw, split=0) for c in copies])   # the row-owner kernel (no split-K)
    t_split = {f"split{cols}_us": bench([lambda c=c: gemv(c, x, **kw, split=cols) for c in copies]) * 1e3
               for cols in SPLITS}
    t_cublas = bench([lambda c=c: F.linear(rhs, c) for c in copies])
    t_configs = {}
    for cfg in (_configs() if row_configs else []):
        meta = dict(cfg.kwargs, num_warps=cfg.num_warps)
        t_configs["rows " + " ".join(f"{k}={v}" for k, v in meta.items())] = bench(
            [lambda c=c: gemv(c, x, **kw, split=0, config=meta) for c in copies]) * 1e3
    nbytes = w.numel() * w.element_size()
    return dict(name=name, N=w.shape[0], K=w.shape[1], MB=nbytes / 2**20, fused_us=t_fused * 1e3,
                fused_no_pdl_us=t_no_pdl * 1e3, rows_us=t_rows * 1e3, **t_split, cublas_us=t_cublas * 1e3,
                fused_GBps=nbytes / t_fused / 1e6, cublas_GBps=nbytes / t_cublas / 1e6, rel_err=err,
                row_configs_us=t_configs)


if __name__ == "__main__":
    main()
