"""The CUDA-graph bookkeeping (capture once per shape, replay with static buffers, tree buckets) on CPU, with
``StaticCall``'s emulation standing in for torch.cuda.CUDAGraph: anything recorded inside a capture is replayed on
every call."""
import pytest
import torch

from conftest import record_calls, tiny_gdn
from specla_hf.loop.autoregressive import autoregressive_decode
from specla_hf.models.graphed import CHAIN_CHUNK, ForwardGraphs
from specla_hf.models.fla_gdn import GDNRunner


def emulate_graphs(model, role):
    runner = GDNRunner.for_model(model, role)
    runner.graphs = ForwardGraphs(runner, emulate=True)
    runner.bucket_trees = True
    return runner


def test_graphed_autoregressive_decoding_keeps_the_state():
    model = tiny_gdn(seed=51)
    ids = torch.randint(0, 97, (1, 9))
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    runner = emulate_graphs(model, "target")
    for _ in range(2):     # the second call reuses the captured graphs and the runner's one cache
        assert torch.equal(autoregressive_decode(runner, ids, 20), plain)
    # one captured step (the token consumed, the next written into its input) served all 40 steps
    assert runner.graphs.calls[("ar step",)] is not None
    graphs = runner.graphs.forwards
    # the 8-token prompt pass: one chain of CHAIN_CHUNK nodes (padded) verified and committed by graph replays
    chains = [g for k, g in graphs.items() if k[1] is not None]
    assert [k[0] for k in graphs if k[1] is not None] == [CHAIN_CHUNK] and chains[0].commit
    short = torch.randint(0, 97, (1, 3))       # prompts short enough for a graphed prefill, too
    assert torch.equal(autoregressive_decode(runner, short, 12), model.generate(short, max_new_tokens=12,
                                                                                do_sample=False))


def test_graphed_speculative_decoding_is_lossless():
    model = tiny_gdn(seed=52)
    drafter = tiny_gdn(seed=52)                  # same weights: drafts are accepted, trees go deep
    # a bad drafter of its own, not the session's: the emulated graphs stay on its runner (another test file's
    # calls with the session's drafter would capture, and phases that capture are not timed)
    bad_drafter = tiny_gdn(seed=1, hidden=32, layers=1, heads=2, head_dim=8)
    runners = [emulate_graphs(model, "target"), emulate_graphs(drafter, "drafter"),
               emulate_graphs(bad_drafter, "drafter")]
    gen = torch.Generator().manual_seed(5)
    for trial in range(2):
        ids = torch.randint(0, 97, (1, int(torch.randint(1, 20, (), generator=gen))), generator=gen)
        plain = model.generate(ids, max_new_tokens=25, do_sample=False)
        for d in (drafter, bad_drafter):
            for tree in (False, True):
                spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=d, tree=tree,
                                      confidence_threshold=0.0)
                assert torch.equal(spec, plain), (trial, tree)
    assert model.specla_stats.steps < 25
    assert all(r.graphs.forwards for r in runners)
    # the target commits each step by replaying the commit graph of the verify graph it came from
    assert any(g.commit and all(g.commit.values()) for g in runners[0].graphs.forwards.values())


def test_graphed_eagle_drafter_is_lossless_and_drafts_as_eager():
    from specla_hf import SpecLADrafter, SpecLADrafterConfig
    from specla_hf.drafters.eagle import DRAFT_SEQ_TOKENS, _BlockRunner
    model = tiny_gdn(seed=53)
    torch.manual_seed(4)
    drafter = SpecLADrafter(SpecLADrafterConfig.for_target(model.config, num_heads=2, head_dim=16)).eval()
    ids = torch.randint(0, 97, (1, 11))
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    # no threshold: decoding's device loop (the tree selected on the device); a threshold: the host loop. Fixed
    # shapes: the shape policy's choices follow timings, which differ between eager and graphed runs
    settings = [(tree, threshold) for tree in (False, True) for threshold in (0.0, 0.05)]
    eager = {}
    for tree, threshold in settings:
        assert torch.equal(model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter,
                                          tree=tree, confidence_threshold=threshold, adaptive_drafting=False), plain)
        eager[tree, threshold] = model.specla_stats
    target_runner = emulate_graphs(model, "target")
    runner = _BlockRunner.for_drafter(drafter, model)
    runner.graphs = ForwardGraphs(runner, emulate=True, max_seq_tokens=DRAFT_SEQ_TOKENS)
    runner.bucket_trees = True
    for trial in range(2):                         # the second generate() replays the first one's graphs
        for tree, threshold in settings:
            spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter, tree=tree,
                                  confidence_threshold=threshold, adaptive_drafting=False)
            assert torch.equal(spec, plain), (trial, tree, threshold)
            # padding the drafter's trees to buckets and replaying graphs drafts exactly what eager drafting does
            assert model.specla_stats.draft_nodes == eager[tree, threshold].draft_nodes
            assert model.specla_stats.accepted == eager[tree, threshold].accepted
    assert _BlockRunner.for_drafter(drafter, model) is runner and runner.graphs.forwards
    keys = list(runner.graphs.forwards)
    assert any(k[1] is None and k[0] > 1 for k in keys)      # catch-up sequence calls are graphed too
    calls = runner.graphs.calls
    assert any(k[0] == "fuse" and v is not None for k, v in calls.items())            # and the fusion
    assert any(k[1] == "depth" and v is not None for k, v in calls.items())           # and the draft depths
    # the device loop's acceptance, commit and catch-up: one graph per verify graph, replayed
    tails = target_runner.graphs.store(owner=runner)
    assert tails and all(k[0] == "step tail" and v is not None for k, v in tails.items())


def test_a_failed_capture_falls_back_to_eager_with_a_warning(monkeypatch):
    import pytest
    import specla_hf.runtime.graphs as rg
    model, drafter = tiny_gdn(seed=54), tiny_gdn(seed=54)
    ids = torch.randint(0, 97, (1, 6))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    emulate_graphs(model, "target")
    emulate_graphs(drafter, "drafter")

    class Broken(rg.StaticCall):
        def __init__(self, fn, emulate=False, between=None, python_state=None):
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(rg, "StaticCall", Broken)
    with pytest.warns(RuntimeWarning, match="eagerly"):
        spec = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, tree=True,
                              confidence_threshold=0.0)
    assert torch.equal(spec, plain)


def test_a_long_prompt_is_consumed_as_graphed_chains():
    """A prompt longer than the graphed sequence calls goes through the tree path in CHAIN_CHUNK-node chains (a
    short last chunk padded with inert nodes), verified and committed by graph replays: the same logits, hidden
    states, state and conv window as consuming it eagerly, and greedy decoding after it equal to stock generate."""
    model = tiny_gdn(seed=54)
    ids = torch.randint(0, 97, (1, 2 * CHAIN_CHUNK + 23), generator=torch.Generator().manual_seed(54))
    eager = GDNRunner(model)
    graphed = emulate_graphs(model, "target")
    for positions in (slice(0, 0), slice(-1, None), None, slice(5, 140, 9)):
        want_cache, got_cache = eager.new_cache(1), graphed.new_cache(1)
        want = eager.forward(ids, want_cache, logits_positions=positions, hidden_layers=(0, 1, 2))
        got = graphed.forward(ids, got_cache, logits_positions=positions, hidden_layers=(0, 1, 2))
        assert got.logits.shape == want.logits.shape
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        for g, w in zip(got.hidden_states, want.hidden_states):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert not got_cache.num_pending
        for g, w in zip(got_cache.layers, want_cache.layers):
            torch.testing.assert_close(g.state, w.state, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(g.window, w.window)
    # one verify graph and its commit graph served every chunk of every call
    assert [k[0] for k in graphed.graphs.forwards if k[1] is not None] == [CHAIN_CHUNK]
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(autoregressive_decode(graphed, ids, 12), plain)


def test_a_long_prompt_through_graphed_chains_keeps_speculative_decoding_lossless():
    from specla_hf import SpecLADrafter, SpecLADrafterConfig
    from specla_hf.drafters.eagle import DRAFT_SEQ_TOKENS, _BlockRunner
    model = tiny_gdn(seed=55)
    torch.manual_seed(5)
    drafter = SpecLADrafter(SpecLADrafterConfig.for_target(model.config, num_heads=2, head_dim=16)).eval()
    ids = torch.randint(0, 97, (1, CHAIN_CHUNK + 37), generator=torch.Generator().manual_seed(55))
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    emulate_graphs(model, "target")
    runner = _BlockRunner.for_drafter(drafter, model)
    runner.graphs = ForwardGraphs(runner, emulate=True, max_seq_tokens=DRAFT_SEQ_TOKENS)
    runner.bucket_trees = True
    for tree in (False, True):
        assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                                          tree=tree, confidence_threshold=0.0), plain), tree
    # the drafter caught up on the prompt's features through its own chain graph
    assert any(k[0] == CHAIN_CHUNK and k[1] == 0 for k in runner.graphs.forwards)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_fused_verify_in_graphs_is_lossless(device):
    """With ``fused_verify_max_nodes`` the target's and the drafter's tree passes run ``_verify_fused`` inside their
    graphs (captured on the GPU, emulated on the CPU): trees padded to their buckets with inert nodes, committed by
    replays. Greedy output is plain decoding's, in fp32, with chains and trees, a perfect drafter and a poor one."""
    from specla_kernels import tuning
    model, twin, poor = (tiny_gdn(seed=s).to(device) for s in (54, 54, 55))
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(54)).to(device)
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    with tuning.using(fused_verify_max_nodes=64):
        runners = ([emulate_graphs(model, "target"), emulate_graphs(twin, "drafter"), emulate_graphs(poor, "drafter")]
                   if device == "cpu" else [GDNRunner.for_model(m, r) for m, r in
                                            ((model, "target"), (twin, "drafter"), (poor, "drafter"))])
        fused = [record_calls(runner, "_verify_fused") for runner in runners]
        for drafter in (twin, poor):
            for tree in (False, True):
                spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter, tree=tree,
                                      autoregressive_fallback=False)
                assert torch.equal(spec, plain), (drafter is twin, tree)
    assert fused[0] and fused[1] and all(r.graphs.forwards for r in runners)
