"""GPU microbenchmark of the hybrids' masked attention: ``ops.masked_attention``'s kernel against each SDPA backend
on the calls a Qwen3.5 verify pass and MTP head make (bf16, batch 1, a graphed cache of 2048 slots, a committed prefix
of ``--prefix`` positions, then ``T`` tree nodes each seeing its ancestors). It checks each backend against the
reference, times each as a CUDA graph replay (median of ``triton.testing.do_bench``) and writes
``$OUT/bench_masked_attention.json``; a table last.

    python benchmarks/bench_masked_attention.py [--prefix 300] [--slots 2048]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from specla_kernels import ops
from specla_kernels import reference as ref

# (name, query heads, key/value heads, head dim): Qwen3.5-0.8B and -9B's attention layers
SHAPES = [("0.8b", 8, 2, 256), ("9b", 16, 4, 256)]
SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def tree_mask(T: int, prefix: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)])[None]
    seen = torch.zeros(1, T, slots, dtype=torch.bool)
    seen[:, :, :prefix] = True
    seen[:, :, prefix:prefix + T] = ref.tree_ancestors(parents)[0]
    mask = torch.zeros(1, 1, T, slots, dtype=torch.bfloat16)
    return mask.masked_fill_(~seen[:, None], torch.finfo(torch.bfloat16).min).cuda()


def graphed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=200) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--slots", type=int, default=2048)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    records = []
    for name, H, KV, D in SHAPES:
        k, v = (torch.randn(1, KV, args.slots, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        for T in (1, 8, 16, 32, 64):
            q = torch.randn(1, T, H, D, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
            mask = tree_mask(T, args.prefix, args.slots, gen)
            want = ref.masked_attention_ref(q, k, v, mask, D ** -0.5)
            calls = {"specla": lambda: ops.masked_attention(q, k, v, mask, D ** -0.5)}
            for backend, choice in SDPA.items():
                def call(choice=choice):
                    with sdpa_kernel([choice]):
                        return F.scaled_dot_product_attention(q, k, v, mask, scale=D ** -0.5, enable_gqa=True)
                calls[backend] = call
            for backend, call in calls.items():
                try:
                    out = call()
                    out = out if backend == "specla" else out.transpose(1, 2)
                    err = (out.float() - want.float()).abs().max().item()
                    us = graphed_us(call)
                except RuntimeError as e:           # a backend that does not take this call
                    err, us = None, None
                    print(f"{name} T={T} {backend}: {str(e).splitlines()[0][:120]}")
                records.append(dict(shape=name, heads=H, kv_heads=KV, head_dim=D, nodes=T, prefix=args.prefix,
                                    slots=args.slots, backend=backend, us=us, max_abs_err=err))
                print(f"{name} T={T:3d} {backend:10s} " + ("-" if us is None else f"{us:8.1f} us  err {err:.1e}"),
                      flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "bench_masked_attention.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, indent=1) + "\n")
    backends = list(dict.fromkeys(r["backend"] for r in records))
    print("| shape | nodes | " + " | ".join(f"{b} us" for b in backends) + " |")
    print("|" + "---|" * (2 + len(backends)))
    for key in dict.fromkeys((r["shape"], r["nodes"]) for r in records):
        row = {r["backend"]: r["us"] for r in records if (r["shape"], r["nodes"]) == key}
        print(f"| {key[0]} | {key[1]} | " + " | ".join("-" if row[b] is None else f"{row[b]:.1f}" for b in backends)
              + " |")


if __name__ == "__main__":
    main()
