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

import torch
from transformers.utils import logging as hf_logging

from specla_hf.app.loading import DTYPES, LAYER_SKIP, ModelError, Models, load_models
from specla_hf.app.prompts import load_prompts
from specla_hf.app.runs import DecodeSettings, Run, encode, run_plain, run_specla, warm_up


class UsageError(Exception):
    """Bad input from the user; reported as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hf_logging.disable_progress_bar()          # weight-loading bars would interleave with the streamed text
    try:
        return args.run(args)
    except (UsageError, ModelError) as e:
        print(f"specla: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    models = common.add_argument_group("models")
    models.add_argument("--target", help="target model: a local folder or a Hugging Face Hub id (default: the "
                                         "embedded specla-gdn-tiny in $SPECLA_HOME or the repository's checkpoints/)")
    models.add_argument("--drafter", help=f"drafter: a folder or Hub id, or {LAYER_SKIP!r} for the target's first "
                                          "block (default: the aligned drafter of the default target if present, "
                                          "else layer-skip)")
    models.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    models.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: float32 on cpu, bfloat16 on cuda")
    dec = common.add_argument_group("decoding")
    dec.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt")
    dec.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    shape = dec.add_mutually_exclusive_group()
    shape.add_argument("--tree", dest="tree", action="store_true", default=False, help="draft token trees")
    shape.add_argument("--chain", dest="tree", action="store_false",
                       help="draft a single chain of tokens (default, as in generate())")
    dec.add_argument("--tree-budget", type=int, default=None, help="draft nodes verified per step (tree only)")
    dec.add_argument("--confidence-threshold", type=float, default=None,
                     help="drop draft nodes whose cumulative draft probability is below this")
    dec.add_argument("--draft-depth", type=int, default=None, help="longest draft path")

    parser = argparse.ArgumentParser(prog="specla", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,demo}")
    gen = sub.add_parser("generate", parents=[common], help="generate from one prompt, with a stats line")
    gen.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or nothing: read it from stdin)")
    gen.set_defaults(run=cmd_generate, default_new_tokens=128)
    bench = sub.add_parser("bench", parents=[common], help="plain vs SpecLA decoding on a prompt set")
    bench.add_argument("--prompts", help="JSON-lines prompt file (MT-Bench, HumanEval, AlpacaEval layouts; default: "
                                         "a few MT-Bench and HumanEval prompts shipped in the package)")
    bench.add_argument("--limit", type=int, default=8, help="first N prompts of the set (default 8)")
    bench.set_defaults(run=cmd_bench, default_new_tokens=64)
    demo = sub.add_parser("demo", parents=[common], help="launch the Gradio web demo")
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    demo.add_argument("--port", type=int, default=7860)
    demo.set_defaults(run=cmd_demo, default_new_tokens=128)
    return parser


# ------------------------------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    settings = _settings(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    models = _load(args)
    ids = _encode(models, prompt)
    warm_up(models, ids, settings)
    spec = run_specla(models, ids, settings, TextStreamer(models.tokenizer, skip_prompt=True,
                                                          skip_special_tokens=True))
    plain = run_plain(models, ids, settings)
    print(stats_line(spec, plain, settings, models), file=sys.stderr)
    return 0


def stats_line(spec: Run, plain: Run, settings: DecodeSettings, models: Models) -> str:
    mode = "tree" if settings.tree else "chain"
    line = (f"specla: {len(spec.tokens)} tokens, SpecLA {mode} {spec.tokens_per_second:.1f} tok/s "
            f"(tau {spec.stats.tau:.2f} over {spec.stats.steps} steps), plain {plain.tokens_per_second:.1f} tok/s, "
            f"speedup {_speedup(spec, plain):.2f}x, drafter {models.drafter_name}")
    if settings.greedy:
        line += ", identical to plain" if spec.tokens == plain.tokens else \
            f", DIFFERS from plain at token {_first_difference(spec.tokens, plain.tokens)}"
    return line


def cmd_bench(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        prompts = load_prompts(args.prompts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    prompts = prompts[:args.limit]
    models = _load(args)
    print(f"specla bench: {len(prompts)} prompts, {settings.max_new_tokens} new tokens, "
          f"{'greedy' if settings.greedy else f'temperature {settings.temperature}'}, "
          f"{'tree' if settings.tree else 'chain'}; target {models.target_name} on {models.target.device} "
          f"{str(models.target.dtype).removeprefix('torch.')}; drafter {models.drafter_name}")
    width = max(len(pid) for pid, _ in prompts) + 2
    print(f"{'prompt':<{width}}{'tokens':>7}{'plain tok/s':>13}{'SpecLA tok/s':>14}{'tau':>7}{'speedup':>9}"
          f"{'identical':>11}")
    warm_up(models, _encode(models, prompts[0][1]), settings)
    rows = []
    for pid, text in prompts:
        ids = _encode(models, text)
        spec, plain = run_specla(models, ids, settings), run_plain(models, ids, settings)
        same = spec.tokens == plain.tokens
        rows.append((plain.tokens_per_second, spec.tokens_per_second, spec.stats.tau, _speedup(spec, plain), same))
        print(f"{pid:<{width}}{len(spec.tokens):>7}{rows[-1][0]:>13.1f}{rows[-1][1]:>14.1f}{rows[-1][2]:>7.2f}"
              f"{rows[-1][3]:>8.2f}x{('yes' if same else 'NO') if settings.greedy else '-':>11}", flush=True)
    med = [statistics.median(col) for col in list(zip(*rows))[:4]]
    identical = f"{sum(r[4] for r in rows)}/{len(rows)}" if settings.greedy else "-"
    print(f"{'median':<{width}}{'':>7}{med[0]:>13.1f}{med[1]:>14.1f}{med[2]:>7.2f}{med[3]:>8.2f}x{identical:>11}")
    return 0


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
    settings = DecodeSettings(args.max_new_tokens or args.default_new_tokens, args.temperature, args.tree,
                              args.tree_budget, args.confidence_threshold, args.draft_depth)
    try:                                   # check every value now, before seconds of model loading
        settings.generate_kwargs()
        settings.draft_options()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tree_budget is not None and not args.tree:
        raise UsageError("--tree-budget shapes a draft tree; drop it or drop --chain")
    return settings


def _load(args: argparse.Namespace) -> Models:
    if args.device == "cpu":
        # batch-1 decoding is thousands of tiny ops: one intra-op thread is fastest, and avoids the multi-second
        # stalls of threads spin-waiting on a busy machine (both decoders get the same setting)
        torch.set_num_threads(1)
    return load_models(args.target, args.drafter, args.device, args.dtype)


def _encode(models: Models, prompt: str):
    try:
        return encode(models, prompt)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _speedup(spec: Run, plain: Run) -> float:
    return spec.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else float("nan")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    sys.exit(main())
