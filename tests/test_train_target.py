"""The target-training script's CPU smoke mode: the loss goes down and the saved checkpoint reproduces its samples."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_smoke_training_lowers_loss_and_saves_a_loadable_model(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_target.py"), "--cpu-smoke",
                          "--minutes", "1.0", "--out", str(out)], capture_output=True, text=True, timeout=300)
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
