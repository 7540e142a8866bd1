"""The target-aligned EAGLE drafter: serialization, target checks, decode-time alignment, losslessness, pruning,
and the training CLI's smoke mode."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList, TemperatureLogitsWarper
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, TopKLogitsWarper

import test_generate
from conftest import CollectStreamer, record_calls, tiny_gdn, write_word_corpus
from tiny_checkpoints import hub_snapshot, run_offline
from specla_hf import DraftOptions, GDNRunner, SpecLADrafter, SpecLADrafterConfig, speculative_decode
from specla_hf.drafters.base import DraftBuffers
from specla_hf.drafters.eagle import EagleDrafter
from specla_hf.generation import draft_options


def make_drafter(target, seed: int = 5, **overrides) -> SpecLADrafter:
    torch.manual_seed(seed)
    cfg = SpecLADrafterConfig.for_target(target.config, **{"num_heads": 2, "head_dim": 16, **overrides})
    return SpecLADrafter(cfg).eval()


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------------------------
# config, serialization, Auto classes
# ---------------------------------------------------------------------------------------------------------------
def test_config_records_the_target_and_validates_feature_layers(target):
    cfg = SpecLADrafterConfig.for_target(target.config)
    assert (cfg.target_model_type, cfg.hidden_size, cfg.vocab_size, cfg.target_num_hidden_layers) == \
        ("gated_deltanet", 64, 97, 2)
    assert cfg.feature_layers == [0, 1, 2]                  # low, mid, top of a 2-layer target
    assert SpecLADrafterConfig(target_num_hidden_layers=21).feature_layers == [5, 10, 21]
    for bad in ([1, 1, 2], [2, 1], [0, 3], [-1, 2]):
        with pytest.raises(ValueError, match="feature_layers"):
            SpecLADrafterConfig(target_num_hidden_layers=2, feature_layers=bad)


def test_save_pretrained_round_trip_and_auto_classes(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    # the target's embedding and LM head are used at run time, never stored
    assert all(drafter.config.vocab_size not in t.shape for t in stored.values())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "specla_drafter"
    assert type(AutoConfig.from_pretrained(tmp_path)) is SpecLADrafterConfig
    for cls in (SpecLADrafter, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path)
        assert type(loaded) is SpecLADrafter and same_weights(loaded, drafter)
    assert type(AutoModelForCausalLM.from_config(drafter.config)) is SpecLADrafter


def test_loads_by_repo_id_from_an_offline_hub_cache(drafter, tmp_path):
    """``from_pretrained("org/name")`` with HF_HUB_OFFLINE=1 reads the hub cache layout. huggingface_hub reads its
    environment at import, so the load runs in a fresh interpreter with the variables set."""
    cache = tmp_path / "hub"
    drafter.save_pretrained(hub_snapshot(cache, "specla/tiny-drafter"))
    code = ("import torch, specla_hf\n"
            "from transformers import AutoModelForCausalLM\n"
            "m = AutoModelForCausalLM.from_pretrained('specla/tiny-drafter')\n"
            "print(type(m).__name__, sum(float(p.double().sum()) for p in m.parameters()))\n")
    run = run_offline(code, cache, tmp_path / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    name, checksum = run.stdout.split()[-2:]
    assert name == "SpecLADrafter"
    assert float(checksum) == pytest.approx(sum(float(p.detach().double().sum()) for p in drafter.parameters()), rel=1e-12)


@pytest.mark.parametrize("change, message", [(dict(vocab=101), "vocabulary: drafter trained for 97 tokens, "
                                                               "target has 101"),
                                             (dict(hidden=32), "hidden size: drafter trained for 64, target has 32"),
                                             (dict(layers=3), "layer count: drafter trained for 2 layers")])
def test_mismatched_target_is_a_clear_error(drafter, change, message):
    other = tiny_gdn(seed=2, **change)
    with pytest.raises(ValueError, match=message):
        drafter.check_target(other)
    with pytest.raises(ValueError, match=message):
        other.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, assistant_model=drafter)


# ---------------------------------------------------------------------------------------------------------------
# decode-time alignment: what EagleDrafter computes is what the drafter is trained on
# ---------------------------------------------------------------------------------------------------------------
def test_decode_time_features_and_positions_match_training(target, drafter):
    """Training reads HF ``output_hidden_states``; decoding reads GDNRunner's layers (top one before the final
    norm). Drafter position t reads (feature t, token t+1); deeper nodes read their parent's output hidden."""
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        fused = drafter.fuse(drafter.target_features(out.hidden_states))
        embeds = out.hidden_states[0]
        h_seq = drafter(fused[:, :-1], embeds[:, 1:])
        logp_seq = torch.log_softmax(target.lm_head(drafter.norm(h_seq)), -1)[0]
        # depth 2 below a root at position 6: position 7 reads the root's output in place of the target's feature
        h_deep = drafter(torch.cat([fused[:, :7], h_seq[:, 6:7]], 1), embeds[:, 1:9])
        logp_deep = torch.log_softmax(target.lm_head(drafter.norm(h_deep[:, 7])), -1)[0]

    runner = GDNRunner(target)
    cache = runner.new_cache(1)
    eagle = drafter.candidate_generator(target, DraftOptions())
    assert eagle.feature_layers == (0, 1, 2)
    prefill = runner.forward(ids[:, :7], cache, logits_positions=slice(0, 0), hidden_layers=eagle.feature_layers)
    eagle.add_features(prefill.hidden_states)
    tol = dict(rtol=1e-4, atol=1e-4)
    buf = eagle.buffers = eagle._buffers()
    buf.reset()
    buf.tokens[0] = ids[0, 7]                                    # root: the pending token
    # start consumes positions 0..6, the root (position 6) included, and returns the root's draft distribution
    torch.testing.assert_close(eagle.start(ids[:, :8]), logp_seq[6], **tol)
    assert eagle.consumed == 7
    # a depth-1 node: its parent, the root, is in the committed state; it reads the root's output hidden
    buf.tokens[1], buf.parents[1] = ids[0, 8], -1
    eagle.add_nodes(1, torch.tensor([0]), None)
    torch.testing.assert_close(eagle.score(2)[0][1], logp_deep, **tol)
    # the target verifies the chain ids[7..10], accepts all of it, and hands over its features
    chain = torch.tensor([[-1, 0, 1, 2]])
    verify = runner.forward(ids[:, 7:11], cache, parents=chain, hidden_layers=eagle.feature_layers)
    cache.commit(3)
    eagle.add_features(verify.hidden_states)
    # the drafter catches up on positions 7..10 with true features, the new root (position 10) included
    buf.reset()
    buf.tokens[0] = ids[0, -1]                                   # the new pending token
    torch.testing.assert_close(eagle.start(ids), logp_seq[10], **tol)
    assert eagle.consumed == 11


def test_one_token_prompt_has_a_zero_feature_root(target, drafter):
    eagle = drafter.candidate_generator(target, DraftOptions(depth=3, topk=2, budget=4))
    tree = eagle.propose(torch.tensor([[5]]))
    assert len(tree) == 5 and eagle.consumed == 0
    eagle.observe([])
    assert eagle.cache.num_pending == 0


# ---------------------------------------------------------------------------------------------------------------
# losslessness through generate(assistant_model=...)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_identical_to_plain(target, drafter, tree):
    gen = torch.Generator().manual_seed(17)
    for trial in range(8):
        n_prompt = int(torch.randint(1, 24, (), generator=gen))
        n_new = int(torch.randint(1, 30, (), generator=gen))
        ids = torch.randint(0, 97, (1, n_prompt), generator=gen)
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        extra = dict(tree_topk=int(torch.randint(2, 5, (), generator=gen)),
                     tree_budget=int(torch.randint(4, 30, (), generator=gen))) if tree else {}
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                               confidence_threshold=0.0, **extra)
        assert torch.equal(spec, plain), (trial, n_prompt, n_new)
        assert sum(target.specla_stats.draft_nodes) > 0 or n_new == 1


@pytest.fixture(scope="module", params=[("specla-gdn-tiny-drafter", 3), ("specla-gdn-tiny-dart", 2)],
                ids=["eagle", "dart"])
def shipped(request):
    """The embedded default target and a trained drafter of it (EAGLE, and the DART parallel drafter that inherits
    the device loop's catch-up): long accepted paths, as on real text. With it, the fewest drafts a step of the
    device-loop test's prompt must accept (DART accepts 2 where EAGLE accepts 3)."""
    from specla_hf.app.loading import checkpoint_home, load_models
    name, block = request.param
    return load_models(drafter=str(checkpoint_home() / name)), block


def test_device_loop_stops_streams_and_counts_like_plain_decoding(shipped, monkeypatch):
    """Plain greedy with the tree selected on the device runs decoding's device loop, whose host reads each step's
    tokens after the next proposal is queued: EOS inside an accepted block, a stateful stopping criterion, the
    streamer and exact max_new_tokens behave as in plain decoding, the drafter counts every committed position, and no
    verify pass runs past the last step."""
    from specla_hf.loop import decode
    models, block = shipped
    target, drafter, tok = models.target, models.drafter, models.tokenizer
    used = []
    init = decode.DeviceDriver.__init__
    monkeypatch.setattr(decode.DeviceDriver, "__init__", lambda self, *a, **k: used.append(1) or init(self, *a, **k))
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    # the configured shape every step: the EOS run below must repeat this run's steps, which the shape policy's
    # timing-dependent choices would not
    tree = dict(tree=True, adaptive_drafting=False)
    free = target.generate(ids, max_new_tokens=48, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=drafter, **tree),
                       free) and used
    accepted = target.specla_stats.accepted
    # EOS = the second token of the last step that accepted >= block drafts and emitted it first (tokens after it in
    # the same block must be dropped)
    starts = [ids.shape[1] + sum(a + 1 for a in accepted[:i]) for i in range(len(accepted))]
    first, eos = [(at, int(free[0, at + 1])) for at, a in zip(starts, accepted)
                  if a >= block and at + a < free.shape[1]
                  and int(free[0, at + 1]) not in free[0, ids.shape[1]:at + 1].tolist()][-1]
    assert first > starts[1]                                  # not the first step: the next proposal was queued
    plain = target.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    spec = target.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                           assistant_model=drafter, **tree)
    assert torch.equal(spec, plain) and spec.shape[1] == first + 2
    assert target.specla_stats.accepted[-1] >= block         # the stop fell inside a block of accepted drafts

    class StopAt(StoppingCriteria):                          # a user criterion keeps state
        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return input_ids[:, -1] == eos
    stop = StopAt()
    stop.seen = []
    spec = target.generate(ids, max_new_tokens=48, do_sample=False, stopping_criteria=StoppingCriteriaList([stop]),
                           assistant_model=drafter, tree=True)
    assert torch.equal(spec, plain) and stop.seen == list(range(ids.shape[1] + 1, spec.shape[1] + 1))
    streamed = CollectStreamer()
    for n in (1, 2, 9, 23):
        out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=drafter, tree=True,
                              streamer=streamed)
        assert torch.equal(out, free[:, :ids.shape[1] + n])
        assert sum(streamed.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
        streamed.chunks = []
    # every position the target committed (the last step's whole path): the drafter level with it, none pending
    runner, caches, verified = GDNRunner(target), [], []
    new_cache, forward = runner.new_cache, runner.forward
    runner.new_cache = lambda *args: caches.append(new_cache(*args)) or caches[-1]
    runner.forward = lambda *a, parents=None, **k: verified.append(parents is not None) or forward(*a, parents=parents,
                                                                                                     **k)
    eagle = drafter.candidate_generator(target, draft_options(tree=True))
    n_new = 30
    seq, stats, _, _ = speculative_decode(runner, eagle, ids, LogitsProcessorList(),
                                          StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + n_new)]), False,
                                          ids.shape[1] + n_new)
    assert torch.equal(seq, free[:, :ids.shape[1] + n_new])
    committed = ids.shape[1] - 1 + sum(a + 1 for a in stats.accepted)
    assert eagle.consumed == committed >= seq.shape[1] - 1
    assert caches[0].num_pending == 0 and eagle.cache.num_pending == 0
    assert sum(verified) == stats.steps                      # every verify pass was a step's
    # the drafter's last tree is the last step's, rooted at that step's pending token (the demo draws it)
    last_root = ids.shape[1] - 1 + sum(a + 1 for a in stats.accepted[:-1])
    assert len(eagle.last_tree) == stats.draft_nodes[-1] + 1
    assert int(eagle.last_tree.tokens[0]) == int(seq[0, last_root])


def test_tree_sampling_is_lossless():
    """Chi-square test of (x1, x2) against the target's exact law (test_generate's helpers, drafted by EagleDrafter).
    2000 draws: a shift of ~4% of probability mass between two likely tokens is caught. Fixed tree shapes: the shape
    policy chooses by measured time, so its trees, and the random numbers they draw, would change run to run, and
    the test's false-alarm rate with them."""
    torch.manual_seed(1234)
    target = tiny_gdn(seed=30, vocab=8, hidden=32, head_dim=8)
    drafter = make_drafter(target, seed=31, head_dim=8)
    ids = torch.tensor([[1, 5, 2]])
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)])
    p1, p2 = test_generate._exact_first_two(target, ids, procs)
    options = draft_options(tree=True, tree_topk=3, confidence_threshold=0.0, adaptive_drafting=False)
    c1, c12, *_ = test_generate._sample_counts(GDNRunner(target), lambda: drafter.candidate_generator(target, options),
                                              ids, 2000, procs)
    assert test_generate._chisq_pvalue(c1, p1) > 1e-3
    assert test_generate._chisq_pvalue(c12, (p1[:, None] * p2).flatten()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# confidence pruning
# ---------------------------------------------------------------------------------------------------------------
def test_pruning_never_submits_a_node_under_the_threshold(target):
    drafter = make_drafter(target, seed=9)
    with torch.no_grad():
        drafter.norm.weight.mul_(12.0)   # sharpen the random drafter so cumulative confidences spread out
    options = draft_options(tree=True, tree_topk=4, tree_budget=24, confidence_threshold=0.05)
    eagle = EagleDrafter(drafter, target, options)
    seen, thresholds = [], []
    launch, collect = eagle.launch, eagle.collect

    def recording_launch(input_ids, max_depth=None):
        thresholds.append(eagle.threshold)                 # adaptive: read it when the proposal starts
        launch(input_ids, max_depth)

    def recording_collect():
        tree = collect()
        seen.append((thresholds[-1], tree, eagle.last_pruned))
        return tree

    eagle.launch, eagle.collect = recording_launch, recording_collect
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=eagle), plain)
    assert len({round(t, 6) for t, _, _ in seen}) > 1          # the adaptive threshold moved
    for threshold, tree, _ in seen:
        assert bool((tree.log_probs[1:] >= math.log(threshold)).all())
    assert sum(p for _, _, p in seen) > 0                       # candidates were pruned ...
    assert max(len(tree) for _, tree, _ in seen) > 2            # ... and confident ones kept, some past depth 1
    assert any(int(tree.parents.max()) > 0 for _, tree, _ in seen)


def test_early_stop_read_one_depth_late_gives_the_tree_of_drafting_every_depth(target, monkeypatch):
    drafter = make_drafter(target, seed=9)
    with torch.no_grad():
        drafter.norm.weight.mul_(12.0)
    options = draft_options(tree=True, tree_topk=3, tree_budget=20, draft_depth=6, confidence_threshold=0.1,
                            adaptive_drafting=False)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))

    def draft_all() -> tuple[list, list[int]]:
        eagle, trees, depths = EagleDrafter(drafter, target, options), [], []
        for n in range(2, ids.shape[1] + 1):
            eagle.add_features(tuple(torch.randn(1, 1, target.config.hidden_size, generator=torch.Generator()
                                                 .manual_seed(n)) for _ in eagle.feature_layers))
            trees.append(eagle.propose(ids[:, :n]))
            depths.append(eagle.launched_depths)
        return trees, depths

    early, early_depths = draft_all()
    monkeypatch.setattr(DraftBuffers, "read_best", lambda self, d: float("inf"))     # never stop: every depth
    full, full_depths = draft_all()
    assert sum(e < f for e, f in zip(early_depths, full_depths)) > 0               # the early stop fired
    assert any(len(t) > 2 for t in early)
    for a, b in zip(early, full):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


# ---------------------------------------------------------------------------------------------------------------
# the training CLI
# ---------------------------------------------------------------------------------------------------------------
def test_cpu_smoke_training_lowers_the_loss_resumes_and_drafts_losslessly(tmp_path, capsys):
    from specla_hf.training import train_drafter
    gen = torch.Generator().manual_seed(0)
    corpus = write_word_corpus(tmp_path / "corpus.jsonl.xz", gen)
    out = tmp_path / "out"
    common = ["--cpu-smoke", "--corpus", str(corpus), "--out", str(out), "--sequences", "16",
              "--gen-len", "32", "--eval-every-s", "1000", "--final-eval-s", "1"]
    train_drafter.main(common + ["--steps", "10"])
    first = json.loads((out / "train_log.json").read_text())
    assert first["steps"] == 10 and first["error"] is None
    train_drafter.main(common + ["--steps", "20", "--resume"])
    assert "resumed from" in capsys.readouterr().out
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 20 and log["error"] is None
    assert [h["step"] for h in log["history"]][:len(first["history"])] == [h["step"] for h in first["history"]]
    assert log["final_loss"] < 0.8 * log["initial_loss"]
    assert set(log["final_eval"]) == {"chain", "tree", "tree+pruning"}
    assert all(r["tau"] >= 1.0 and r["identical"] == 1.0 for r in log["final_eval"].values())
    # a second stage: the trained drafter on the sequences the first run wrote (no new ones), starting where it ended
    stage2 = tmp_path / "stage2"
    train_drafter.main([a if a != str(out) else str(stage2) for a in common]
                       + ["--steps", "5", "--init-from", str(out), "--sequences-from", str(out / "checkpoint")])
    assert "training on 48 sequences of 64 tokens written earlier" in capsys.readouterr().out
    log2 = json.loads((stage2 / "train_log.json").read_text())
    assert log2["steps"] == 5 and log2["error"] is None and log2["sequences"] == [48, 64]
    assert log2["initial_loss"] < 0.8 * log["initial_loss"]
    with pytest.raises(ValueError, match="drop --init-from"):
        train_drafter.main(common + ["--resume", "--init-from", str(out)])

    # the saved drafter drives the smoke target losslessly
    target = train_drafter.smoke_target(8192, seed=0)
    drafter = SpecLADrafter.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 8192, (1, 8), generator=gen)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, tree=True),
                       plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_tree_pass_equals_the_general_one(dtype):
    """The drafter's tree passes through ``fused_gemm`` products (``_fused_layer``, the target's LM head with the
    drafter's norm fused in, under ``fused_verify_max_nodes``) give the general pass's draft log-probs, output hidden
    states and factors, and the same state once a path is committed."""
    from specla_hf.drafters.eagle import _BlockRunner
    from specla_kernels import tuning
    target = tiny_gdn(seed=41).to(dtype)
    drafter = make_drafter(target, seed=41).to(dtype)
    gen = torch.Generator().manual_seed(41)
    with torch.no_grad():                        # norm weights away from their init, so each one's place matters
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    fused, general = _BlockRunner(drafter, target, cuda_graphs=False), _BlockRunner(drafter, target, cuda_graphs=False)
    assert fused.fused_tree
    general.fused_tree = False
    layer_calls = [record_calls(runner, "_fused_layer") for runner in (fused, general)]
    feats = torch.randn(1, 13, drafter.config.hidden_size, generator=gen).to(dtype)
    toks = torch.randint(0, 97, (1, 13), generator=gen)
    tree = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 2, 4]])
    outs, caches = [], []
    with tuning.using(fused_verify_max_nodes=16):
        for runner in (fused, general):
            cache = runner.new_cache(1)
            runner.forward((feats[:, :4], toks[:, :4]), cache)
            outs.append(runner.forward((feats[:, 4:], toks[:, 4:]), cache, parents=tree))
            cache.commit(7)
            caches.append(cache)
    assert [len(calls) for calls in layer_calls] == [1, 0]          # the tree pass, fused in one runner only
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(outs[0].logits, outs[1].logits, **tol)
    torch.testing.assert_close(outs[0].hidden_states[0], outs[1].hidden_states[0], **tol)
    for la, lb in zip(*(c.layers for c in caches)):
        torch.testing.assert_close(la.state, lb.state, **tol)
        torch.testing.assert_close(la.window, lb.window, **tol)
