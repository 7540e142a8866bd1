"""``specla``: SpecLA speculative decoding of a Gated DeltaNet model from the command line.

    specla generate "def fib(n):"            stream SpecLA's text, then a stats line on stderr (tokens/s, tau and the
                                             speedup over plain decoding of the same prompt, run right after)
    specla bench [--prompts FILE.jsonl]      plain vs SpecLA on a prompt set (default: a small set in the package)
    specla demo [--port 7860]                the Gradio demo (needs the [demo] extra)

Without --target / --drafter the embedded default models run (see specla_hf.app.loading), on the CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import TYPE_CHECKING

# only what the parser needs: --help and bad flags are answered without importing torch
from specla_hf.app.choices import DTYPE_NAMES, LAYER_SKIP, MTP, ModelError
from specla_hf.drafters.options import CHAIN_DEFAULTS, CPU_CHAIN_THRESHOLD, MAX_TREE_BUDGET, TREE_DEFAULTS

if TYPE_CHECKING:
    from specla_hf.app.loading import Models
    from specla_hf.app.runs import Comparison, DecodeSettings


class UsageError(Exception):
    """Bad input from the user; reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (unknown option, bad value) as one line like every other bad input, not usage + line."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, ModelError) as e:
        print(f"specla: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specla", description=__doc__.split("\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,demo}")
    gen = sub.add_parser("generate", help="generate from one prompt, with a stats line")
    gen.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or nothing: read it from stdin)")
    _add_model_and_decoding_arguments(gen, new_tokens=128)
    gen.set_defaults(run=cmd_generate)
    bench = sub.add_parser("bench", help="plain vs SpecLA decoding on a prompt set")
    bench.add_argument("--prompts", help="JSON-lines prompt file (MT-Bench, HumanEval, AlpacaEval layouts; default: "
                                         "a few MT-Bench and HumanEval prompts shipped in the package)")
    bench.add_argument("--limit", type=POSITIVE_INT, default=8, help="first N prompts of the set (default: 8)")
    _add_model_and_decoding_arguments(bench, new_tokens=64)
    bench.set_defaults(run=cmd_bench)
    demo = sub.add_parser("demo", help="launch the Gradio web demo")
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on, 0.0.0.0 for every interface "
                                                          "(default: 127.0.0.1)")
    demo.add_argument("--port", type=int, default=7860, help="(default: 7860)")
    _add_model_and_decoding_arguments(demo, new_tokens=128)
    demo.set_defaults(run=cmd_demo)
    return parser


def _add_model_and_decoding_arguments(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    """Each subcommand gets its own copies: argparse's parents= would share one default for --max-new-tokens."""
    models = parser.add_argument_group("models")
    models.add_argument("--target", help="a local folder or a Hugging Face Hub id (default: the embedded "
                                         "specla-gdn-tiny in $SPECLA_HOME, else the repository's checkpoints/)")
    models.add_argument("--drafter", help=f"a folder or Hub id, {LAYER_SKIP!r} for the target's first block, or "
                                          f"{MTP!r} for the MTP head a Qwen3.5 / Qwen3-Next checkpoint ships "
                                          "(default: an embedded target's aligned drafter <target>-drafter when it "
                                          "is there, else layer-skip)")
    models.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    models.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                        help="auto: float32 on cpu, bfloat16 on cuda (default: auto)")
    dec = parser.add_argument_group("decoding")
    dec.add_argument("--max-new-tokens", type=POSITIVE_INT, default=new_tokens,
                     help=f"tokens to generate per prompt (default: {new_tokens})")
    dec.add_argument("--do-sample", action="store_true", help="sample (at --temperature, default 1.0) instead of "
                                                              "decoding greedily (default: greedy)")
    dec.add_argument("--temperature", type=_bounded(float, lambda t: t >= 0, "at least 0"),
                     help="sampling temperature; a value above 0 implies --do-sample, 0 means greedy")
    dec.add_argument("--top-k", type=POSITIVE_INT,
                     help="sample among the K most likely tokens (default: the model's generation config)")
    dec.add_argument("--top-p", type=_bounded(float, lambda p: 0 < p <= 1, "above 0 and at most 1"),
                     help="sample from the fewest most likely tokens whose probabilities add up to P "
                          "(default: the model's generation config)")
    dec.add_argument("--seed", type=int, help="seed torch before each timed run, so that a sampled run repeats; "
                                              "with --no-fallback and --fixed-shape, as when the fallback switches "
                                              "and which shape each step drafts depend on timing (default: unseeded)")
    dec.add_argument("--no-fallback", dest="fallback", action="store_false",
                     help="keep speculating to the end (default: like generate(), decode autoregressively once "
                          "speculation costs more per token than an autoregressive step)")
    shape = dec.add_mutually_exclusive_group()
    shape.add_argument("--tree", dest="tree", action="store_true", default=False, help="draft token trees")
    shape.add_argument("--chain", dest="tree", action="store_false",
                       help="draft a single chain of tokens (the default, as in generate())")
    dec.add_argument("--tree-budget", type=_bounded(int, lambda n: 1 <= n <= MAX_TREE_BUDGET,
                                                    f"between 1 and {MAX_TREE_BUDGET}"),
                     help=f"draft nodes verified per step, with --tree: 1-{MAX_TREE_BUDGET}, as one verify pass "
                          f"takes the root and at most {MAX_TREE_BUDGET} drafts (default: {TREE_DEFAULTS.budget})")
    dec.add_argument("--confidence-threshold", type=_bounded(float, lambda p: 0 <= p < 1, "at least 0 and below 1"),
                     help="drop draft nodes whose cumulative draft probability is below this (default: "
                          f"{CPU_CHAIN_THRESHOLD} for chains on a CPU, else {TREE_DEFAULTS.threshold:g}: on a GPU a "
                          "threshold selects each proposal on the host)")
    dec.add_argument("--draft-depth", type=POSITIVE_INT,
                     help=f"longest draft path (default: {CHAIN_DEFAULTS.depth} for chains, "
                          f"{TREE_DEFAULTS.depth} for trees)")
    dec.add_argument("--fixed-shape", action="store_true",
                     help="draft --draft-depth and --tree-budget every step (default: each proposal's depth and "
                          "budget, up to those, are chosen from the measured step costs and acceptance)")


def _bounded(kind: type, ok, requirement: str):
    """An argparse type: a number of ``kind`` for which ``ok(value)`` holds; the error says the ``requirement``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value
    return parse


POSITIVE_INT = _bounded(int, lambda n: n >= 1, "at least 1")


# ------------------------------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from specla_hf.app.runs import compare

    settings = _settings(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    models = _load(args)
    ids = _encode(models, prompt)
    result = compare(models, ids, settings, specla_streamer=TextStreamer(models.tokenizer, skip_prompt=True,
                                                                         skip_special_tokens=True))
    print(stats_line(result, settings, models), file=sys.stderr)
    return 0


def stats_line(result: Comparison, settings: DecodeSettings, models: Models) -> str:
    spec, plain = result.specla, result.plain
    # with the fallback on, the runtime says whether speculation paid, and if not after how many steps it stopped
    mode = f"; {spec.stats.mode_reason}" if spec.stats.mode_reason else ""
    line = (f"specla: {len(spec.tokens)} tokens, SpecLA {'tree' if settings.tree else 'chain'} "
            f"{spec.tokens_per_second:.1f} tok/s (tau {spec.stats.tau:.2f} over {spec.stats.steps} steps{mode}), "
            f"plain {plain.tokens_per_second:.1f} tok/s, speedup {result.speedup:.2f}x"
            f"{' (SpecLA slower)' if result.pace == 'slower' else ''}, drafter {models.drafter_name}")
    if settings.greedy:
        line += ", identical to plain" if result.identical else \
            f", DIFFERS from plain at token {_first_difference(spec.tokens, plain.tokens)}"
    return line


def cmd_bench(args: argparse.Namespace) -> int:
    from specla_hf.app.prompts import load_prompts
    from specla_hf.app.runs import compare

    settings = _settings(args)
    try:
        prompts = load_prompts(args.prompts)[:args.limit]
    except ValueError as e:
        raise UsageError(str(e)) from None
    models = _load(args)
    print(f"specla bench: {len(prompts)} prompts, {settings.max_new_tokens} new tokens, {_decoding(settings)}, "
          f"{'tree' if settings.tree else 'chain'}; target {models.target_name} on {models.target.device} "
          f"{str(models.target.dtype).removeprefix('torch.')}; drafter {models.drafter_name}")
    width = max(len(pid) for pid, _ in prompts) + 2
    print(f"{'prompt':<{width}}{'tokens':>7}{'plain tok/s':>13}{'SpecLA tok/s':>14}{'tau':>7}{'speedup':>9}"
          f"{'identical':>11}{'fell back':>11}")
    rows = []
    for pid, text in prompts:
        result = compare(models, _encode(models, text), settings)
        spec, plain = result.specla, result.plain
        rows.append((plain.tokens_per_second, spec.tokens_per_second, spec.stats.tau, result.speedup,
                     result.identical, spec.stats.mode == "autoregressive"))
        fell_back = ("off" if not settings.fallback else
                     f"after {spec.stats.speculative_steps}" if rows[-1][5] else "no")
        print(f"{pid:<{width}}{len(spec.tokens):>7}{rows[-1][0]:>13.1f}{rows[-1][1]:>14.1f}{rows[-1][2]:>7.2f}"
              f"{rows[-1][3]:>8.2f}x{('yes' if result.identical else 'NO') if settings.greedy else '-':>11}"
              f"{fell_back:>11}", flush=True)
    med = [statistics.median(col) for col in list(zip(*rows))[:4]]
    identical = f"{sum(r[4] for r in rows)}/{len(rows)}" if settings.greedy else "-"
    fell_back = f"{sum(r[5] for r in rows)}/{len(rows)}" if settings.fallback else "off"
    print(f"{'median':<{width}}{'':>7}{med[0]:>13.1f}{med[1]:>14.1f}{med[2]:>7.2f}{med[3]:>8.2f}x{identical:>11}"
          f"{fell_back:>11}")
    return 0


def _decoding(settings: DecodeSettings) -> str:
    if settings.greedy:
        return "greedy"
    shaping = "".join(f", {name} {value}" for name, value in (("top-k", settings.top_k), ("top-p", settings.top_p),
                                                              ("seed", settings.seed)) if value is not None)
    return f"sampling at temperature {settings.temperature}{shaping}"


def cmd_demo(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        from specla_hf.app import demo
    except ImportError as e:
        raise UsageError(f"the demo needs the [demo] extra ({e.name} is missing): pip install 'specla-hf[demo]'") \
            from None
    models = _load(args)
    try:
        demo.launch(models, settings, host=args.host, port=args.port)
    except OSError as e:                 # gradio's "Cannot find empty port", or the address is not ours
        raise UsageError(f"cannot serve the demo on {args.host}:{args.port}: {e}") from None
    return 0


# ------------------------------------------------------------------------------------------------------------------
def _settings(args: argparse.Namespace) -> DecodeSettings:
    """The decoding settings, every value checked now, before seconds of model loading."""
    from specla_hf.app.runs import DecodeSettings

    if args.do_sample and args.temperature == 0:
        raise UsageError("--do-sample with --temperature 0: 0 means greedy; pass a temperature above 0 or drop "
                         "--do-sample")
    sampling = args.do_sample or bool(args.temperature)
    if not sampling and (args.top_k is not None or args.top_p is not None):
        raise UsageError("--top-k / --top-p shape sampling: add --do-sample (or a --temperature above 0)")
    if args.tree_budget is not None and not args.tree:
        raise UsageError("--tree-budget shapes a draft tree: add --tree (chain drafting, the default, has none)")
    # a tree expands TREE_DEFAULTS.topk nodes per depth, and all of them must fit one verify pass
    deepest = MAX_TREE_BUDGET // (TREE_DEFAULTS.topk if args.tree else 1)
    if args.draft_depth is not None and args.draft_depth > deepest:
        raise UsageError(f"argument --draft-depth: at most {deepest} for {'trees' if args.tree else 'chains'}, as "
                         f"one verify pass takes {MAX_TREE_BUDGET + 1} nodes, got {args.draft_depth}")
    temperature = (args.temperature or 1.0) if sampling else 0.0
    settings = DecodeSettings(args.max_new_tokens, temperature, args.top_k, args.top_p, args.seed, args.tree,
                              args.fallback, args.tree_budget, args.confidence_threshold, args.draft_depth,
                              args.fixed_shape)
    try:
        settings.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return settings


def _load(args: argparse.Namespace) -> Models:
    import torch
    from transformers.utils import logging as hf_logging

    from specla_hf.app.loading import load_models

    hf_logging.disable_progress_bar()          # weight-loading bars would interleave with the streamed text
    if args.device == "cpu":
        # batch-1 decoding is thousands of tiny ops: one intra-op thread is fastest, and avoids the multi-second
        # stalls of threads spin-waiting on a busy machine (both decoders get the same setting)
        torch.set_num_threads(1)
    return load_models(args.target, args.drafter, args.device, args.dtype)


def _encode(models: Models, prompt: str):
    from specla_hf.app.runs import encode

    try:
        return encode(models, prompt)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    sys.exit(main())
