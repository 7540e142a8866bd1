"""The target-training script's CPU smoke mode: the loss goes down and the saved checkpoint reproduces its samples.

It trains on a small corpus written here from a fixed seed, in the layout the script reads, so that a fresh clone
needs no downloaded data.
"""
import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOUNS = "buffer page inode socket queue timer device request packet table entry node list cache lock".split()
VERBS = "read write free alloc find insert remove flush update check count copy map split merge".split()
ADJECTIVES = "small large empty full first last next free busy dirty clean shared".split()


def write_corpus(folder: Path, train_shards: int = 2, docs_per_shard: int = 40, valid_docs: int = 12) -> Path:
    """``train-NN-of-MM.jsonl.xz`` and ``valid.jsonl.xz`` of documents mixing C, Python and English sentences
    built from a few word lists: enough structure for a tiny model's loss to fall within a minute."""
    rng = random.Random(0)

    def c_function() -> str:
        noun, verb, other = rng.choice(NOUNS), rng.choice(VERBS), rng.choice(NOUNS)
        return (f"static int {verb}_{noun}(struct {noun} *{noun[0]})\n{{\n\tif (!{noun[0]})\n\t\treturn -EINVAL;\n"
                f"\t{noun[0]}->{other} = {rng.randrange(64)};\n\treturn {verb}_{other}({noun[0]}->{other});\n}}\n\n")

    def python_function() -> str:
        noun, verb, adjective = rng.choice(NOUNS), rng.choice(VERBS), rng.choice(ADJECTIVES)
        return (f"def {verb}_{noun}(self, {noun}):\n    \"\"\"{verb.capitalize()} the {adjective} {noun}.\"\"\"\n"
                f"    if {noun} is None:\n        return {rng.randrange(8)}\n"
                f"    return self.{noun}s.{verb}({noun})\n\n")

    def sentence() -> str:
        a, b = rng.sample(NOUNS, 2)
        return (f"The {rng.choice(ADJECTIVES)} {a} will {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {b} "
                f"before the {rng.choice(NOUNS)} is {rng.choice(ADJECTIVES)}. ")

    def document() -> str:
        parts = [rng.choice((c_function, python_function, sentence))() for _ in range(rng.randrange(30, 60))]
        return "".join(parts)

    folder.mkdir(parents=True)
    files = [f"train-{i:02d}-of-{train_shards:02d}.jsonl.xz" for i in range(train_shards)] + ["valid.jsonl.xz"]
    for name in files:
        with lzma.open(folder / name, "wt", encoding="utf-8") as f:
            for n in range(valid_docs if name.startswith("valid") else docs_per_shard):
                f.write(json.dumps({"source": "synthetic", "path": f"{name}:{n}", "text": document()}) + "\n")
    return folder


@pytest.mark.slow
def test_cpu_smoke_training_lowers_loss_and_saves_a_loadable_model(tmp_path):
    out = tmp_path / "tiny"
    corpus = write_corpus(tmp_path / "corpus")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_target.py"), "--cpu-smoke",
                          "--corpus", str(corpus), "--minutes", "0.5", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["error"] is None
    assert log["steps"] >= 5
    assert log["initial_val_loss"] > 8.5                        # ~ln(8192) at initialisation
    assert log["final_val_loss"] < log["initial_val_loss"] - 0.5
    assert log["final_train_loss"] < log["initial_val_loss"] - 0.5

    import specla_hf  # noqa: F401
    from fla.models import GatedDeltaNetForCausalLM
    from transformers import AutoTokenizer

    model = GatedDeltaNetForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    sample = log["samples"][0]
    ids = tokenizer(sample["prompt"], return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(gen[0, ids.shape[1]:]) == sample["completion"]
