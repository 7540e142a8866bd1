"""Run under TRITON_INTERPRET=1 (see test_fla_parity.py): fla's Triton modules vs our torch path on tiny models.

Prints one JSON line with the max abs differences."""
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import triton.runtime.autotuner  # noqa: E402

# the autotuner times configs on a GPU driver; under the interpreter there is none (see shared cpu-testing notes)
triton.runtime.autotuner.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_gdn  # noqa: E402
from specla_hf.backend import use_backend  # noqa: E402

out = {}
for name, kw in {"base": {}, "gva": dict(v_heads=4), "no_gate_neg_eig": dict(gate=False, neg_eig=True)}.items():
    model = tiny_gdn(seed=2, layers=1, **kw)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
        with use_backend(modules="fla", delta_rule="fla"):
            fla = model(ids).logits
            fla_gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    torch_gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    out[name] = {"logits_max_abs": (fla - ref).abs().max().item(), "ref_max_abs": ref.abs().max().item(),
                 "generate_equal": bool(torch.equal(fla_gen, torch_gen))}
print(json.dumps(out))
