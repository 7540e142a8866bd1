"""Our torch path for fla's Triton modules equals fla itself (fla run in Triton's interpreter, tiny sizes)."""
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
    for name, r in results.items():
        assert r["logits_max_abs"] < 1e-4 * max(1.0, r["ref_max_abs"]), (name, r)
        assert r["generate_equal"], (name, r)
