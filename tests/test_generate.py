"""generate(assistant_model=...) is lossless: greedy token-identical, sampling distribution-identical."""
import copy

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper
from transformers import MaxLengthCriteria, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from conftest import CollectStreamer, tiny_gdn
from specla_hf import GDNDrafter, GDNRunner, speculative_decode
from specla_hf.generation import draft_options


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("draft", ["perfect", "bad"])
def test_greedy_identical_to_plain(target, bad_drafter, tree, draft):
    drafter = target if draft == "perfect" else bad_drafter
    gen = torch.Generator().manual_seed(11)
    for trial in range(12):
        n_prompt = int(torch.randint(1, 30, (), generator=gen))
        n_new = int(torch.randint(1, 40, (), generator=gen))
        ids = torch.randint(0, 97, (1, n_prompt), generator=gen)
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                               confidence_threshold=0.0)
        assert spec.shape == plain.shape, (trial, n_prompt, n_new)
        assert torch.equal(spec, plain), (trial, n_prompt, n_new)
    if draft == "perfect":   # a perfect drafter is accepted in full (in the configured shape, not the policy's)
        target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, tree=tree,
                        confidence_threshold=0.0, adaptive_drafting=False)
        assert target.specla_stats.tau > 2


@pytest.mark.parametrize("shape", [dict(v_heads=4), dict(conv=False), dict(neg_eig=True, gate=False)])
def test_greedy_identical_other_shapes(shape, bad_drafter):
    model = tiny_gdn(seed=21, **shape)
    ids = torch.randint(0, 97, (1, 7))
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    for drafter, tree in ((model, False), (model, True), (bad_drafter, True)):
        spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter, tree=tree,
                              confidence_threshold=0.0)
        assert torch.equal(spec, plain)


def test_target_called_once_per_verify_step(target):
    drafter = copy.deepcopy(target)      # a perfect drafter, as a separate module so the hook counts the target only
    calls = []
    hook = target.model.embeddings.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    try:
        ids = torch.randint(0, 97, (1, 12))
        target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, confidence_threshold=0.0)
    finally:
        hook.remove()
    stats = target.specla_stats
    assert len(calls) == stats.target_calls == stats.steps + 1          # prefill + one pass per step
    assert calls[0] == 11                                               # the prompt but its last token
    # every verify pass carries exactly the pending token plus the drafts: no accepted token is run again
    assert calls[1:] == [n + 1 for n in stats.draft_nodes]
    assert sum(calls) == 11 + sum(stats.draft_nodes) + stats.steps


def test_eos_inside_accepted_block_stops_where_plain_does():
    model = tiny_gdn(seed=3)
    ids = torch.randint(0, 97, (1, 5))
    free = model.generate(ids, max_new_tokens=30, do_sample=False)
    eos = int(free[0, 5 + 7])          # the 8th generated token becomes EOS: it sits inside an accepted block
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    plain = model.generate(ids, max_new_tokens=30, do_sample=False)
    spec = model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=model, confidence_threshold=0.0)
    assert torch.equal(spec, plain)
    assert spec[0, -1] == eos and (spec[0, 5:-1] != eos).all()
    assert model.specla_stats.accepted[-1] > 0       # the stop happened within a block of accepted drafts


def test_custom_stopping_criterion_and_exact_max_new_tokens(target):
    class StopAfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])          # a user criterion may keep state
            return input_ids[:, -1] == self.token

    ids = torch.randint(0, 97, (1, 4))
    free = target.generate(ids, max_new_tokens=20, do_sample=False)
    stop = StopAfterToken(int(free[0, 4 + 5]))
    crit = StoppingCriteriaList([stop])
    stop.seen = []
    plain = target.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=crit)
    seen_plain, stop.seen = stop.seen, []
    spec = target.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=crit, assistant_model=target,
                           confidence_threshold=0.0)
    assert torch.equal(plain, spec)
    # it sees each prefix once, in order, and nothing past the stop: as plain decoding calls it
    assert stop.seen == seen_plain == list(range(5, plain.shape[1] + 1))
    for n in (1, 2, 7, 13):
        out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=target, confidence_threshold=0)
        assert out.shape[1] == 4 + n


def test_streamer_gets_the_same_tokens(target, bad_drafter):
    ids = torch.randint(0, 97, (1, 6))
    plain_s, spec_s = CollectStreamer(), CollectStreamer()
    target.generate(ids, max_new_tokens=15, do_sample=False, streamer=plain_s)
    target.generate(ids, max_new_tokens=15, do_sample=False, streamer=spec_s, assistant_model=bad_drafter)
    assert spec_s.tokens == plain_s.tokens
    assert spec_s.chunks[0] == ids[0].tolist() and spec_s.ended


def test_return_dict_scores_and_stats(target):
    ids = torch.randint(0, 97, (1, 6))
    plain = target.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True,
                            output_scores=True, output_logits=True)
    spec = target.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_scores=True,
                           output_logits=True, assistant_model=target, confidence_threshold=0.0)
    assert torch.equal(plain.sequences, spec.sequences)
    assert len(spec.scores) == len(plain.scores) == 9
    for a, b in zip(plain.logits, spec.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    stats = spec.specla_stats
    assert stats.new_tokens == 9 and stats.steps >= 1 and stats.tau == pytest.approx(9 / stats.steps)
    assert stats.draft_time > 0 and stats.verify_time > 0


def test_adaptive_drafting_shrinks_on_rejection(target, bad_drafter):
    ids = torch.randint(0, 97, (1, 6))
    target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=bad_drafter, draft_depth=8,
                    confidence_threshold=0.0)
    nodes = target.specla_stats.draft_nodes
    assert nodes[0] == 8 and min(nodes) < 8


# ---------------------------------------------------------------------------------------------------------------
# sampling: chi-square goodness of fit against the target's exact distributions
# ---------------------------------------------------------------------------------------------------------------
def _exact_first_two(model, ids, processors):
    """Exact law of (x1, x2) under plain sampling with the same processors."""
    with torch.no_grad():
        l1 = processors(ids, model(ids).logits[:, -1].float())
        p1 = l1.softmax(-1)[0]
        seqs = torch.cat([ids.expand(p1.numel(), -1), torch.arange(p1.numel(), device=ids.device)[:, None]], 1)
        l2 = model(seqs).logits[:, -1].float()
        p2 = torch.stack([processors(seqs[i:i + 1], l2[i:i + 1])[0] for i in range(p1.numel())]).softmax(-1)
    return p1, p2


def _chisq_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare
    n = counts.sum()
    probs = probs.double() / probs.double().sum()          # scipy wants the totals equal to ~1e-8
    keep = probs * n >= 5            # pool tiny cells
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    exp = torch.cat([probs[keep] * n, (probs[~keep] * n).sum()[None]]).double()
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _sample_counts(runner, new_drafter, ids, draws, processors) -> tuple[torch.Tensor, torch.Tensor, int, set]:
    """Draw (x1, x2) ``draws`` times with the loop generate() runs on the adapter ``runner``, a fresh drafter from
    ``new_drafter()`` each time (called directly: thousands of generate() calls cost minutes on CPU): the counts of
    x1, of the pair (x1 * V + x2), the draft tokens accepted over all draws, and where the steps accepted
    (``SpecLAStats.acceptance``). Callers fix the tree shapes (``adaptive_drafting=False``): the shape policy
    chooses by measured time, another shape draws other random numbers, and the p-values would change run to run."""
    V = runner.config.vocab_size
    c1, c12, accepted, where = torch.zeros(V), torch.zeros(V * V), 0, set()
    stop = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 2)])
    for _ in range(draws):
        out, stats, *_ = speculative_decode(runner, new_drafter(), ids, processors, stop, do_sample=True,
                                            max_length=ids.shape[1] + 2)
        x1, x2 = out[0, -2].item(), out[0, -1].item()
        c1[x1] += 1
        c12[x1 * V + x2] += 1
        accepted += sum(stats.accepted)
        where.add(stats.acceptance)
    return c1, c12, accepted, where


def test_generate_samples_through_the_same_loop(target, bad_drafter):
    """generate(do_sample=True, assistant_model=...) is that loop with transformers' processors (same seed, same
    tokens), so the statistical tests below cover it. Fixed tree shapes on both sides: the shape policy chooses by
    measured time, and another shape draws other random numbers."""
    for ids in (torch.tensor([[48, 27, 85, 52, 29]]),
                torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))):
        torch.manual_seed(7)
        via_generate = target.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.7, top_k=20,
                                       assistant_model=bad_drafter, tree=True, confidence_threshold=0.0,
                                       adaptive_drafting=False)
        torch.manual_seed(7)
        procs = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])
        options = draft_options(tree=True, confidence_threshold=0.0, adaptive_drafting=False)
        direct, *_ = speculative_decode(GDNRunner(target), GDNDrafter(bad_drafter, options), ids, procs,
                                        StoppingCriteriaList([MaxLengthCriteria(17)]), do_sample=True, max_length=17)
        assert torch.equal(via_generate, direct), ids


@pytest.mark.parametrize("tree, acceptance, sampled, top_p, ratio", [
    (False, "device", True, 1.0, None), (True, "device", True, 1.0, 1.6), (True, "device", True, 0.85, None),
    (False, "host", True, 1.0, None), (True, "host", True, 1.0, 0.6), (True, "host", False, 1.0, None)])
def test_sampling_is_lossless(tree, acceptance, sampled, top_p, ratio):
    """5000 draws of (x1, x2) on a vocabulary of 8: the test detects a 2% shift of probability mass (see below).
    Temperature, top-k and top-p treat each row alone: the device loop accepts (``sample_accept``); a repetition
    penalty reads each node's sequence: the host walks the tree (``accept_path``). Drafts sampled from the drafter
    (the default; also drawn hotter and colder than the target, ``draft_temperature_ratio``) and drafts of highest
    log-prob (``sampled_drafts=False``; on the device, the rule's own test below)."""
    torch.manual_seed(1234)
    target = tiny_gdn(seed=30, vocab=8, hidden=32, head_dim=8)
    drafter = tiny_gdn(seed=31, vocab=8, hidden=32, head_dim=8, layers=1)
    ids = torch.tensor([[1, 5, 2]])
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)]
                                + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
                                + ([RepetitionPenaltyLogitsProcessor(1.5)] if acceptance == "host" else []))
    p1, p2 = _exact_first_two(target, ids, procs)
    options = draft_options(tree=tree, tree_topk=3 if tree else None, confidence_threshold=0.0,
                            sampled_drafts=sampled, adaptive_drafting=False, draft_temperature_ratio=ratio)
    c1, c12, _, where = _sample_counts(GDNRunner(target), lambda: GDNDrafter(drafter, options), ids, 5000, procs)
    assert where == {acceptance}
    assert _chisq_pvalue(c1, p1) > 1e-3
    assert _chisq_pvalue(c12, (p1[:, None] * p2).flatten()) > 1e-3
    # power: moving 2% of the mass between two likely tokens must be caught at this sample size (2.5% under top-p,
    # whose nucleus leaves fewer, likelier tokens)
    shift = 0.02 if top_p == 1.0 else 0.025
    a, b = p1.topk(2).indices
    expected_stat = 5000 * (shift ** 2 / p1[a] + shift ** 2 / p1[b])
    assert expected_stat > 20          # chi-square noncentrality well past the 1e-3 critical value (~24 at df 7)


@pytest.mark.parametrize("acceptance", ["device", "host"])
def test_sampled_drafts_from_the_targets_own_law_are_accepted(target, acceptance):
    """A drafter with the target's law, sampling at temperature 1 (a random model: near-uniform laws). Sampled drafts
    are accepted with probability min(1, p / q) = 1 up to rounding, so every step keeps its whole chain; drafts of
    highest log-prob are accepted with the target's probability of each, rarely. On the device loop and the host
    walk (a repetition penalty of 1, which changes nothing but is not row-wise). Drawn at a fiftieth of the target's
    temperature (``draft_temperature_ratio``), the drafts follow another law, nearly the drafter's argmax, and are
    accepted as rarely as the top-k drafts."""
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(8))
    penalty = (dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.0)]))
               if acceptance == "host" else {})
    tau = {}
    for rule, drafting in (("drawn", {}), ("top-k", dict(sampled_drafts=False)),
                           ("drawn colder", dict(draft_temperature_ratio=0.02))):
        torch.manual_seed(2)
        target.generate(ids, max_new_tokens=41, do_sample=True, temperature=1.0, assistant_model=target,
                        draft_depth=4, confidence_threshold=0.0, adaptive_drafting=False,
                        autoregressive_fallback=False, **drafting, **penalty)
        tau[rule] = target.specla_stats.tau
        assert target.specla_stats.acceptance == acceptance
    assert tau["drawn"] > 4.5 and tau["top-k"] < 1.5 and tau["drawn colder"] < 1.5, tau


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_p", [1.0, 0.85])
def test_sampling_is_lossless_on_cuda(top_p):
    """The device loop's sampling as the GPU runs it: the acceptance, its random draws and the drafter's catch-up in
    one CUDA graph per tree bucket, replayed (each replay draws afresh); the warpers in the row kernel, with and
    without top-p; 3000 draws, fp32, as on CPU."""
    torch.manual_seed(1234)
    target = tiny_gdn(seed=30, vocab=8, hidden=32, head_dim=8).cuda()
    drafter = tiny_gdn(seed=31, vocab=8, hidden=32, head_dim=8, layers=1).cuda()
    ids = torch.tensor([[1, 5, 2]], device="cuda")
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)]
                                + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
    p1, p2 = _exact_first_two(target, ids, procs)
    options = draft_options(tree=True, tree_topk=3, confidence_threshold=0.0, adaptive_drafting=False)
    runner = GDNRunner(target)
    assert runner.graphs is not None
    c1, c12, _, where = _sample_counts(runner, lambda: GDNDrafter(drafter, options), ids, 3000, procs)
    assert where == {"device"}
    assert _chisq_pvalue(c1, p1.cpu()) > 1e-3
    assert _chisq_pvalue(c12, (p1[:, None] * p2).flatten().cpu()) > 1e-3


@pytest.mark.parametrize("acceptance", ["device", "host"])
def test_a_wrong_acceptance_rule_fails_the_sampling_test(monkeypatch, acceptance):
    """The statistical test has teeth: accepting drafts too eagerly (min(1, 2p)) is detected, on the device and on
    the host (a repetition penalty of 1, which changes nothing, takes the host walk)."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k) / 2)
    target = tiny_gdn(seed=30, vocab=8, hidden=32, head_dim=8)
    drafter = tiny_gdn(seed=31, vocab=8, hidden=32, head_dim=8, layers=1)
    ids = torch.tensor([[1, 5, 2]])
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.0)] if acceptance == "host" else [])
    p1, _ = _exact_first_two(target, ids, procs)
    options = draft_options(tree=False, confidence_threshold=0.0, adaptive_drafting=False)
    torch.manual_seed(99)                 # after the models (``tiny_gdn`` seeds): the draws' seed
    c1, _, _, where = _sample_counts(GDNRunner(target), lambda: GDNDrafter(drafter, options), ids, 2000, procs)
    assert where == {acceptance}
    assert _chisq_pvalue(c1, p1) < 1e-3


def test_tree_padding_buckets_are_inert(bad_drafter):
    """With CUDA graphs, trees are padded to power-of-two buckets with dummy nodes: outputs must not change."""
    model = tiny_gdn(seed=41)
    ids = torch.randint(0, 97, (1, 6))
    plain = model.generate(ids, max_new_tokens=30, do_sample=False)
    for role, m in (("target", model), ("drafter", bad_drafter), ("drafter", model)):
        GDNRunner.for_model(m, role).bucket_trees = True
    try:
        for drafter in (model, bad_drafter):
            spec = model.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, tree=True,
                                  tree_budget=11, confidence_threshold=0.0)
            assert torch.equal(spec, plain)
        assert model.specla_stats.tau > 1.0 or drafter is bad_drafter
    finally:
        for role, m in (("target", model), ("drafter", bad_drafter), ("drafter", model)):
            GDNRunner.for_model(m, role).bucket_trees = False


@pytest.mark.parametrize("tree", [False, True])
def test_gdn_drafter_takes_the_device_loop(target, bad_drafter, tree, monkeypatch):
    """A plain GDN drafter with no confidence threshold runs the device loop (its ``catch_up``: a chain verify of the
    emitted tokens): greedy output equals plain decoding for a perfect and a bad drafter, and its cache has consumed
    exactly the positions the target committed."""
    from specla_hf.loop import decode
    used = []
    init = decode.DeviceDriver.__init__
    monkeypatch.setattr(decode.DeviceDriver, "__init__", lambda self, *a, **k: used.append(1) or init(self, *a, **k))
    gen = torch.Generator().manual_seed(5)
    for drafter in (copy.deepcopy(target), bad_drafter):
        ids = torch.randint(0, 97, (1, int(torch.randint(2, 20, (), generator=gen))), generator=gen)
        n_new = 33
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        options = draft_options(tree=tree, confidence_threshold=0.0)
        gdn = GDNDrafter(drafter, options)
        seq, stats, _, _ = speculative_decode(GDNRunner(target), gdn, ids, LogitsProcessorList(),
                                              StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + n_new)]),
                                              False, ids.shape[1] + n_new)
        assert torch.equal(seq, plain)
        committed = ids.shape[1] + sum(a + 1 for a in stats.accepted)    # the prompt, each step's path, the root
        assert gdn.consumed == committed and gdn.cache.num_pending == 0
        if drafter is not bad_drafter:                      # the catch-up's root log-probs drive the drafts
            assert stats.tau > 2
    assert len(used) == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_default_chain_prunes_on_a_cpu_and_drafts_unpruned_on_the_device_loop_elsewhere(target, device):
    """``generate``'s default chain: on a CPU its confidence threshold ends drafting at an unconfident depth, which
    the host selects; on a GPU no threshold, so the chain runs in the device loop like the tree. Both lossless."""
    model = copy.deepcopy(target).to(device)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(4)).to(device)
    n = ids.shape[1] + 24
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_length=n, do_sample=False)
    drafter = copy.deepcopy(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_length=n, do_sample=False,
                         assistant_model=drafter)
    assert torch.equal(out, plain)
    assert model.specla_stats.acceptance == ("host" if device == "cpu" else "device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_device_loop_verifies_ahead_and_discards_what_a_stop_leaves(target, device, monkeypatch):
    """The device loop queues each next verify pass before the host reads a step's tokens, except where the step may
    reach the length limit: a call stopped by its length verifies once per step; a call stopped by a criterion the
    loop cannot foresee verifies once more and discards that pass (nothing pending) and emits exactly the first
    call's tokens up to the stop; on a CPU both equal plain decoding. The proposal the last step launches is no
    deeper than the length limit leaves room for. On a GPU the verify passes, the step tails and the drafting are
    graph replays; the drafter's perfect copy and the configured shape make the two calls' steps the same."""
    from specla_hf.loop import decode
    model = copy.deepcopy(target).to(device)
    drafter_model = copy.deepcopy(model)            # copied before the target's runner fuses its weights
    runner, caches, verified = GDNRunner(model), [], []
    assert (runner.graphs is not None) == (device == "cuda")
    new_cache, verify = runner.new_cache, decode.verify
    runner.new_cache = lambda *args: caches.append(new_cache(*args)) or caches[-1]
    # the loop's verify passes (a graphed runner consumes a prompt as verified chains too)
    monkeypatch.setattr(decode, "verify", lambda *a: verified.append(1) or verify(*a))
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(9)).to(device)
    stop_at = ids.shape[1] + 17

    class StopAtLength(StoppingCriteria):        # fires where the loop's own length limit does not
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((1,), input_ids.shape[1] >= stop_at, device=input_ids.device)
    outputs = []
    options = draft_options(tree=True, confidence_threshold=0.0, adaptive_drafting=False)
    for criteria, ahead in ((MaxLengthCriteria(ids.shape[1] + 40), 0), (StopAtLength(), 1)):
        verified.clear()
        drafter = GDNDrafter(drafter_model, options)
        seq, stats, _, _ = speculative_decode(runner, drafter, ids, LogitsProcessorList(),
                                              StoppingCriteriaList([criteria]), False, ids.shape[1] + 40)
        assert stats.acceptance == "device"
        assert sum(verified) == stats.steps + ahead and caches[-1].num_pending == 0
        # the proposal launched by the last step drafts no deeper than one more token would leave room for
        before_last = sum(stats.accepted[:-1]) + stats.steps - 1          # tokens emitted before the last step
        assert drafter.launched_depths == min(options.depth, max(1, 40 - before_last - 2))
        outputs.append(seq)
    assert outputs[1].shape[1] == stop_at and torch.equal(outputs[1], outputs[0][:, :stop_at])
    if device == "cpu":
        assert torch.equal(outputs[0], target.generate(ids, max_new_tokens=40, do_sample=False))


def _random_tree(n: int, vocab: int, gen: torch.Generator, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of ``n`` nodes plus ``pad`` inert padding nodes (parent -1, as the runner pads buckets); tokens
    from a small vocabulary, so siblings often share one (the host walk takes the first)."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)] + [-1] * pad
    return torch.randint(0, vocab, (n + pad,), generator=gen), torch.tensor(parents)


def test_greedy_accept_is_the_host_walk():
    """The device acceptance of the device loop picks the node, path and tokens ``accept_path`` picks: random trees
    (chains, stars, bushy, with padding), argmax that often matches a child, twin siblings."""
    from specla_hf.drafters.base import DraftTree
    from specla_hf.loop.acceptance import accept_path, greedy_accept
    from specla_kernels.reference import tree_ancestors
    gen = torch.Generator().manual_seed(8)
    seen_lengths = set()
    for trial in range(300):
        n = int(torch.randint(1, 40, (), generator=gen))
        pad = int(torch.randint(0, 3, (), generator=gen))
        tokens, parents = _random_tree(n, 3, gen, pad)
        if trial % 5 == 0:
            parents[1:n] = torch.arange(n - 1)                  # a chain
        elif trial % 5 == 1:
            parents[1:n] = 0                                    # a star
        # each node's argmax: often one of its children's tokens
        argmax = torch.randint(0, 3, (n + pad,), generator=gen)
        tree = DraftTree(tokens[:n], parents[:n], torch.zeros(n))
        walk = accept_path(tree, None, None, LogitsProcessorList(), False, argmax[:n].tolist())
        node, emitted, path = walk.node, walk.emitted, walk.path
        cap = len(path) + int(torch.randint(0, 3, (), generator=gen))
        acc = greedy_accept(tokens, parents, tree_ancestors(parents[None])[0], argmax, cap)
        assert int(acc.node) == node and int(acc.length) == len(path), trial
        assert acc.path[:len(path)].tolist() == path and acc.emitted[:len(path)].tolist() == emitted, trial
        seen_lengths.add(len(path))
    assert len(seen_lengths) >= 5                              # deep acceptances were exercised, not only the root


def test_sample_accept_of_drawn_children_follows_the_target_law():
    """The device rule for sampled drafts alone (recursive rejection sampling): every trial draws the root's three
    children and each depth-1 node's two without replacement from the drafter's laws (Gumbel top-k, as drafting
    does), the target's law after a depth-1 node depending on its token; the first two emitted tokens (the second
    drawn after the bonus where the step keeps one) follow the target's joint law (15000 draws, chi-square). The
    drafter's laws are near the target's, so most trials accept drafts; under a rule that accepts a child twice as
    often as it should, the same test fails."""
    from specla_hf.loop.acceptance import sample_accept
    from specla_kernels.reference import tree_ancestors
    V = 5
    gen = torch.Generator().manual_seed(4)
    p_root, p_next = (torch.softmax(torch.randn(*shape, generator=gen) * 1.5, -1) for shape in ((V,), (V, V)))
    q_root = torch.softmax(p_root.log() + 0.5 * torch.randn(V, generator=gen), -1)
    q_next = torch.softmax(p_next.log() + 0.5 * torch.randn(V, V, generator=gen), -1)
    #        node: 0  1  2  3  4  5  6  7  8 (padding)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, -1])
    ancestors = tree_ancestors(parents[None])[0]

    def draw(q: torch.Tensor, k: int) -> torch.Tensor:
        return (q.log() - torch.empty(V).exponential_().log()).topk(k).indices

    def trial():
        tokens = torch.zeros(9, dtype=torch.long)
        tokens[1:4] = draw(q_root, 3)
        tokens[4:6], tokens[6:8] = draw(q_next[tokens[1]], 2), draw(q_next[tokens[2]], 2)
        # rows after the depth-2 nodes and the padding: read by nothing the test counts
        probs = torch.cat([p_root[None], p_next[tokens[1:8]], p_root[None]])
        drawn = torch.cat([q_root[None], q_next[tokens[1:8]], q_root[None]])
        return sample_accept(tokens, parents, ancestors, probs, 4, drawn, 3)

    def counts():
        c12 = torch.zeros(V * V)
        accepted = 0
        for _ in range(15000):
            acc = trial()
            first, second = acc.emitted[:2].tolist()
            if int(acc.length) == 1:       # the root's children all rejected: the next step draws after the bonus
                second = int(torch.multinomial(p_next[first], 1))
            c12[first * V + second] += 1
            accepted += int(acc.length) > 1
        return c12, accepted
    torch.manual_seed(6)
    c12, accepted = counts()
    joint = (p_root[:, None] * p_next).flatten()
    assert _chisq_pvalue(c12, joint) > 1e-3
    assert accepted > 0.8 * 15000
    real_rand = torch.rand
    torch.rand = lambda *a, **k: real_rand(*a, **k) / 2
    try:
        c12, _ = counts()
    finally:
        torch.rand = real_rand
    assert _chisq_pvalue(c12, joint) < 1e-3


def test_sample_accept_follows_the_target_law():
    """The device sampling rule alone, on a fixed bushy tree with twin siblings and padding: the first emitted token
    follows the root's law, and after a drafted child's token the next one follows that child's law; 20000 draws,
    chi-square. Under a rule that accepts a child twice as often as it should, the same test fails."""
    from specla_hf.loop.acceptance import sample_accept
    from specla_kernels.reference import tree_ancestors
    V = 6
    #        node: 0  1  2  3  4  5  6  7   8 (padding)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, -1])
    tokens = torch.tensor([5, 2, 0, 2, 1, 3, 4, 0, 0])     # node 3 is node 1's twin: never accepted
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(9, V, generator=gen) * 1.5, -1)
    ancestors = tree_ancestors(parents[None])[0]
    first_child = {2: 1, 0: 2}                               # the root's children by token (node 3 never reached)

    def counts(rule_rand):
        c1, c2 = torch.zeros(V), {c: torch.zeros(V) for c in first_child.values()}
        for _ in range(20000):
            acc = rule_rand()
            first, second = acc.emitted[:2].tolist()
            c1[first] += 1
            if first in first_child:
                c2[first_child[first]][second] += 1
        return c1, c2
    torch.manual_seed(5)
    c1, c2 = counts(lambda: sample_accept(tokens, parents, ancestors, probs, 4))
    assert _chisq_pvalue(c1, probs[0]) > 1e-3
    for child, c in c2.items():
        assert _chisq_pvalue(c, probs[child]) > 1e-3, child
    real_rand = torch.rand
    torch.rand = lambda *a, **k: real_rand(*a, **k) / 2
    try:
        c1, _ = counts(lambda: sample_accept(tokens, parents, ancestors, probs, 4))
    finally:
        torch.rand = real_rand
    assert _chisq_pvalue(c1, probs[0]) < 1e-3
