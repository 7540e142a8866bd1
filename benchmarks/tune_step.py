"""GPU: choose the one-token step's GEMV launch shapes by timing whole steps, and write them where ``gemv`` reads them.

Triton's autotuner (``gemv._tuned_kernel`` / ``_tuned_split``) times each product alone, its weights flushed from L2:
its picks differ from run to run and from what is best among the step's other kernels (on the H200 in_proj's pick
took 21.3 us in a chain of its own copies, the best of the same candidates 13.3). Here each large product of the
one-token step (at the 1.3B shape: in_proj, o_proj, gate_up, down, lm_head) is tried in every launch
``gemv.launch_candidates`` lists (row-owner shapes, split-K at 256, 512 and 1024 columns) inside a CUDA graph of the
whole step, the other products at their current choice (coordinate descent: a first round over every candidate,
then the best few of each product again, ``--rounds`` in all); a candidate's time is the median over its rounds of the median of several
groups of back-to-back replays. Last, the chosen table and the autotuner are timed alternately. Writes ``--out``
(the table, every candidate's times, the before/after step times); ``--install`` also writes the table to
``tuning.STEP_CONFIGS_FILE``, which later processes load (commit it to ship it).

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/tune_step.py --out $OUT/gemv_step_configs.json --install
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

import specla_hf  # noqa: F401
from specla_hf.runtime.graphs import StaticCall
from specla_hf.app.loading import load_models
from specla_hf.models.fla_gdn import GDNRunner
from specla_hf.training.inflate import inflate_pair
from specla_kernels import gemv, tuning

NAMES = {(gemv.NORM.value, gemv.CONV.value): "in_proj", (gemv.GATED_NORM.value, gemv.NO_EPILOGUE.value): "o_proj",
         (gemv.NORM_ADD.value, gemv.NO_EPILOGUE.value): "gate_up", (gemv.SWIGLU.value, gemv.RESIDUAL.value): "down",
         (gemv.NORM.value, gemv.NO_EPILOGUE.value): "lm_head"}


def step_products(runner: GDNRunner, cache, token: torch.Tensor) -> dict[tuple, list[dict]]:
    """The large (autotuned) products one eager step launches: key -> its launch candidates, in launch order."""
    found, plain = {}, gemv.gemv

    def recording(weight, x, **fused):
        if weight.numel() * weight.element_size() >= gemv.TUNE_BYTES:
            key = gemv.product_key(weight, x, **fused)
            found.setdefault(key, gemv.launch_candidates(weight, x, **fused))
        return plain(weight, x, **fused)
    gemv.gemv = recording
    try:
        runner._decode_step(token, cache)
    finally:
        gemv.gemv = plain
    return found


def step_ms(runner: GDNRunner, cache, token: torch.Tensor, groups: int = 5, reps: int = 20) -> float:
    """One whole step captured under the active tuning's ``gemv_step_configs``: median over ``groups`` of the mean replay
    time of ``reps`` back-to-back replays (CUDA events)."""
    graph = StaticCall(lambda: runner._decode_step(token, cache))
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(groups):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    del graph
    return statistics.median(times)


def describe(launch: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--install", action="store_true", help=f"also write the table to {tuning.STEP_CONFIGS_FILE}")
    ap.add_argument("--rounds", type=int, default=3, help="the first over every candidate, the others over the best")
    ap.add_argument("--keep", type=int, default=3, help="candidates per product timed again after the first round")
    ap.add_argument("--compare", type=int, default=4, help="alternating rounds of table vs autotuner at the end")
    args = ap.parse_args()
    t0 = time.perf_counter()
    models = load_models(device="cuda", dtype="bfloat16")
    big, _ = inflate_pair(models.target, models.drafter)
    runner = GDNRunner(big, cuda_graphs=False)          # graphs captured here, one per candidate
    if not runner.fused_step:
        raise SystemExit("this model's one-token step does not take the fused GEMV path: nothing to tune")
    cache = runner.new_cache(1)
    token = torch.tensor([[7]], device="cuda")
    with tuning.using(gemv_step_configs={}):              # start from the autotuner's picks
        products = step_products(runner, cache, token)
    log = lambda *m: print(f"[{time.perf_counter() - t0:6.1f}s]", *m, flush=True)  # noqa: E731
    log("products:", {NAMES.get(k[4:6], k): len(c) for k, c in products.items()})
    with tuning.using(gemv_step_configs={}):
        autotuned = step_ms(runner, cache, token)
    log(f"step with the autotuner's picks: {autotuned:.4f} ms")
    times: dict[tuple, dict[str, list[float]]] = {k: {} for k in products}
    chosen: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for key, cands in products.items():
            if rnd:
                cands = sorted(cands, key=lambda c: statistics.median(times[key][describe(c)]))[:args.keep]
            for cand in cands:
                with tuning.using(gemv_step_configs={**chosen, key: cand}):
                    times[key].setdefault(describe(cand), []).append(step_ms(runner, cache, token))
            chosen[key] = min(cands, key=lambda c: statistics.median(times[key][describe(c)]))
            best = statistics.median(times[key][describe(chosen[key])])
            log(f"round {rnd + 1} {NAMES.get(key[4:6], key)}: {describe(chosen[key])} -> step {best:.4f} ms")
    compare = {"autotuner": [], "tuned": []}
    for r in range(args.compare):
        for name in (["autotuner", "tuned"] if r % 2 == 0 else ["tuned", "autotuner"]):
            with tuning.using(gemv_step_configs={} if name == "autotuner" else dict(chosen)):
                compare[name].append(step_ms(runner, cache, token))
    log("step ms, alternating:", {k: [round(t, 4) for t in v] for k, v in compare.items()})
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "model": "the embedded target inflated to the 1.3B shape, bf16",
        "step_ms_first_autotuned": autotuned, "step_ms": compare,
        "products": [{"name": NAMES.get(k[4:6], "?"), "device": k[0], "dtype": k[1], "N": k[2], "K": k[3], "PRO": k[4],
                      "EPI": k[5], "KC": k[6], "launch": chosen[k], "step_ms_by_candidate": times[k]} for k in products],
    }
    text = json.dumps(result, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.install:
        tuning.STEP_CONFIGS_FILE.write_text(text)
    print("| product | launch | step ms |")
    for k in products:
        print(f"| {NAMES.get(k[4:6], '?')} | {describe(chosen[k])} | "
              f"{statistics.median(times[k][describe(chosen[k])]):.4f} |")
    print(f"| whole step | autotuner {statistics.median(compare['autotuner']):.4f} ms | "
          f"tuned {statistics.median(compare['tuned']):.4f} ms |")


if __name__ == "__main__":
    main()
