"""Run under TRITON_INTERPRET=1 (see test_fla_parity.py): fla's Triton modules vs our torch path on tiny models, and
SpecLA decoding with every SpecLA Triton kernel in the loop (the interpreter runs them on CPU tensors: tree verify,
tree conv, gate, commit, the drafter's top-k and expansion) against plain decoding, and our autoregressive decoding
with the fused one-token step's kernels (GEMVs, in-place recurrence) against it too.

Prints one JSON line with the max abs differences and the equality flags."""
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
from specla_hf.models.fla_backend import use_backend  # noqa: E402

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
# SpecLA with our kernels in the loop (ops.use_triton holds for CPU tensors here): a perfect drafter (the target's
# twin: long accepted paths, deep commits) and a random aligned drafter, chain, tree, and pruned tree (host selection)
from specla_hf import SpecLADrafter, SpecLADrafterConfig  # noqa: E402
from specla_kernels import ops  # noqa: E402

assert ops.use_triton(torch.zeros(1))
target, twin = tiny_gdn(seed=3), tiny_gdn(seed=3)
with torch.no_grad():
    for m in (target, twin):
        m.lm_head.weight.mul_(20)              # peaked distributions: confident drafts, so the twin's are accepted
aligned = SpecLADrafter(SpecLADrafterConfig.for_target(target.config, num_heads=2, head_dim=16)).eval()
ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
plain = target.generate(ids, max_new_tokens=14, do_sample=False)
specla = {}
for d_name, drafter in (("twin", twin), ("aligned", aligned)):
    for mode, kw in (("chain", dict(tree=False)), ("tree", dict(tree=True, tree_budget=9)),
                     ("pruned", dict(tree=True, tree_budget=9, confidence_threshold=0.05))):
        # the configured shapes (the shape policy would draft shallow under the interpreter's costs): deep paths
        spec = target.generate(ids, max_new_tokens=14, do_sample=False, assistant_model=drafter,
                               adaptive_drafting=False, **kw)
        specla[f"{d_name}_{mode}"] = {"equal": bool(torch.equal(spec, plain)), "tau": target.specla_stats.tau}
from specla_kernels import tuning  # noqa: E402

with tuning.using(fused_verify_max_nodes=64):      # trees' products through the fused_gemm kernel
    spec = target.generate(ids, max_new_tokens=14, do_sample=False, assistant_model=twin, adaptive_drafting=False,
                           tree=True, tree_budget=9, autoregressive_fallback=False)   # costs here are not a GPU's
specla["twin_tree_fused_verify"] = {"equal": bool(torch.equal(spec, plain)), "tau": target.specla_stats.tau}
out["specla_triton_kernels"] = specla
# our autoregressive baseline's one-token step: fused GEMV kernels and fla's recurrence updating the state in place
from specla_hf.loop.autoregressive import autoregressive_decode  # noqa: E402
from specla_hf.models.fla_gdn import GDNRunner  # noqa: E402

runner = GDNRunner(target)
out["fused_step_equal"] = runner.fused_step and bool(torch.equal(autoregressive_decode(runner, ids, 14), plain))
with tuning.using(one_token_fused_gemm=True):      # the step's products through fused_gemm on one row
    out["fused_step_fused_gemm_equal"] = bool(torch.equal(autoregressive_decode(runner, ids, 14), plain))
print(json.dumps(out))
