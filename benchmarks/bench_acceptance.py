"""GPU microbenchmark of a speculative step's tail kernels against their torch form, each as a CUDA graph replay
(median of ``triton.testing.do_bench``): the device acceptance (``greedy_accept``, and ``sample_accept`` of drawn
children, ``siblings`` 4) over trees of 16 and 64 nodes at the 1.3B GDN vocabulary (8192) and Qwen3.5's (248,320),
and the hybrids' attention-layer commit (``ops.commit_kv_``) at the Qwen3.5 0.8B and 9B shapes against the torch
gathers and scatters it replaced (both with a reset of the committed counts before them). The torch form of the
acceptance is the same code with ``ops`` dispatching to the references. Writes ``$OUT/bench_acceptance.json`` (or
``--out``); a table last.

    python benchmarks/bench_acceptance.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import bench_graph  # noqa: E402

from specla_hf.loop.acceptance import greedy_accept, sample_accept  # noqa: E402
from specla_kernels import ops  # noqa: E402
from specla_kernels import reference as ref  # noqa: E402

# (name, attention layers, key/value heads, head dim): Qwen3.5-0.8B and -9B
KV_SHAPES = [("qwen3.5-0.8b", 6, 2, 256), ("qwen3.5-9b", 8, 4, 256)]


def both_ways(fn) -> dict[str, float]:
    """``fn`` timed with the kernels, then with ``ops`` on the torch references."""
    kernels = graphed_us(fn)
    with mock.patch.object(ops, "use_triton", lambda t: False):
        torch_form = graphed_us(fn)
    return dict(kernels_us=kernels, torch_us=torch_form)


def graphed_us(fn) -> float:
    """Microseconds of one CUDA graph replay of ``fn`` (``bench_kernels.bench_graph``)."""
    return bench_graph(fn) * 1e3


def torch_commit_kv(path, length, keys, values, committed) -> None:
    """The attention layers' commit as torch ops, layer by layer (the form ``commit_kv_`` replaced)."""
    P = path.shape[1]
    steps = torch.arange(P, device=path.device)
    for k, v, count in zip(keys, values, committed):
        B, H, _, D = k.shape
        source = (count[:, None] + torch.where(steps < length[:, None], path, steps))[:, None, :, None].expand(B, H, P, D)
        target = (count[:, None] + steps)[:, None, :, None].expand(B, H, P, D)
        for buffer in (k, v):
            buffer.scatter_(2, target, buffer.gather(2, source))
        count.add_(length)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    records, cap = [], 9
    for N in (16, 64):
        parents = torch.tensor([-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen))
                                       for i in range(1, N)])
        ancestors = ref.tree_ancestors(parents[None])[0].cuda()
        parents = parents.cuda()
        for V in (8192, 248320):
            tokens = torch.randint(0, V, (N,), generator=gen).cuda()
            logits = torch.randn(N, V, generator=gen).cuda()
            probs, draft = logits.softmax(-1), (logits + torch.randn(N, V, generator=gen).cuda()).softmax(-1)
            argmax = logits.argmax(-1)
            rows = {"greedy": lambda: greedy_accept(tokens, parents, ancestors, argmax, cap),
                    "sampled, drawn drafts": lambda: sample_accept(tokens, parents, ancestors, probs, cap, draft, 4)}
            for rule, fn in rows.items():
                records.append(dict(op=f"acceptance, {rule}", nodes=N, vocab=V, **both_ways(fn)))
                print(records[-1], flush=True)
    for name, layers, H, D in KV_SHAPES:
        keys, values = ([torch.randn(1, H, 2048, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(layers)]
                        for _ in range(2))
        committed = [torch.full((1,), 300, dtype=torch.long, device="cuda") for _ in range(layers)]
        path = torch.tensor([[0, 1, 3, 6, 10, 15, 15, 15, 15]], device="cuda")
        length = torch.tensor([6], device="cuda")
        start = [c.clone() for c in committed]

        def replay(commit):               # each replay from the same counts (one launch more in both forms)
            def fn():
                torch._foreach_copy_(committed, start)
                commit(path, length, keys, values, committed)
            return fn
        kernel, torch_form = graphed_us(replay(ops.commit_kv_)), graphed_us(replay(torch_commit_kv))
        records.append(dict(op=f"attention commit, {name}", nodes=9, vocab=None, kernels_us=kernel,
                            torch_us=torch_form))
        print(records[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), cap=cap, siblings=4)
    (args.out / "bench_acceptance.json").write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    print("| op | nodes | vocab | kernels us | torch us |\n|---|---|---|---|---|")
    for r in records:
        print(f"| {r['op']} | {r['nodes']} | {r['vocab'] or '-'} | {r['kernels_us']:.1f} | {r['torch_us']:.1f} |")


if __name__ == "__main__":
    main()
