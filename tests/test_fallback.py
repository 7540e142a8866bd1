"""SpecLA's autoregressive loop (``generate(specla=True)``) and the fallback to it when speculation does not pay."""
from __future__ import annotations

import re
import statistics

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from conftest import tiny_gdn
from specla_hf.generation import draft_options, make_drafter
from specla_hf.loop.policy import (HISTORY, MAX_BACKOFF, FallbackMemory, FallbackPolicy, clear_speculation_memory,
                                   memory_key)
from specla_hf.models import adapter_for
from test_cuda_graphs import emulate_graphs


def ar_seconds(monkeypatch, seconds: float) -> None:
    """Make the autoregressive step measure ``seconds`` under every sampling rule."""
    from specla_hf.loop import decode
    monkeypatch.setattr(decode, "ar_step_seconds", lambda *args: seconds)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("vocab", [97, 40000])
def test_sampled_autoregressive_step_on_cuda_draws_as_stock(vocab, monkeypatch):
    """On a GPU, sampling with row-wise processors runs as one CUDA graph per token, the draw inside it and the
    warpers as kernels (one row at 97 entries, slices at 40000): a seeded run draws stock generate's tokens, its
    first call (which captures) included."""
    from specla_kernels import ops
    warps, warped_probs = [], ops.warped_probs
    monkeypatch.setattr(ops, "warped_probs", lambda *args: warps.append(args) or warped_probs(*args))
    model = tiny_gdn(seed=73, vocab=vocab).cuda()
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(73)).cuda()
    for seed, warpers in enumerate([dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20, top_p=0.95),
                                    dict(temperature=1.0, top_k=50)]):
        call = dict(max_new_tokens=24, do_sample=True, **warpers)
        torch.manual_seed(seed)
        stock = model.generate(ids, **call)
        torch.manual_seed(seed)
        assert torch.equal(model.generate(ids, specla=True, **call), stock), (seed, warpers)
    assert [k for k in adapter_for(model).graphs.calls if k[0] == "ar step" and len(k) > 1]
    assert warps, "the warpers did not run as kernels"


def test_speculation_that_does_not_pay_falls_back_losslessly(bad_drafter, monkeypatch):
    """With the autoregressive step measured as (nearly) free, the loop falls back after the policy's warm-up steps and
    says why; measured as (nearly) endless, it speculates to the end. Output equals plain decoding either way."""
    model = tiny_gdn(seed=72)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(72))
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    for seconds, mode in ((1e-9, "autoregressive"), (1e9, "speculative")):
        ar_seconds(monkeypatch, seconds)
        for tree in (False, True):
            spec = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=bad_drafter, tree=tree,
                                  confidence_threshold=0.0, autoregressive_fallback=True)
            stats = model.specla_stats
            assert torch.equal(spec, plain) and stats.mode == mode, (seconds, tree)
            warmup = FallbackPolicy(seconds).warmup
            if mode == "autoregressive":
                assert stats.speculative_steps == warmup and stats.steps > warmup
                assert stats.mode_reason.startswith(f"fell back after {warmup} speculative steps: speculation cost")
            else:
                assert stats.speculative_steps == stats.steps and "autoregressive step" in stats.mode_reason
    # sampling falls back the same way, through the processors
    ar_seconds(monkeypatch, 1e-9)
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=30, do_sample=True, temperature=0.8, assistant_model=bad_drafter,
                         autoregressive_fallback=True)
    assert out.shape == (1, 36) and model.specla_stats.mode == "autoregressive"


def test_the_autoregressive_step_is_measured_once_per_adapter_and_sampling_rule():
    """The fallback compares speculation with the step it would run: greedy, or the sampled step of the call's
    row-wise processors; each is measured once per adapter."""
    model = tiny_gdn(seed=73)
    target = adapter_for(model)
    ids = torch.tensor([[3, 4, 5]])
    calls = [dict(do_sample=False), dict(do_sample=True, temperature=0.8), dict(do_sample=False),
             dict(do_sample=True, temperature=0.8)]
    for call in calls:
        model.generate(ids, max_new_tokens=5, assistant_model=tiny_gdn(seed=73), autoregressive_fallback=True, **call)
        if call is calls[1]:
            measured = dict(target._ar_step_seconds)
    assert target._ar_step_seconds == measured and len(measured) == 2
    assert all(0 < s < 1.0 for s in measured.values())


def test_policy_judges_recent_steps_by_their_median():
    policy = FallbackPolicy(ar_seconds=1.0, warmup=3, window=4)
    for seconds, tokens in ((50.0, 1), (2.0, 4), (2.0, 4)):   # a first step that captured graphs does not decide
        policy.observe(seconds, tokens)
    assert policy.verdict() is None and policy.seconds_per_token() == pytest.approx(2.0 / 3)
    for _ in range(6):
        policy.observe(6.0, 2)                                 # 3 s a token against 1 s: fall back
    assert policy.verdict().startswith("speculation cost 3000.00 ms a token at tau 2.00")


def modes(model, drafter, ids, calls: int, **kwargs) -> list[str]:
    """Each call's mode as the loop reports it: 'ar' (autoregressive from the start), 'fell back after N', or
    'speculated'; every output is checked against plain greedy decoding."""
    plain = model.generate(ids, max_new_tokens=30, do_sample=False)
    seen = []
    for _ in range(calls):
        out = model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                             confidence_threshold=0.0, autoregressive_fallback=True, **kwargs)
        stats = model.specla_stats
        assert torch.equal(out, plain)
        seen.append("ar" if stats.mode_reason.startswith("autoregressive from the start") else
                    f"fell back after {stats.speculative_steps}" if stats.mode == "autoregressive" else "speculated")
    return seen


def test_a_call_after_a_fallback_starts_autoregressive_and_says_why(bad_drafter, monkeypatch):
    """Once a call fell back, the next call with the same drafter and settings decodes autoregressively from its
    first step (no warm-up steps), says why and when it speculates again, and still equals plain decoding; the
    re-probe after it is judged, as every call, once it has made ``warmup`` steps of its own."""
    model = tiny_gdn(seed=74)
    ar_seconds(monkeypatch, 1e-9)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(74))
    assert modes(model, bad_drafter, ids, 1) == ["fell back after 4"]
    assert modes(model, bad_drafter, ids, 1) == ["ar"]
    stats = model.specla_stats
    assert stats.mode == "autoregressive" and stats.speculative_steps == 0 and stats.steps == 30
    assert re.fullmatch(r"autoregressive from the start: in earlier calls speculation cost [\d.]+ ms a token at tau "
                        r"[\d.]+, an autoregressive step 0.00 ms \(the last 4 speculative steps\); speculating again "
                        r"on the next call", stats.mode_reason), stats.mode_reason
    assert modes(model, bad_drafter, ids, 2) == ["fell back after 4", "ar"]
    assert model.specla_stats.mode_reason.endswith("speculating again after 1 more call")
    # autoregressive_fallback=False neither reads nor moves the memory
    model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=bad_drafter, confidence_threshold=0.0,
                   autoregressive_fallback=False)
    assert model.specla_stats.mode == "speculative" and model.specla_stats.mode_reason == ""
    assert modes(model, bad_drafter, ids, 2) == ["ar", "fell back after 4"]


def test_the_memory_is_kept_per_drafter_draft_shape_and_sampling_rule(bad_drafter, monkeypatch):
    """A fallback with one drafter and settings is not inherited by another drafter, another draft shape or other
    sampling settings (each pays its own warm-up), and ``clear_speculation_memory`` forgets it."""
    model = tiny_gdn(seed=75)
    target = adapter_for(model)
    ar_seconds(monkeypatch, 1e-9)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(75))
    assert modes(model, bad_drafter, ids, 1) == ["fell back after 4"]
    assert modes(model, tiny_gdn(seed=76, hidden=32, layers=1), ids, 1) == ["fell back after 4"]
    assert modes(model, bad_drafter, ids, 1, tree=True) == ["fell back after 4"]
    for temperature in (0.8, 0.9):
        model.generate(ids, max_new_tokens=30, do_sample=True, temperature=temperature, assistant_model=bad_drafter,
                       confidence_threshold=0.0, autoregressive_fallback=True)
        assert model.specla_stats.speculative_steps == 4, temperature
    assert modes(model, bad_drafter, ids, 1) == ["ar"]
    clear_speculation_memory(target)
    assert modes(model, bad_drafter, ids, 1) == ["fell back after 4"]


def test_the_back_off_doubles_and_speculation_that_pays_resets_it(bad_drafter, monkeypatch):
    """Autoregressive calls between re-probes: 1, 2, 4; then with the autoregressive step measured as (nearly)
    endless, speculation pays at once and is kept to the end, which resets the back-off to 1 call."""
    model = tiny_gdn(seed=77)
    ar_seconds(monkeypatch, 1e-9)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(77))
    probe = ["fell back after 4"]
    assert modes(model, bad_drafter, ids, 10) == ["fell back after 4", "ar", *probe, "ar", "ar", *probe, *["ar"] * 4]
    ar_seconds(monkeypatch, 1e9)
    assert modes(model, bad_drafter, ids, 1) == ["speculated"]
    ar_seconds(monkeypatch, 1e-9)
    assert modes(model, bad_drafter, ids, 3) == [*probe, "ar", *probe]


def simulated_call(memory: FallbackMemory, ar_seconds: float, steps: list[tuple[float, int]]) -> str:
    """One call as ``speculative_decode`` drives the policy, over synthetic (seconds, tokens) steps."""
    policy = FallbackPolicy(ar_seconds, memory)
    if policy.start_autoregressive() is not None:
        return "ar"
    for n, (seconds, tokens) in enumerate(steps, 1):
        policy.observe(seconds, tokens)
        if policy.verdict() is not None:
            policy.settle(fell_back=True)
            return f"fell back after {n}"
    policy.settle(fell_back=False)
    return "speculated"


def test_policy_backs_off_up_to_its_cap_and_resets_when_speculation_pays():
    memory = FallbackMemory()
    losing, paying = [(3.0, 1)] * 10, [(1.0, 4)] * 10           # 3 s and 0.25 s a token against a 1 s step
    seen = [simulated_call(memory, 1.0, losing) for _ in range(1 + 2 + 3 + 5 + 9 + 17 + 17)]
    probe = ["fell back after 4"]
    assert seen == ["fell back after 4", "ar", *probe, *["ar"] * 2, *probe, *["ar"] * 4, *probe, *["ar"] * 8,
                    *probe, *["ar"] * 16, *probe, *["ar"] * MAX_BACKOFF, *probe]
    # the back-off skips calls only while the remembered steps lose against the current autoregressive step
    assert memory.skip == MAX_BACKOFF and simulated_call(memory, 4.0, []) == "speculated"
    assert memory.skip == MAX_BACKOFF and simulated_call(memory, 1.0, []) == "ar"
    # a re-probe whose own steps pay keeps speculating though the history loses, and resets the back-off
    memory.skip = 0
    assert simulated_call(memory, 1.0, paying) == "speculated" and (memory.backoff, memory.skip) == (0, 0)
    # a call that ends before it is judged (no step observed) leaves the back-off as it was
    memory.backoff = memory.skip = 4
    assert simulated_call(memory, 2.0, []) == "speculated" and (memory.backoff, memory.skip) == (4, 4)


def test_policy_judges_a_call_by_warmup_steps_of_its_own_with_the_remembered_ones():
    """A losing history and an unlucky first step do not end a call: one step keeps 1 to 8 tokens at tau 2-4."""
    memory = FallbackMemory(steps=[(3.0, 1)] * 8)
    policy = FallbackPolicy(1.0, memory)
    assert policy.verdict() is None                         # no step of its own yet
    for _ in range(policy.warmup - 1):
        policy.observe(3.0, 1)
        assert policy.verdict() is None                     # too few of its own
    policy.observe(3.0, 1)
    assert policy.verdict().startswith("speculation cost 3000.00 ms a token at tau 1.00")
    # a call that pays after an unlucky first step keeps speculating, the losing history notwithstanding
    unlucky_then_paying = [(3.0, 1)] + [(1.0, 4)] * 9
    assert simulated_call(FallbackMemory(steps=[(3.0, 1)] * 8), 1.0, unlucky_then_paying) == "speculated"
    for _ in range(HISTORY):
        policy.observe(1.0, 4)
    assert len(memory.steps) == HISTORY                     # the memory keeps the back-off's evidence only


def test_a_call_that_pays_overall_outlasts_a_losing_window():
    """Steps keep 1 to 8 tokens at tau 2-3, so an 8-step window tested at every step loses by chance sooner or
    later: a call falls back only when all its own steps together lose too."""
    paying, unlucky = [(1.0, 3)] * 20, [(1.2, 1)] * 8                # 0.33 s, then 1.2 s a token against 1 s
    assert simulated_call(FallbackMemory(), 1.0, paying + unlucky) == "speculated"
    assert simulated_call(FallbackMemory(), 1.0, paying[:2] + [(3.0, 1)] * 8) == "fell back after 7"


def chain_steps(generator: torch.Generator, accept: float, seconds: float, n: int) -> list[tuple[float, int]]:
    """``n`` steps of ``seconds`` whose drafts are each accepted with probability ``accept`` until the first
    rejection (at most 7 drafts): 1 to 8 tokens a step, tau ~ 1 / (1 - accept)."""
    draws = torch.rand(n, 7, generator=generator) < accept
    return [(seconds, 1 + int(row.cumprod(0).sum())) for row in draws]


def test_a_call_is_ended_only_when_speculation_loses_beyond_its_spread():
    """At tau ~2.6 where a step must keep 2.07 tokens to pay (~1.26x autoregressive decoding, sampling at T 1.0 on an
    H100), few calls are ended by unlucky steps; at 0.75x nearly every call falls back, and at 0.5x (a step costing 5
    autoregressive steps, this CPU's kind of loss) every call, early."""
    generator = torch.Generator().manual_seed(0)

    def calls(accept: float, seconds: float) -> tuple[int, list[int]]:
        modes = [simulated_call(FallbackMemory(), 1.0, chain_steps(generator, accept, seconds, 48)) for _ in range(200)]
        ends = [int(mode.rsplit(" ", 1)[1]) for mode in modes if mode.startswith("fell back")]
        return len(ends), ends
    assert calls(0.63, 2.07)[0] <= 10
    fell, ends = calls(0.35, 2.07)
    assert fell >= 180 and statistics.median(ends) <= 16
    fell, ends = calls(0.63, 5.0)
    assert fell == 200 and statistics.median(ends) <= 10


def test_a_losing_prompt_does_not_hold_back_the_next_while_speculation_pays_over_calls():
    """Prompts differ in acceptance: after a call that fell back, the next starts speculating while the remembered
    steps of earlier calls pay overall, and autoregressively once they lose clearly."""
    memory = FallbackMemory()
    assert simulated_call(memory, 1.0, [(2.0, 4)] * 30) == "speculated"        # 0.5 s a token against 1 s
    # its recent window holds the call before's last paying steps: one step more
    assert simulated_call(memory, 1.0, [(3.0, 1)] * 10) == "fell back after 5"
    assert memory.skip == 1 and simulated_call(memory, 1.0, [(2.0, 4)] * 30) == "speculated"
    for _ in range(20):
        simulated_call(memory, 1.0, [(3.0, 1)] * 30)
    assert simulated_call(memory, 1.0, [(2.0, 4)] * 30) == "ar"


def test_memory_key_tells_drafters_shapes_and_sampling_apart(bad_drafter):
    model = tiny_gdn(seed=78)
    chain, tree = (make_drafter(model, bad_drafter, draft_options(tree=t)) for t in (False, True))
    sampling = lambda t, k: LogitsProcessorList([TemperatureLogitsWarper(t), TopKLogitsWarper(k)])   # noqa: E731
    assert memory_key(chain, sampling(0.7, 20), True) == memory_key(chain, sampling(0.7, 20), True)
    keys = {memory_key(chain, LogitsProcessorList(), False), memory_key(tree, LogitsProcessorList(), False),
            memory_key(chain, LogitsProcessorList(), True), memory_key(chain, sampling(0.7, 20), True),
            memory_key(chain, sampling(0.8, 20), True), memory_key(chain, sampling(0.7, 50), True)}
    assert len(keys) == 6
