"""GPU microbenchmark of a draft tree's embedding lookup: aten's lookup (``F.embedding``), an indexing gather
(``weight[ids]``, what the runners use) and ``ops.embed_norm_cat`` (the lookup, two RMSNorms and the concatenation
of a drafter pass's input), at the 1.3B GDN target's vocabulary and width and at Qwen3.5's, bf16. Each is 20 calls
in one CUDA graph; the median of 30 replays, us a call.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/bench_lookup.py $OUT/bench_lookup.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from specla_kernels import ops


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return sorted(times)[len(times) // 2]


def main() -> None:
    rows = []
    for V, H in ((8192, 2048), (248320, 1024), (248320, 4096)):
        table = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        for T in (1, 9, 16, 29, 64):
            ids = torch.randint(0, V, (1, T), device="cuda")
            feature = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            row = dict(V=V, H=H, T=T, embedding_us=bench(lambda: F.embedding(ids, table)),
                       index_us=bench(lambda: table[ids]),
                       embed_norm_cat_us=bench(lambda: ops.embed_norm_cat(table, ids[0], feature, w, 1e-6, w, 1e-6)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
