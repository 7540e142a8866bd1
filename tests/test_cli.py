"""The `specla` command end to end (subprocesses on tiny random checkpoints), and the model defaults behind it."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import tiny_gdn
from tiny_checkpoints import greedy_text, hub_snapshot, save_tiny_checkpoints
from specla_hf.app.loading import DEFAULT_DRAFTER, DEFAULT_TARGET, layer_skip_drafter
from specla_hf.app.prompts import SHIPPED, load_prompts

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"^specla: (\d+) tokens, SpecLA (tree|chain) [\d.]+ tok/s \(tau ([\d.]+) over (\d+) steps"
                   r"(?:; ([^)]+))?\), plain [\d.]+ tok/s, speedup ([\d.]+)x( \(SpecLA slower\))?, drafter (.+?)"
                   r"(, identical to plain)?$", re.M)
# groups: 1 tokens, 2 mode, 3 tau, 4 steps, 5 the fallback's verdict, 6 speedup, 7 slower, 8 drafter, 9 identical
# a Hub endpoint that refuses connections at once: what an offline machine sees, without waiting on DNS
UNREACHABLE_HUB = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("ckpts"))


def specla(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return specla_all((args, env, stdin))[0]


def specla_all(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """Run several ``(args, env, stdin)`` invocations at once: each spends seconds importing torch and transformers.
    Each result also carries ``seconds``, from the common start to its own exit."""
    start = time.monotonic()

    def run(args, env, stdin) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "specla_hf.app.cli", *args], input=stdin, capture_output=True,
                              text=True, env={**os.environ, **(env or {})}, timeout=300)
        proc.seconds = time.monotonic() - start
        return proc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: run(*call), calls))


def one_line_error(run: subprocess.CompletedProcess) -> str:
    """The error line; it must be the only line the CLI itself wrote, and no traceback."""
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    ours = [line for line in run.stderr.splitlines() if line.startswith("specla")]
    assert len(ours) == 1 and ours[0].startswith("specla: error: ") and run.stderr.rstrip().endswith(ours[0])
    return ours[0]


def test_generate_streams_the_greedy_text_then_a_stats_line(ckpts):
    run = specla("generate", "--target", str(ckpts["target"]), "--drafter", str(ckpts["drafter"]),
                 "--max-new-tokens", "30", "--tree", "--tree-budget", "8", "--confidence-threshold", "0",
                 "Hello, world")
    assert run.returncode == 0, run.stderr
    # stdout is the text alone (the streamer ends it with a newline), identical to plain greedy decoding
    assert run.stdout == greedy_text(ckpts["target"], "Hello, world", 30) + "\n"
    m = STATS.search(run.stderr)
    assert m, run.stderr
    n, mode, tau, steps, verdict, speedup, slower, drafter, identical = m.groups()
    assert (int(n), mode, identical) == (30, "tree", ", identical to plain")
    assert float(tau) == pytest.approx(30 / int(steps), abs=0.01)
    assert (slower is not None) == (float(speedup) < 1), run.stderr          # the line says when SpecLA lost
    # the fallback (on, as in generate()) says whether speculation paid, or after how many steps it stopped
    assert re.fullmatch(r"fell back after \d+ speculative steps: .*|speculation [\d.]+ ms a token, .*|too few .*",
                        verdict), verdict
    assert drafter == f"{ckpts['drafter']} (draft model)"


@pytest.mark.parametrize("specla_seconds, pace", [(1.0, "level"), (1.003, "level"), (1.006, "slower"),
                                                   (0.994, "faster")])
def test_the_verdict_agrees_with_the_speedup_as_printed(specla_seconds, pace):
    from specla_hf.app.runs import Comparison, Run
    result = Comparison(specla=Run(tokens=[0] * 30, seconds=specla_seconds), plain=Run(tokens=[0] * 30, seconds=1.0))
    assert result.pace == pace, f"{result.speedup:.2f}x"


def test_sampling_options_reach_generate_and_a_seed_repeats_a_run(ckpts):
    """--top-k 1 sampling is greedy decoding; a seeded sampled run repeats, and differs from greedy (the random
    target's distributions are flat). --no-fallback and --fixed-shape: when the fallback switches and which shape a
    step drafts depend on timing, and speculative and autoregressive steps, or trees of other shapes, draw random
    numbers differently."""
    common = ["generate", "--target", str(ckpts["target"]), "--drafter", str(ckpts["drafter"]),
              "--max-new-tokens", "20", "--confidence-threshold", "0", "--do-sample", "--no-fallback",
              "--fixed-shape"]
    top1, seeded, again = specla_all((common + ["--top-k", "1", "Once"], None, None),
                                     (common + ["--seed", "7", "--top-p", "0.95", "Once"], None, None),
                                     (common + ["--seed", "7", "--top-p", "0.95", "Once"], None, None))
    greedy = greedy_text(ckpts["target"], "Once", 20) + "\n"
    for run in (top1, seeded, again):
        assert run.returncode == 0, run.stderr
        m = STATS.search(run.stderr)
        assert m.group(9) is None and m.group(5) is None               # no identity claim, no fallback
    assert top1.stdout == greedy
    assert seeded.stdout == again.stdout != greedy


def test_help_shows_each_commands_defaults():
    generate, bench = specla_all((["generate", "--help"], None, None), (["bench", "--help"], None, None))
    assert generate.returncode == bench.returncode == 0

    def entries(help_text: str) -> dict[str, str]:
        """Each option's help entry, whitespace collapsed, by its first option string."""
        found = re.split(r"\n  (?=-)", help_text)[1:]
        return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in found}

    gen, ben = entries(generate.stdout), entries(bench.stdout)
    assert gen["--max-new-tokens"].endswith("(default: 128)") and ben["--max-new-tokens"].endswith("(default: 64)")
    for option in ("--tree-budget", "--draft-depth", "--confidence-threshold", "--device", "--dtype", "--top-k",
                   "--top-p", "--seed", "--no-fallback", "--target", "--drafter"):
        assert "(default: " in gen[option], gen[option]


def test_default_models_come_from_specla_home_and_each_drafter_is_named_by_kind(ckpts, tmp_path):
    """No model arguments: the target in $SPECLA_HOME with its aligned drafter if present, else layer-skip. The
    stats line names the drafter that ran and its kind (EAGLE-style, DART-style, a GDN model, layer-skip)."""
    from transformers import AutoConfig

    from specla_hf import SpecLADartConfig, SpecLADartDrafter, SpecLADrafter, SpecLADrafterConfig

    bare, full = tmp_path / "bare", tmp_path / "full"
    for home in (bare, full):
        home.mkdir()
        (home / DEFAULT_TARGET).symlink_to(ckpts["target"])
    target_config = AutoConfig.from_pretrained(ckpts["target"])
    SpecLADrafter(SpecLADrafterConfig.for_target(target_config)).save_pretrained(full / DEFAULT_DRAFTER)
    dart = tmp_path / "dart"
    SpecLADartDrafter(SpecLADartConfig.for_target(target_config, draft_slots=2)).save_pretrained(dart)
    layer_skip, eagle, parallel = specla_all(
        (["generate", "--max-new-tokens", "5"], {"SPECLA_HOME": str(bare)}, "abc"),
        (["generate", "--max-new-tokens", "5", "--tree", "abc"], {"SPECLA_HOME": str(full)}, None),
        (["generate", "--max-new-tokens", "5", "--tree", "--drafter", str(dart), "abc"], {"SPECLA_HOME": str(full)},
         None))
    for run in (layer_skip, eagle, parallel):
        assert run.returncode == 0, run.stderr
    assert STATS.search(layer_skip.stderr).group(8) == "layer-skip (the target's block 1 of 2)"
    m = STATS.search(eagle.stderr)
    assert m.group(8) == f"{DEFAULT_DRAFTER} (EAGLE-style aligned drafter)" and m.group(9)
    assert STATS.search(parallel.stderr).group(8) == f"{dart} (DART-style parallel drafter)"


def test_bench_on_a_prompt_file(ckpts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 7, "turns": ["Tell me", "more"]}) + "\n"
                       + json.dumps({"task_id": "HumanEval/1", "prompt": "\n\ndef f(x):\n"}) + "\n"
                       + json.dumps({"instruction": "Not this one"}) + "\n")
    run = specla("bench", "--target", str(ckpts["target"]), "--drafter", str(ckpts["drafter"]), "--prompts",
                 str(prompts), "--limit", "2", "--max-new-tokens", "12")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("specla bench: 2 prompts, 12 new tokens, greedy, chain; target ")
    assert [line.split()[0] for line in lines[2:]] == ["7", "HumanEval/1", "median"]
    # tokens, plain and SpecLA tok/s, tau, speedup, identical, and whether (after how many steps) SpecLA fell back
    row = re.compile(r"\S+ +12 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+x +yes +(no|after \d+)$")
    assert all(row.fullmatch(line) for line in lines[2:4]), lines
    assert re.fullmatch(r"median +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+x +2/2 +[012]/2", lines[-1]), lines[-1]


def test_errors_are_one_clear_line(ckpts, tmp_path):
    t, d = str(ckpts["target"]), str(ckpts["drafter"])
    cases = {
        "missing target": (["generate", "--target", str(tmp_path / "nope"), "x"],
                           f"target not found: {tmp_path / 'nope'} (no such folder)"),
        "empty drafter folder": (["generate", "--target", t, "--drafter", str(tmp_path), "x"],
                                 f"drafter {tmp_path} has no model in it (no config.json)"),
        "mismatched drafter": (["generate", "--target", t, "--drafter", str(ckpts["other-vocab-drafter"]), "x"],
                               "drafter vocabulary (50) differs from the target's (99)"),
        "bad prompts": (["bench", "--target", t, "--prompts", str(tmp_path / "none.jsonl")],
                        f"--prompts {tmp_path / 'none.jsonl'}: no such file"),
        # argparse's errors: one line too, not usage + line
        "no tokens": (["generate", "--max-new-tokens", "0", "x"],
                      "argument --max-new-tokens: must be at least 1, got 0 (see specla generate --help)"),
        "huge tree": (["generate", "--tree", "--tree-budget", "1000", "x"],
                      "argument --tree-budget: must be between 1 and 127, got 1000"),
        "empty tree": (["bench", "--tree", "--tree-budget", "0"],
                       "argument --tree-budget: must be between 1 and 127, got 0"),
    }
    if not torch.cuda.is_available():
        cases["no gpu"] = (["generate", "--target", t, "--drafter", d, "--device", "cuda", "x"],
                           "--device cuda: no CUDA GPU is visible to torch; run with --device cpu")
    runs = specla_all(*((args, None, None) for args, _ in cases.values()))
    for (case, (_, expected)), run in zip(cases.items(), runs):
        assert expected in one_line_error(run), case
        assert "DraftOptions(" not in run.stderr and "usage:" not in run.stderr, case


def test_hub_ids_come_from_the_local_cache_first_and_fail_fast_when_the_hub_is_unreachable(ckpts, tmp_path):
    """A Hub id in the local Hub cache loads with no network; one that is not fails in about as long as an offline
    lookup (HF_HUB_OFFLINE), not after half a minute of retries."""
    cache = tmp_path / "hub"
    shutil.copytree(ckpts["target"], hub_snapshot(cache, "someone/tiny-gdn", commit="0123abcd"))
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": UNREACHABLE_HUB}
    cached, unreachable, offline = specla_all(
        (["generate", "--target", "someone/tiny-gdn", "--max-new-tokens", "4", "x"], env, None),
        (["generate", "--target", "someone/not-here", "x"], env, None),
        (["generate", "--target", "someone/not-here", "x"], {**env, "HF_HUB_OFFLINE": "1"}, None))
    assert cached.returncode == 0, cached.stderr
    assert STATS.search(cached.stderr).group(1) == "4"
    assert (f"cannot reach the Hugging Face Hub ({UNREACHABLE_HUB}) for target someone/not-here"
            in one_line_error(unreachable))
    assert "is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in one_line_error(offline)
    # transformers alone retries a refused connection for ~23 s, for the cached model too
    assert "Retrying" not in unreachable.stderr + cached.stderr
    assert unreachable.seconds < offline.seconds + 10 and cached.seconds < offline.seconds + 15


def test_readme_examples_print_what_the_readme_says():
    """The quick start's command and the "In Python" example, on the embedded models, from the repository root."""
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## In Python\n+```python\n(.*?)```", readme, re.S).group(1)
    summary = re.compile(r"^64 tokens in [\d.]+s \([\d.]+ tok/s\), tau=[\d.]+ over \d+ target steps, draft [\d.]+s, "
                         r"verify [\d.]+s, mode (speculative|autoregressive) \(.+\)$", re.M)
    assert summary.search(re.search(r"a line like\s+`([^`]+)`", readme).group(1))       # the line the README quotes
    assert 'specla generate "def fibonacci(n):"' in readme
    env = {**os.environ, "SPECLA_HOME": ""}
    with ThreadPoolExecutor(2) as pool:
        python, cli = pool.map(lambda cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                                                          timeout=300),
                               ([sys.executable, "-c", example],
                                [sys.executable, "-m", "specla_hf.app.cli", "generate", "def fibonacci(n):"]))
    assert python.returncode == 0, python.stderr[-3000:]
    assert python.stdout.startswith("def fibonacci(n):\n") and summary.search(python.stdout), python.stdout
    assert cli.returncode == 0, cli.stderr[-3000:]
    m = STATS.search(cli.stderr)
    assert m and m.group(1) == "128" and m.group(8) == f"{DEFAULT_DRAFTER} (EAGLE-style aligned drafter)" \
        and m.group(9), cli.stderr



def test_readme_hybrid_examples_run():
    """The README's Qwen3.5 section: its two Python snippets (aligned drafter, then the checkpoint's MTP head) on the
    embedded hybrid, each asserting identity with plain decoding, and its two commands."""
    section = re.search(r"## Qwen3\.5 and Qwen3-Next.*?\n## ", (ROOT / "README.md").read_text(), re.S).group(0)
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(snippets) == 2
    commands = ['specla generate --target specla-qwen35-tiny "def fibonacci(n):"',
                "specla generate --target specla-qwen35-tiny --drafter mtp"]
    assert all(c in section for c in commands)
    env = {**os.environ, "SPECLA_HOME": ""}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                                                        timeout=300),
                             ([sys.executable, "-c", "\n".join(snippets)],
                              [sys.executable, "-m", "specla_hf.app.cli", "generate", "--target", "specla-qwen35-tiny",
                               "--max-new-tokens", "24", "def fibonacci(n):"],
                              [sys.executable, "-m", "specla_hf.app.cli", "generate", "--target", "specla-qwen35-tiny",
                               "--drafter", "mtp", "--max-new-tokens", "24", "def fibonacci(n):"])))
    python, aligned, mtp = runs
    assert python.returncode == 0, python.stderr[-3000:]
    for run, drafter in ((aligned, "specla-qwen35-tiny-drafter (EAGLE-style aligned drafter)"),
                         (mtp, "mtp (the MTP head of specla-qwen35-tiny)")):
        assert run.returncode == 0, run.stderr[-3000:]
        m = STATS.search(run.stderr)
        assert m and m.group(1) == "24" and m.group(8) == drafter and m.group(9), run.stderr


# ---------------------------------------------------------------------------------------------------------------
# in process
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    (["generate", "--tree-budget", "8", "x"], "--tree-budget shapes a draft tree: add --tree"),
    (["generate", "--tree", "--draft-depth", "40", "x"],
     "argument --draft-depth: at most 31 for trees, as one verify pass takes 128 nodes, got 40"),
    (["generate", "--chain", "--draft-depth", "128", "x"], "argument --draft-depth: at most 127 for chains"),
    (["generate", "--top-k", "5", "x"], "--top-k / --top-p shape sampling: add --do-sample"),
    (["generate", "--do-sample", "--temperature", "0", "x"], "--do-sample with --temperature 0: 0 means greedy"),
    (["generate", "--do-sample", "--top-p", "1.5", "x"], "argument --top-p: must be above 0 and at most 1, got 1.5"),
    (["bench", "--limit", "0"], "argument --limit: must be at least 1, got 0"),
    (["generate", "--beams", "x"], "unrecognized arguments: --beams (see specla --help)"),
    ([], "the following arguments are required"),
], ids=["budget-without-tree", "deep-tree", "deep-chain", "top-k-greedy", "sample-at-0", "top-p", "limit",
        "unknown", "no-command"])
def test_usage_errors_before_any_model_loads(args, expected, capsys):
    """More bad input, each refused as one line (argparse's own errors too) by the same main() the subprocesses run."""
    from specla_hf.app.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specla: error: ") and expected in err, err


def test_layer_skip_drafter_is_the_targets_first_block():
    target = tiny_gdn(seed=5, layers=3)
    drafter = layer_skip_drafter(target)
    truncated = copy.deepcopy(target)
    truncated.model.layers = truncated.model.layers[:1]
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(drafter(ids).logits, truncated(ids).logits)
    assert drafter.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    assert drafter.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()      # shared, not copied


def test_prompt_files_of_every_evaluation_layout(tmp_path):
    """The layouts of MT-Bench (question_id, turns), HumanEval (task_id, prompt) and AlpacaEval (instruction, no id)."""
    assert load_prompts() == SHIPPED and len(SHIPPED) == 8
    rows = {"mt_bench": {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            "humaneval": {"task_id": "HumanEval/0", "prompt": "\ndef f(x):\n", "entry_point": "f", "test": ""},
            "alpaca_eval": {"instruction": "List three colours.", "dataset": "selfinstruct"}}
    expected = {"mt_bench": ("81", "Write a poem."), "humaneval": ("HumanEval/0", "def f(x):\n"),
                "alpaca_eval": ("alpaca_eval:1", "List three colours.")}
    for name, row in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        assert load_prompts(path) == [expected[name]], name
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no known field"}\n')
    with pytest.raises(ValueError, match="line 1: no 'turns', 'instruction', 'prompt' or 'text' field"):
        load_prompts(bad)
