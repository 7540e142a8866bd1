"""benchmarks/hybrid_bench.py's controlled acceptance: the oracle replaces the MTP head's drafts in every way the head
is asked for them (log-probs when greedy, logits when drafts are drawn), and at no noise its drafts are the target's
own tokens."""
import sys
from pathlib import Path

import pytest
import torch

from hybrid_models import tiny_hybrid
from specla_hf import MTPDrafter

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def hybrid_bench():
    sys.path.insert(0, str(BENCHMARKS))      # it imports acceptance_curve
    try:
        import hybrid_bench
        yield hybrid_bench
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("sampling", [None, dict(temperature=0.1)], ids=["greedy", "sampled"])
def test_oracle_drafts_replace_the_heads_under_greedy_and_sampled_drafting(hybrid_bench, monkeypatch, sampling):
    monkeypatch.setattr(hybrid_bench, "weight_floor_ms", lambda model: 1.0)    # a timing, not under test here
    target = tiny_hybrid("qwen3_5", seed=3)
    hybrid_bench.make_decisive(target)      # as the benchmark's targets: sampling at T 0.1 follows the argmax
    head = MTPDrafter(target.config).eval()
    ids_list = [torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(s))
                for s in range(2)]
    records = hybrid_bench.bench_shape("tiny", target, {"mtp": head}, ids_list, n_new=12, stock_prompts=1,
                                       noises=[0.0], sampling=sampling, methods=["chain"])
    chain, = [r for r in records if r["method"] == "chain"]
    # a random head alone is almost never right (tau ~1); the oracle's drafts are the target's continuation
    assert chain["tau"] > 2.5, chain
