"""GPU: where a SpecLA decode step's wall time goes on the device, without the profiler's host overhead.

Every CUDA-graph replay and every ``specla.*`` phase of the decoding loop (``specla_hf.loop.decode``) gets a pair of CUDA
events; a graph replay's span is GPU time (the graph's kernels and the gaps between them, which the host cannot
cause), and what lies between two replays is the eager kernels launched there (argmax, gathers, copies: a few µs)
plus the time the GPU waited for the host to queue the next replay. Reported per step: the wall time, the time in
graph replays, the gaps by the phase whose replay they precede, and each phase's GPU span. The events add ~5 µs of
host time per replay; whole calls timed with and without them are reported beside (``call_ms_per_step*``).

Runs greedy SpecLA tree decoding (the defaults) on the trained target inflated to the 1.3B shape, bf16, on real
prompts; ``--host-loop`` times decoding's host loop beside the device loop (the default for this setting) on the same
prompts, ``--loops`` other generate() keywords. ``--hybrid 0.8b`` (or ``9b``) runs a random-weight Qwen3.5 of that
shape with its MTP head instead, drafting ``hybrid_bench``'s oracle drafts at ``--noise`` over a ``--draft-vocab``
vocabulary.

    source .device/prelude.sh && export PYTHONPATH=$PWD/kernels:$PYTHONPATH && \\
        python benchmarks/step_timeline.py --eval-dir .device/eval --out $OUT/timeline
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import specla_hf  # noqa: F401  (registers the drafter classes)
from specla_hf.loop import decode, stopping
from specla_hf.app.loading import load_models
from specla_hf.drafters.eagle import EagleDrafter
from specla_hf.training.inflate import inflate_pair

SETS = {"mt_bench": ("mt_bench.jsonl", lambda r: r["turns"][0]),
        "humaneval": ("humaneval.jsonl", lambda r: r["prompt"]),
        "alpaca": ("alpaca_eval_80.jsonl", lambda r: r["instruction"])}


class Timeline:
    """CUDA events around graph replays and loop phases, in the order the host queued them."""

    def __init__(self):
        self.marks: list[tuple[str, str, torch.cuda.Event]] = []     # (kind, label, event)
        self.phase = "outside"

    def _mark(self, kind: str, label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((kind, label, e))

    @contextlib.contextmanager
    def record_function(self, name: str):
        outer, self.phase = self.phase, name
        self._mark("enter", name)
        try:
            yield
        finally:
            self._mark("exit", name)
            self.phase = outer

    @contextlib.contextmanager
    def active(self):
        replay, timeline = torch.cuda.CUDAGraph.replay, self

        def timed_replay(graph):
            timeline._mark("graph_start", timeline.phase)
            replay(graph)
            timeline._mark("graph_end", timeline.phase)
        with mock.patch.object(torch.cuda.CUDAGraph, "replay", timed_replay), \
                mock.patch.object(decode, "record_function", self.record_function), \
                mock.patch.object(stopping, "record_function", self.record_function):
            yield self

    def totals(self) -> dict:
        """Milliseconds summed over the decoding loop of the call(s) recorded (from the first verify phase on: the
        prompt pass and the first proposal before it are left out)."""
        torch.cuda.synchronize()
        first = next(i for i, (kind, label, _) in enumerate(self.marks) if (kind, label) == ("enter", "specla.verify"))
        t0 = self.marks[first][2]
        t = [(kind, label, t0.elapsed_time(e)) for kind, label, e in self.marks[first:]]
        out = {"wall": t[-1][2], "in_graphs": 0.0, "gaps": collections.Counter(), "spans": collections.Counter()}
        opened, last_end, start = {}, None, 0.0
        for kind, label, ms in t:
            if kind == "graph_start":
                if last_end is not None:
                    out["gaps"][label] += ms - last_end
                start = ms
            elif kind == "graph_end":
                out["in_graphs"] += ms - start
                last_end = ms
            elif kind == "enter":
                opened[label] = ms
            elif label in opened:
                out["spans"][label] += ms - opened.pop(label)
        self.marks = []
        return out


def summary(totals: list[dict], steps: int) -> dict:
    """Per-step means of ``Timeline.totals`` over prompts."""
    per = lambda x: round(x / steps, 4)                     # noqa: E731
    wall, in_graphs = sum(t["wall"] for t in totals), sum(t["in_graphs"] for t in totals)
    gaps, spans = sum((t["gaps"] for t in totals), collections.Counter()), sum((t["spans"] for t in totals),
                                                                                collections.Counter())
    return {"steps": steps, "wall_ms_per_step": per(wall), "in_graphs_ms_per_step": per(in_graphs),
            "between_graphs_ms_per_step": per(wall - in_graphs),
            "gaps_before_phase_ms_per_step": {k: per(v) for k, v in gaps.most_common()},
            "phase_gpu_span_ms_per_step": {k: per(v) for k, v in spans.items()}}


def load_prompts(eval_dir: Path, sets: list[str], per_set: int) -> dict[str, list[str]]:
    out = {}
    for name in sets:
        file, field = SETS[name]
        rows = [json.loads(line) for line in (eval_dir / file).read_text().splitlines() if line.strip()]
        out[name] = [field(r) for r in rows[:per_set]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-dir", type=Path, required=True)
    ap.add_argument("--sets", default="humaneval,mt_bench")
    ap.add_argument("--per-set", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--loops", default="", help="comma-separated generate() keyword sets to compare, as "
                    "key=value;key=value (empty: the defaults only)")
    ap.add_argument("--host-loop", action="store_true", help="also time the host loop (each step's acceptance "
                    "read back and walked on the host before the next proposal is queued)")
    ap.add_argument("--hybrid", choices=["0.8b", "9b"], help="a random-weight Qwen3.5 of this shape and its MTP head "
                    "with hybrid_bench's oracle drafts (default: the 1.3B GDN pair)")
    ap.add_argument("--noise", type=float, default=3.5, help="--hybrid: the oracle's noise scale")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="--hybrid: the MTP head's draft vocabulary")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    expect = lambda ids: None                                  # noqa: E731  (the oracle's successors, --hybrid)
    oracle_context = contextlib.ExitStack()
    if args.hybrid:
        import hybrid_bench
        from transformers import AutoTokenizer
        big, drafters = hybrid_bench.random_pair(args.hybrid, torch.bfloat16, "cuda")
        drafter, tok = drafters["mtp"], AutoTokenizer.from_pretrained(hybrid_bench.CHECKPOINTS / "specla-qwen35-tiny")
        oracle = oracle_context.enter_context(hybrid_bench.OracleDrafts(big.config.vocab_size, big.device))
        oracle.scale.fill_(args.noise)
        continuations = {}

        def expect(ids):
            key = tuple(ids[0].tolist())
            if key not in continuations:
                continuations[key] = big.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                  max_new_tokens=args.max_new_tokens, specla=True)
            oracle.expect(continuations[key])
    else:
        models = load_models(device="cuda", dtype="bfloat16")
        big, drafter = inflate_pair(models.target, models.drafter)
        tok = models.tokenizer
    big.generation_config.eos_token_id = None                  # fixed-length runs
    prompts = load_prompts(args.eval_dir, args.sets.split(","), args.per_set)
    variants = {"default": {}}
    for spec in filter(None, args.loops.split(",")):
        variants[spec] = {k: json.loads(v) for k, v in (kv.split("=") for kv in spec.split(";"))}
    if args.host_loop:
        variants["host loop"] = {"host_loop": True}
    # a random target's oracle acceptance can be low: time speculative steps, not the autoregressive fallback
    fallback = {"autoregressive_fallback": False} if args.hybrid else {}
    res = {"model": args.hybrid or "gdn-1.3b", "noise": args.noise if args.hybrid else None,
           "draft_vocab": args.draft_vocab if args.hybrid else None, "variants": {}}

    def generate(ids, kw):
        kw = dict(kw)
        # the host loop: plain greedy with every step's acceptance walked on the host (decoding's general loop)
        host_loop = kw.pop("host_loop", False)
        expect(ids)
        with mock.patch.object(EagleDrafter, "catches_up_on_device", False) if host_loop else contextlib.nullcontext():
            big.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         assistant_model=drafter, tree=True, confidence_threshold=0.0,
                         **{"do_sample": False, **fallback, **kw})
        return big.specla_stats
    if args.hybrid and args.draft_vocab:
        every = [tok(t, return_tensors="pt").input_ids[:, :256].cuda() for texts in prompts.values() for t in texts]
        for ids in every:
            expect(ids)
        oracle.restrict(drafter, list(continuations.values()), args.draft_vocab)
    for texts in prompts.values():                            # compile, autotune, capture (every tree depth)
        for kw in variants.values():
            generate(tok(texts[0], return_tensors="pt").input_ids[:, :256].cuda(), kw)
    for set_name, texts in prompts.items():
        for name, kw in variants.items():
            timeline, totals, plain, timed, steps, tau = Timeline(), [], [], [], 0, []
            for text in texts:
                ids = tok(text, return_tensors="pt").input_ids[:, :256].cuda()
                torch.cuda.synchronize()
                t = time.perf_counter()
                stats = generate(ids, kw)
                torch.cuda.synchronize()
                plain.append((time.perf_counter() - t) / stats.steps * 1e3)
                t = time.perf_counter()
                with timeline.active():
                    stats = generate(ids, kw)
                torch.cuda.synchronize()
                timed.append((time.perf_counter() - t) / stats.steps * 1e3)
                totals.append(timeline.totals())
                steps += stats.steps
                tau.append(stats.tau)
            result = summary(totals, steps)
            # whole calls (prompt pass included), with and without the events: what the events cost
            result.update(call_ms_per_step=round(statistics.mean(plain), 4),
                          call_ms_per_step_with_events=round(statistics.mean(timed), 4), tau=statistics.mean(tau))
            res["variants"].setdefault(name, {})[set_name] = result
            print(set_name, name, json.dumps(result), flush=True)
            (args.out / "step_timeline.json").write_text(json.dumps(res, indent=1))
    oracle_context.close()


if __name__ == "__main__":
    main()
