"""benchmarks/tune_step.py's table file: one run per GPU and model shape, an install replacing only its own."""
import importlib.util
import json
import sys
from pathlib import Path

from specla_kernels import tuning

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script():
    sys.path.insert(0, str(BENCHMARKS))      # it imports hybrid_bench's shapes
    try:
        spec = importlib.util.spec_from_file_location("tune_step", BENCHMARKS / "tune_step.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def a_run(device: str, shape: str, N: int, split: int) -> dict:
    return {"device": device, "shape": shape, "products": [
        {"device": device, "dtype": "bfloat16", "N": N, "K": 4096, "PRO": 1, "EPI": 0, "KC": 4096,
         "launch": {"split": split, "BN": 4, "num_warps": 8}}]}


def test_install_replaces_only_the_run_of_its_gpu_and_shape(tmp_path, monkeypatch):
    tune_step = load_script()
    monkeypatch.setattr(tuning, "STEP_CONFIGS_FILE", tmp_path / "gemv_step_configs.json")
    tune_step.install(a_run("H200", "gdn-1.3b", 8192, 0))
    tune_step.install(a_run("H200", "qwen3.5-9b", 248320, 0))
    tune_step.install(a_run("B200", "gdn-1.3b", 8192, 512))
    tune_step.install(a_run("H200", "gdn-1.3b", 9280, 1024))          # tuned again: replaces the first
    runs = json.loads(tuning.STEP_CONFIGS_FILE.read_text())["runs"]
    assert [(r["device"], r["shape"]) for r in runs] == [("H200", "qwen3.5-9b"), ("B200", "gdn-1.3b"),
                                                         ("H200", "gdn-1.3b")]
    table = tuning.load_step_configs(tuning.STEP_CONFIGS_FILE)
    assert {(k[0], k[2]): v["split"] for k, v in table.items()} == {
        ("H200", 248320): 0, ("B200", 8192): 512, ("H200", 9280): 1024}
