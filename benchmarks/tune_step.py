"""GPU: choose the one-token step's GEMV launch shapes by timing whole steps, and write them where ``gemv`` reads them.

Triton's autotuner (``gemv._tuned_kernel`` / ``_tuned_split``) times each product alone, its weights flushed from L2:
its picks differ from run to run and from what is best among the step's other kernels (on the H200 in_proj's pick
took 21.3 us in a chain of its own copies, the best of the same candidates 13.3). Here each large product of the
one-token step (at the 1.3B GDN shape: in_proj, o_proj, gate_up, down, lm_head; at a Qwen3.5 shape also the
attention layers' projections) is tried in every launch ``gemv.launch_candidates`` lists (row-owner shapes, split-K at
256, 512 and 1024 columns) inside a CUDA graph of the whole step, the other products at their current choice
(coordinate descent: a first round over every candidate, then the best few of each product again, ``--rounds`` in
all); a candidate's time is the median over its rounds of the median of several groups of back-to-back replays. Last,
the chosen table and the autotuner are timed alternately.

``--shape``: ``gdn-1.3b`` (the embedded target inflated to fla's 1.3B GDN shape) or a random-weight Qwen3.5 of
``benchmarks/hybrid_bench.py``'s shapes (``qwen3.5-0.8b``, ``qwen3.5-9b``: weight values do not change a GEMV's
time). Before timing, ``--compile-workers`` processes compile every candidate (a cold machine would otherwise spend
most of the run compiling them one at a time); each builds the model cut to its first four layers, which hold every
product shape. Writes ``--out`` (the table, every candidate's times, the before/after step times); ``--install``
also puts the table into ``tuning.STEP_CONFIGS_FILE`` in place of the one tuned before for the same GPU and shape,
keeping the others (commit it to ship it).

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/tune_step.py --shape qwen3.5-9b --out $OUT/gemv_step_configs_9b.json --install
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

import specla_hf  # noqa: F401
from hybrid_bench import SHAPES
from specla_hf.app.loading import load_models
from specla_hf.models.fla_gdn import GDNRunner
from specla_hf.models.qwen3_5 import HybridRunner
from specla_hf.runtime.graphs import StaticCall
from specla_hf.training.inflate import inflate_pair
from specla_kernels import gemv, tuning

MODEL_SHAPES = {"gdn-1.3b": "the embedded target inflated to the 1.3B GDN shape, bf16",
                **{f"qwen3.5-{size}": f"a random-weight Qwen3.5 of hybrid_bench's {size} shape, bf16" for size in SHAPES}}
COMPILE_LAYERS = 4        # a Qwen3.5 cut to its first layers for the compile workers: three GDN, one attention
NAMES = {(gemv.NORM.value, gemv.CONV.value): "in_proj", (gemv.GATED_NORM.value, gemv.NO_EPILOGUE.value): "o_proj",
         (gemv.NORM_ADD.value, gemv.NO_EPILOGUE.value): "gate_up", (gemv.SWIGLU.value, gemv.RESIDUAL.value): "down",
         (gemv.NORM.value, gemv.NO_EPILOGUE.value): "norm (lm_head, attention qkv)",
         (gemv.PLAIN.value, gemv.NO_EPILOGUE.value): "plain (attention o_proj)"}


def name(key: tuple) -> str:
    return f"{NAMES.get(key[4:6], '?')} {key[2]}x{key[3]}"


class Step:
    """The one-token step of ``shape``'s model (a Qwen3.5 cut to ``layers`` if given) on a fresh cache, to capture
    and time."""

    def __init__(self, shape: str, layers: int | None = None):
        if shape == "gdn-1.3b":
            models = load_models(device="cuda", dtype="bfloat16")
            self.runner = GDNRunner(inflate_pair(models.target, models.drafter)[0], cuda_graphs=False)
        else:
            config = Qwen3_5TextConfig(**{**SHAPES[shape.removeprefix("qwen3.5-")],
                                          **({"num_hidden_layers": layers} if layers else {})})
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)      # built in bf16: a 9B model's fp32 copy would not be needed
            try:
                with torch.device("cuda"):
                    model = Qwen3_5ForCausalLM(config).eval()
            finally:
                torch.set_default_dtype(default)
            self.runner = HybridRunner(model)      # its fixed-capacity cache; graphs captured here, one per candidate
        if not self.runner.fused_step:
            raise SystemExit("this model's one-token step does not take the fused GEMV path: nothing to tune")
        self.cache = self.runner.new_cache(1, max_length=64)
        self.token = torch.tensor([[7]], device="cuda")

    def run(self) -> torch.Tensor:
        return self.runner._decode_step(self.token, self.cache)

    def rewind(self) -> None:
        """Attention layers append the token at their length, which each step advances: back to the start, so that
        replays never run past the buffers."""
        for layer in self.cache.others:
            layer.length.zero_()

    def products(self) -> dict[tuple, tuple]:
        """The large (autotuned) products one eager step launches: key -> its ``gemv`` arguments, in launch order."""
        found, plain = {}, gemv.gemv

        def recording(weight, x, **fused):
            if weight.numel() * weight.element_size() >= gemv.TUNE_BYTES:
                found.setdefault(gemv.product_key(weight, x, **fused), (weight, x, fused))
            return plain(weight, x, **fused)
        gemv.gemv = recording
        try:
            with tuning.using(gemv_step_configs={}):
                self.run()
                self.rewind()
        finally:
            gemv.gemv = plain
        return found

    def ms(self, groups: int, reps: int) -> float:
        """The whole step captured under the active tuning's ``gemv_step_configs``: median over ``groups`` of the mean
        replay time of ``reps`` back-to-back replays (CUDA events)."""
        self.rewind()
        graph = StaticCall(self.run)
        times = []
        for _ in range(groups):
            self.rewind()
            for _ in range(2):
                graph.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / reps)
        del graph
        return statistics.median(times)


def compile_share(shape: str, share: int, shares: int) -> tuple[int, float]:
    """A compile worker: launch every ``shares``-th candidate of each product from the ``share``-th on once, which
    compiles it into Triton's cache for the timing process. Returns (launches, seconds)."""
    t0 = time.perf_counter()
    step = Step(shape, layers=COMPILE_LAYERS)
    launched = 0
    for weight, x, fused in step.products().values():
        for cand in gemv.launch_candidates(weight, x, **fused)[share::shares]:
            launch = dict(cand)
            gemv.gemv(weight, x, **fused, split=launch.pop("split"), config=launch)
            launched += 1
    torch.cuda.synchronize()
    return launched, time.perf_counter() - t0


def describe(launch: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.items())


def install(result: dict) -> None:
    """Put ``result`` into ``tuning.STEP_CONFIGS_FILE`` in place of the run for the same GPU and shape."""
    path = tuning.STEP_CONFIGS_FILE
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs = [r for r in runs if (r["device"], r["shape"]) != (result["device"], result["shape"])] + [result]
    path.write_text(json.dumps({"runs": runs}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(MODEL_SHAPES), default="gdn-1.3b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--install", action="store_true", help=f"also put the table into {tuning.STEP_CONFIGS_FILE}")
    ap.add_argument("--rounds", type=int, default=3, help="the first over every candidate, the others over the best")
    ap.add_argument("--keep", type=int, default=3, help="candidates per product timed again after the first round")
    ap.add_argument("--compare", type=int, default=4, help="alternating rounds of table vs autotuner at the end")
    ap.add_argument("--group-ms", type=float, default=20.0, help="replays a timed group holds, in step time")
    ap.add_argument("--compile-workers", type=int, default=8, help="processes compiling the candidates first (0: none)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    log = lambda *m: print(f"[{time.perf_counter() - t0:6.1f}s]", *m, flush=True)  # noqa: E731
    if args.compile_workers:
        with ProcessPoolExecutor(args.compile_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(compile_share, [args.shape] * args.compile_workers, range(args.compile_workers),
                                 [args.compile_workers] * args.compile_workers))
        log(f"compiled {sum(n for n, _ in done)} launches in {args.compile_workers} workers "
            f"(slowest {max(s for _, s in done):.0f} s)")
    step = Step(args.shape)
    products = {key: gemv.launch_candidates(weight, x, **fused) for key, (weight, x, fused) in step.products().items()}
    log("products:", {name(k): len(c) for k, c in products.items()})
    with tuning.using(gemv_step_configs={}):              # start from the autotuner's picks
        step.ms(1, 3)
        reps = max(3, round(args.group_ms / step.ms(3, 3)))
        autotuned = step.ms(5, reps)
    log(f"step with the autotuner's picks: {autotuned:.4f} ms ({reps} replays a group)")
    times: dict[tuple, dict[str, list[float]]] = {k: {} for k in products}
    chosen: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for key, cands in products.items():
            if rnd:
                cands = sorted(cands, key=lambda c: statistics.median(times[key][describe(c)]))[:args.keep]
            for cand in cands:
                with tuning.using(gemv_step_configs={**chosen, key: cand}):
                    times[key].setdefault(describe(cand), []).append(step.ms(5, reps))
            chosen[key] = min(cands, key=lambda c: statistics.median(times[key][describe(c)]))
            best = statistics.median(times[key][describe(chosen[key])])
            log(f"round {rnd + 1} {name(key)}: {describe(chosen[key])} -> step {best:.4f} ms")
    compare = {"autotuner": [], "tuned": []}
    for r in range(args.compare):
        for which in (["autotuner", "tuned"] if r % 2 == 0 else ["tuned", "autotuner"]):
            with tuning.using(gemv_step_configs={} if which == "autotuner" else dict(chosen)):
                compare[which].append(step.ms(5, reps))
    log("step ms, alternating:", {k: [round(t, 4) for t in v] for k, v in compare.items()})
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "shape": args.shape, "model": MODEL_SHAPES[args.shape],
        "step_ms_first_autotuned": autotuned, "step_ms": compare,
        "products": [{"name": name(k), "device": k[0], "dtype": k[1], "N": k[2], "K": k[3], "PRO": k[4],
                      "EPI": k[5], "KC": k[6], "launch": chosen[k], "step_ms_by_candidate": times[k]} for k in products],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.install:
        install(result)
    print("| product | launch | step ms |")
    for k in products:
        print(f"| {name(k)} | {describe(chosen[k])} | {statistics.median(times[k][describe(chosen[k])]):.4f} |")
    print(f"| whole step | autotuner {statistics.median(compare['autotuner']):.4f} ms | "
          f"tuned {statistics.median(compare['tuned']):.4f} ms |")


if __name__ == "__main__":
    main()
