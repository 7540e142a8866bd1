"""The target-training script's hybrid family (``--family qwen3_5``) in CPU smoke mode, on a corpus built here: the
loss goes down and the saved Qwen3.5 checkpoint loads through the Auto classes and reproduces its samples."""
import json
import lzma
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM

# the script imports its neighbour train_tokenizer as a top-level module
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_target  # noqa: E402


def write_corpus(folder: Path) -> None:
    """A training shard and a validation file of the layout the script reads: JSON lines with a "text" field."""
    rng = random.Random(0)
    words = "the of and to in is that for it as with was on be by at this from def return int main void".split()
    folder.mkdir()
    for name, docs in (("train-00-of-01.jsonl.xz", 60), ("valid.jsonl.xz", 12)):
        with lzma.open(folder / name, "wt") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(400))}) + "\n")


def test_cpu_smoke_training_of_a_qwen3_5_hybrid(tmp_path):
    """In process (an interpreter of its own would cost as much as the run)."""
    write_corpus(tmp_path / "corpus")
    out = tmp_path / "tiny"
    train_target.main(["--family", "qwen3_5", "--cpu-smoke", "--corpus", str(tmp_path / "corpus"), "--minutes", "0.25",
                       "--out", str(out)])
    log = json.loads((out / "train_log.json").read_text())
    assert log["error"] is None and log["family"] == "qwen3_5" and "--family qwen3_5" in log["command"]
    assert log["steps"] >= 5
    assert log["initial_val_loss"] > 8.5                        # ~ln(8192) at initialisation
    assert log["final_val_loss"] < log["initial_val_loss"] - 0.5
    assert log["final_train_loss"] < log["initial_val_loss"] - 0.5

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model) is Qwen3_5ForCausalLM
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()       # tied
    tokenizer = AutoTokenizer.from_pretrained(out)
    sample = log["samples"][0]
    ids = tokenizer(sample["prompt"], return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(gen[0, ids.shape[1]:]) == sample["completion"]
