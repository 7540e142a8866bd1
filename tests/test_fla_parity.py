"""Our torch path for fla's Triton modules equals fla itself (fla run in Triton's interpreter, tiny sizes), and SpecLA
decoding with our Triton kernels in the loop equals plain decoding (same interpreter run)."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.interpret
def test_torch_path_matches_fla_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = os.path.join(os.path.dirname(__file__), "fla_interpret_check.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    specla = results.pop("specla_triton_kernels")
    assert results.pop("fused_step_equal"), "the fused one-token step decodes differently from plain decoding"
    assert results.pop("fused_step_fused_gemm_equal"), "the one-token step through fused_gemm decodes differently"
    for name, r in results.items():
        assert r["logits_max_abs"] < 1e-4 * max(1.0, r["ref_max_abs"]), (name, r)
        assert r["generate_equal"], (name, r)
    # SpecLA with our Triton kernels in the loop decodes exactly what plain decoding does
    assert all(r["equal"] for r in specla.values()), specla
    assert min(specla[f"twin_{m}"]["tau"] for m in ("chain", "tree", "pruned", "tree_fused_verify")) > 3  # deep paths
