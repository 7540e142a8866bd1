"""SpecLA's autoregressive loop (``generate(specla=True)``) and the fallback to it when speculation does not pay."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_gdn
from specla_hf.loop.policy import FallbackPolicy
from specla_hf.models import adapter_for
from test_cuda_graphs import emulate_graphs


@pytest.mark.parametrize("graphs", [False, True])
def test_autoregressive_loop_equals_stock_generate(graphs):
    """Greedy (the pipelined one-call-per-token path, with emulated CUDA graphs too), a logits processor, scores,
    and seeded sampling: the same tokens and scores as stock generate (same processors, one multinomial draw per
    token)."""
    model = tiny_gdn(seed=71)
    if graphs:
        emulate_graphs(model, "target")
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(71))
    for kwargs in (dict(), dict(repetition_penalty=1.4), dict(max_new_tokens=1)):
        call = dict(max_new_tokens=20, do_sample=False) | kwargs
        assert torch.equal(model.generate(ids, specla=True, **call), model.generate(ids, **call)), kwargs
        assert model.specla_stats.mode == "autoregressive" and model.specla_stats.tau == 1.0
    call = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True,
                output_logits=True)
    ours, stock = model.generate(ids, specla=True, **call), model.generate(ids, **call)
    assert torch.equal(ours.sequences, stock.sequences)
    for got, want in ((ours.scores, stock.scores), (ours.logits, stock.logits)):
        assert len(got) == len(want) == 12
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for seed in range(3):
        call = dict(max_new_tokens=15, do_sample=True, temperature=0.9, top_k=20)
        torch.manual_seed(seed)
        stock = model.generate(ids, **call)
        torch.manual_seed(seed)
        assert torch.equal(model.generate(ids, specla=True, **call), stock)


def test_speculation_that_does_not_pay_falls_back_losslessly(bad_drafter):
    """With the autoregressive step measured as (nearly) free, the loop falls back after the policy's warm-up steps and
    says why; measured as (nearly) endless, it speculates to the end. Output equals plain decoding either way."""
    model = tiny_gdn(seed=72)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(72))
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    target = adapter_for(model)
    for ar_seconds, mode in ((1e-9, "autoregressive"), (1e9, "speculative")):
        target.ar_step_seconds = ar_seconds
        for tree in (False, True):
            spec = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=bad_drafter, tree=tree,
                                  confidence_threshold=0.0, autoregressive_fallback=True)
            stats = model.specla_stats
            assert torch.equal(spec, plain) and stats.mode == mode, (ar_seconds, tree)
            warmup = FallbackPolicy(ar_seconds).warmup
            if mode == "autoregressive":
                assert stats.speculative_steps == warmup and stats.steps > warmup
                assert stats.mode_reason.startswith(f"fell back after {warmup} speculative steps: speculation cost")
            else:
                assert stats.speculative_steps == stats.steps and "autoregressive step" in stats.mode_reason
    # sampling falls back the same way, through the processors
    target.ar_step_seconds = 1e-9
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=30, do_sample=True, temperature=0.8, assistant_model=bad_drafter,
                         autoregressive_fallback=True)
    assert out.shape == (1, 36) and model.specla_stats.mode == "autoregressive"


def test_the_autoregressive_step_is_measured_once_per_adapter():
    model = tiny_gdn(seed=73)
    target = adapter_for(model)
    target.ar_step_seconds = None
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=5, do_sample=False, assistant_model=tiny_gdn(seed=73),
                   autoregressive_fallback=True)
    measured = target.ar_step_seconds
    assert measured is not None and 0 < measured < 1.0
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=5, do_sample=False, assistant_model=tiny_gdn(seed=73),
                   autoregressive_fallback=True)
    assert target.ar_step_seconds == measured


def test_policy_judges_recent_steps_by_their_median():
    policy = FallbackPolicy(ar_seconds=1.0, warmup=3, window=4)
    for seconds, tokens in ((50.0, 1), (2.0, 4), (2.0, 4)):   # a first step that captured graphs does not decide
        policy.observe(seconds, tokens)
    assert policy.verdict() is None and policy.seconds_per_token() == pytest.approx(2.0 / 3)
    for _ in range(4):
        policy.observe(6.0, 3)                                 # 2 s a token against 1 s: fall back
    assert policy.verdict().startswith("speculation cost 2000.00 ms a token at tau 3.00")
