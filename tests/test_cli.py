"""The `specla` command end to end (subprocesses on tiny random checkpoints), and the model defaults behind it."""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_gdn
from tiny_checkpoints import greedy_text, save_tiny_checkpoints
from specla_hf.app.loading import DEFAULT_DRAFTER, DEFAULT_TARGET, layer_skip_drafter
from specla_hf.app.prompts import SHIPPED, load_prompts

SHARED_EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
STATS = re.compile(r"^specla: (\d+) tokens, SpecLA (tree|chain) [\d.]+ tok/s \(tau ([\d.]+) over (\d+) steps\), "
                   r"plain [\d.]+ tok/s, speedup [\d.]+x, drafter (.+?)(, identical to plain)?$", re.M)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("ckpts"))


def specla(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return specla_all((args, env, stdin))[0]


def specla_all(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """Run several ``(args, env, stdin)`` invocations at once: each spends seconds importing torch/transformers/fla."""
    procs = [subprocess.Popen([sys.executable, "-m", "specla_hf.app.cli", *args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})}) for args, env, _ in calls]
    done = []
    for proc, (_, _, stdin) in zip(procs, calls):
        out, err = proc.communicate(stdin, timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


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
    n, mode, tau, steps, drafter, identical = m.groups()
    assert (int(n), mode, identical) == (30, "tree", ", identical to plain")
    assert float(tau) == pytest.approx(30 / int(steps), abs=0.01)
    assert drafter == f"GDN draft model {ckpts['drafter']}"


def test_default_models_come_from_specla_home(ckpts, tmp_path):
    """No model arguments: the target in $SPECLA_HOME with its aligned drafter if present, else layer-skip."""
    from transformers import AutoConfig

    from specla_hf.drafters.eagle import SpecLADrafter, SpecLADrafterConfig

    bare, full = tmp_path / "bare", tmp_path / "full"
    for home in (bare, full):
        home.mkdir()
        (home / DEFAULT_TARGET).symlink_to(ckpts["target"])
    aligned = SpecLADrafter(SpecLADrafterConfig.for_target(AutoConfig.from_pretrained(ckpts["target"])))
    aligned.save_pretrained(full / DEFAULT_DRAFTER)
    layer_skip, eagle = specla_all((["generate", "--max-new-tokens", "5"], {"SPECLA_HOME": str(bare)}, "abc"),
                                   (["generate", "--max-new-tokens", "5", "--tree", "abc"],
                                    {"SPECLA_HOME": str(full)}, None))
    assert layer_skip.returncode == 0, layer_skip.stderr
    assert STATS.search(layer_skip.stderr).group(5) == "layer-skip (target block 1 of 2)"
    assert eagle.returncode == 0, eagle.stderr
    m = STATS.search(eagle.stderr)
    assert m.group(5) == f"aligned drafter {full / DEFAULT_DRAFTER}" and m.group(6)


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
    assert all(line.split()[1] == "12" and line.split()[-1] == "yes" for line in lines[2:4])
    assert lines[-1].split()[-1] == "2/2"


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
    }
    if not torch.cuda.is_available():
        cases["no gpu"] = (["generate", "--target", t, "--drafter", d, "--device", "cuda", "x"],
                           "--device cuda: no CUDA GPU is visible to torch; run with --device cpu")
    runs = specla_all(*((args, None, None) for args, _ in cases.values()))
    for (case, (_, expected)), run in zip(cases.items(), runs):
        assert expected in one_line_error(run), case


# ---------------------------------------------------------------------------------------------------------------
# in process
# ---------------------------------------------------------------------------------------------------------------
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


def test_prompt_files_of_every_shared_layout(tmp_path):
    assert load_prompts() == SHIPPED and len(SHIPPED) == 8
    if SHARED_EVAL.is_dir():      # ../shared/data/eval: MT-Bench, HumanEval, AlpacaEval
        for name, first in (("mt_bench", "81"), ("humaneval", "HumanEval/0"), ("alpaca_eval_80", "alpaca_eval_80:1")):
            prompts = load_prompts(SHARED_EVAL / f"{name}.jsonl")
            assert len(prompts) >= 80 and prompts[0][0] == first and all(text for _, text in prompts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no known field"}\n')
    with pytest.raises(ValueError, match="line 1: no 'turns', 'instruction', 'prompt' or 'text' field"):
        load_prompts(bad)
