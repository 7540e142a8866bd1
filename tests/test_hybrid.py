"""transformers' GDN hybrids (Qwen3.5 dense and MoE, Qwen3-Next) under SpecLA: the adapter verifies trees and commits
paths exactly, generate(assistant_model=...) is lossless, bad inputs get clear errors, stock generate runs on CPU."""
import copy
import inspect

import pytest
import torch
from transformers import (LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
                          TopKLogitsWarper)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import CollectStreamer, record_calls
from hybrid_models import FAMILIES, MODEL_CLASSES, VOCAB, tiny_hybrid, tiny_qwen3_5_vl
from test_generate import _chisq_pvalue, _exact_first_two, _sample_counts
from specla_kernels import tuning
from specla_hf import GDNDrafter
from specla_hf.cache import SpecLAAttentionLayer, SpecLALayer
from specla_hf.generation import draft_options
from specla_hf.models import adapter_for, transformers_backend
from specla_hf.models.graphed import DRAFT_SEQ_TOKENS, MAX_SEQ_TOKENS, ForwardGraphs
from specla_hf.models.qwen3_5 import HybridRunner
from specla_hf.models.tree_attention import rotary_positions, rotary_rows


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family):
    return tiny_hybrid(family, seed=0)


@pytest.fixture(scope="module")
def drafters(family, target):
    """Drafters of the target's family: an exact copy (every draft accepted), a slightly perturbed copy (some
    accepted) and a small model of its own (two layers: one GDN, one attention)."""
    perturbed = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.005 * torch.randn(p.shape, generator=gen))
    small = tiny_hybrid(family, seed=5, layers=2, attention_every=2, hidden=32, heads=2, kv_heads=1)
    return {"copy": copy.deepcopy(target), "perturbed": perturbed, "small": small}


def _root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0, -1]


# ---------------------------------------------------------------------------------------------------------------
# the adapter alone
# ---------------------------------------------------------------------------------------------------------------
def test_consuming_matches_the_model_forward(target):
    """Consuming tokens in pieces (prompt, one token, a few) gives the stock forward's logits and hidden states
    (0 = embeddings, i = after block i, before the final norm)."""
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = target(ids, output_hidden_states=True)
    runner = HybridRunner(target)
    cache = runner.new_cache()
    pieces = [runner.forward(ids[:, a:b], cache, hidden_layers=(0, 1, 2, 3)) for a, b in ((0, 7), (7, 8), (8, 13))]
    logits = torch.cat([p.logits for p in pieces], 1)
    torch.testing.assert_close(logits, stock.logits, rtol=1e-4, atol=1e-4)
    for i in range(4):
        torch.testing.assert_close(torch.cat([p.hidden_states[i] for p in pieces], 1), stock.hidden_states[i],
                                   rtol=1e-4, atol=1e-4)
    assert [l.committed_length() for l in cache.layers if isinstance(l, SpecLAAttentionLayer)] == [13]


def test_tree_verify_gives_each_node_its_root_path_logits(target):
    """Random trees (odd sizes, several branches), verified in two calls (the second hangs nodes off the first's):
    every node gets the logits of running the model on the prefix and that node's root path; the committed state is
    untouched. In the MoE families the nodes are routed to different experts, so routing per token is exercised."""
    gen = torch.Generator().manual_seed(7)
    runner = HybridRunner(target)
    routed, verify_routes = [], []
    gates = [m for name, m in target.named_modules() if name.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda mod, args, out: routed.append(out[-1].sort(-1).values)) for g in gates]
    try:
        for n_first, n_second in ((5, 4), (11, 6), (1, 2)):
            prefix = torch.randint(0, VOCAB, (1, int(torch.randint(1, 9, (), generator=gen))), generator=gen)
            cache = runner.new_cache()
            runner.forward(prefix, cache)
            before = [l.state.clone() if isinstance(l, SpecLALayer) else l.committed_length() for l in cache.layers]
            n = n_first + n_second
            parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]
            tokens = torch.randint(0, VOCAB, (1, n), generator=gen)
            routed.clear()
            first = runner.forward(tokens[:, :n_first], cache, parents=torch.tensor([parents[:n_first]]))
            second = runner.forward(tokens[:, n_first:], cache, parents=torch.tensor([parents[n_first:]]))
            verify_routes += routed                    # the reference runs below route too
            logits = torch.cat([first.logits, second.logits], 1)[0]
            for node in range(n):
                seq = torch.cat([prefix, tokens[:, _root_path(parents, node)]], 1)
                torch.testing.assert_close(logits[node], _last_logits(target, seq), rtol=1e-4, atol=1e-4)
            after = [l.state if isinstance(l, SpecLALayer) else l.committed_length() for l in cache.layers]
            assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(before, after))
            assert cache.num_pending == n
            lengths = {l.committed_length() for l in cache.layers if isinstance(l, SpecLAAttentionLayer)}
            assert lengths == {prefix.shape[1]}
    finally:
        for h in hooks:
            h.remove()
    if gates:
        chosen = torch.cat(verify_routes)
        assert len({tuple(row.tolist()) for row in chosen}) > 1, "every node went to the same experts"


def _assert_same_cache(got, want):
    for a, b in zip(got.layers, want.layers):
        if isinstance(a, SpecLALayer):
            torch.testing.assert_close(a.state, b.state, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a.window, b.window, rtol=1e-4, atol=1e-4)
        else:
            n = a.committed_length()
            assert isinstance(a, SpecLAAttentionLayer) and n == b.committed_length() and a.num_pending == 0
            for x, y in ((a.key_buffer, b.key_buffer), (a.value_buffer, b.value_buffer)):
                torch.testing.assert_close(x[:, :, :n], y[:, :, :n], rtol=1e-4, atol=1e-4)


def test_commit_leaves_the_cache_of_consuming_the_path(target):
    """Verify a tree and commit a root-to-node path, several times over (paths that skip nodes, so the kept keys and
    values move down past dropped ones; a path of the root only; deep paths): the cache then holds what consuming the
    path's tokens leaves (GDN state and conv window; attention keys and values; lengths)."""
    gen = torch.Generator().manual_seed(11)
    runner = HybridRunner(target)
    cache, reference = runner.new_cache(), runner.new_cache()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=gen)
    runner.forward(prompt, cache)
    runner.forward(prompt, reference)
    trees = [([-1, 0, 0, 1, 2, 4, 4, 5], 6), ([-1, 0, 1, 2], 0), ([-1, 0, 0, 2, 1, 3, 5, 6, 6, 8, 9], 10),
             ([-1, 0, 1, 1, 3, 3, 5, 0, 7], 6)]
    for parents, accepted in trees:
        tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
        runner.forward(tokens, cache, parents=torch.tensor([parents]))
        path = _root_path(parents, accepted)
        runner.commit(cache, path)
        runner.forward(tokens[:, path], reference)
        _assert_same_cache(cache, reference)
    assert cache.factor_bytes() == 0


# ---------------------------------------------------------------------------------------------------------------
# generate(assistant_model=...)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kind", ["copy", "perturbed", "small"])
def test_greedy_identical_to_plain(target, drafters, kind, tree):
    drafter = drafters[kind]
    gen = torch.Generator().manual_seed(13)
    accepted, drafted = 0, 0
    # the copy drafts the configured shape, so that its long paths are verified; the others the shape policy's
    shape = dict(adaptive_drafting=False) if kind == "copy" else {}
    for n_prompt, n_new in ((1, 20), (9, 41)):
        ids = torch.randint(0, VOCAB, (1, n_prompt), generator=gen)
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                               confidence_threshold=0.0, **shape)
        assert torch.equal(spec, plain), (n_prompt, n_new)
        stats = target.specla_stats
        accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.draft_nodes)
    if kind == "copy":                 # long accepted paths (in trees past rejected siblings, whose entries go)
        assert stats.tau > 4
    elif kind == "perturbed":          # partial acceptance
        assert 0 < accepted < drafted


def test_host_loop_with_a_threshold_and_padded_trees(target, drafters):
    """The host loop (a confidence threshold), with the target's trees padded by inert nodes to power-of-two
    sizes."""
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(17))
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    runner = HybridRunner.for_model(target)
    runner.bucket_trees = True
    verified = []
    hook = target.model.embed_tokens.register_forward_hook(lambda mod, args, out: verified.append(args[0].shape[1]))
    try:
        for tree in (False, True):
            spec = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafters["perturbed"],
                                   tree=tree, draft_depth=5, confidence_threshold=0.02)
            assert torch.equal(spec, plain)
            sizes = [n + 1 for n in target.specla_stats.draft_nodes]
            assert verified[1:] == [1 << (n - 1).bit_length() for n in sizes] and verified[1:] != sizes
            verified.clear()
    finally:
        hook.remove()
        runner.bucket_trees = False


def test_eager_attention():
    """Under eager attention (an additive mask, no SDPA causal shortcut for the prompt) trees decode as plain
    generate does."""
    model = tiny_hybrid("qwen3_5", seed=2, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(37))
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=model, tree=True,
                          confidence_threshold=0.0)
    assert torch.equal(spec, plain) and model.specla_stats.tau > 4


def test_vision_language_model_text_path():
    """Qwen3_5ForConditionalGeneration decodes a text prompt speculatively as plain generate does."""
    model = tiny_qwen3_5_vl()
    ids = torch.randint(0, VOCAB - 4, (1, 8), generator=torch.Generator().manual_seed(19))
    plain = model.generate(ids, max_new_tokens=25, do_sample=False)
    for tree in (False, True):
        spec = model.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=model, tree=tree,
                              confidence_threshold=0.0)
        assert torch.equal(spec, plain)
    assert model.specla_stats.tau > 4


def test_eos_streamer_scores_and_stopping_criteria():
    model = tiny_hybrid("qwen3_next", seed=3)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(23))
    free = model.generate(ids, max_new_tokens=30, do_sample=False)

    # EOS inside an accepted block: stop where plain decoding stops
    eos = int(free[0, 5 + 7])
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = config.pad_token_id = eos
    plain = model.generate(ids, generation_config=config, max_new_tokens=30, do_sample=False)
    spec = model.generate(ids, generation_config=config, max_new_tokens=30, do_sample=False, assistant_model=model,
                          confidence_threshold=0.0)
    assert torch.equal(spec, plain) and spec[0, -1] == eos and (spec[0, 5:-1] != eos).all()
    assert model.specla_stats.accepted[-1] > 0        # the stop fell within a block of accepted drafts

    # a user criterion sees each prefix once, in order, as in plain decoding
    class StopAfter(StoppingCriteria):
        def __init__(self, token):
            self.token, self.seen = token, []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return input_ids[:, -1] == self.token

    stop = StopAfter(int(free[0, 5 + 9]))
    plain = model.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([stop]))
    seen_plain, stop.seen = stop.seen, []
    spec = model.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([stop]),
                          assistant_model=model, confidence_threshold=0.0)
    assert torch.equal(spec, plain) and stop.seen == seen_plain

    # a streamer gets the same tokens
    plain_s, spec_s = CollectStreamer(), CollectStreamer()
    model.generate(ids, max_new_tokens=15, do_sample=False, streamer=plain_s)
    model.generate(ids, max_new_tokens=15, do_sample=False, streamer=spec_s, assistant_model=model)
    assert spec_s.tokens == plain_s.tokens and spec_s.ended

    # output_scores / output_logits equal plain's
    kwargs = dict(max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    plain = model.generate(ids, **kwargs)
    spec = model.generate(ids, **kwargs, assistant_model=model, confidence_threshold=0.0)
    assert torch.equal(plain.sequences, spec.sequences) and len(spec.scores) == len(plain.scores) == 9
    for a, b in zip(plain.scores + plain.logits, spec.scores + spec.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sampling_is_lossless():
    """3000 draws of (x1, x2) on a vocabulary of 8 through the loop generate() runs, drafting trees of three
    children per node (called directly: thousands of generate() calls cost minutes): the first token and the pair
    follow the target's exact distributions; at this size a 3.5% shift of probability mass is caught."""
    torch.manual_seed(1234)
    shape = dict(vocab=8, hidden=32, heads=2, kv_heads=1, layers=2, attention_every=2)
    target, drafter = tiny_hybrid("qwen3_5", seed=30, **shape), tiny_hybrid("qwen3_5", seed=31, **shape)
    ids = torch.tensor([[1, 5, 2]])
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)])
    p1, p2 = _exact_first_two(target, ids, procs)
    draws = 3000
    options = draft_options(tree=True, tree_topk=3, confidence_threshold=0.0, adaptive_drafting=False)
    c1, c12, *_ = _sample_counts(HybridRunner(target), lambda: GDNDrafter(drafter, options), ids, draws, procs)
    assert _chisq_pvalue(c1, p1) > 1e-3
    assert _chisq_pvalue(c12, (p1[:, None] * p2).flatten()) > 1e-3
    a, b = p1.topk(2).indices                 # power: the noncentrality of a 3.5% shift between two likely tokens
    assert draws * (0.035 ** 2) * (1 / p1[a] + 1 / p1[b]) > 20


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------
def test_clear_errors():
    model = tiny_qwen3_5_vl()
    pixels, grid = torch.randn(16, 3 * 2 * 4 * 4), torch.tensor([[1, 4, 4]])      # one 4 x 4 patch grid
    for kind, media in (("image", dict(pixel_values=pixels, image_grid_thw=grid)),
                        ("video", dict(pixel_values_videos=pixels, video_grid_thw=grid))):
        placeholder = model.config.image_token_id if kind == "image" else model.config.video_token_id
        ids = torch.tensor([[VOCAB - 3] + [placeholder] * 4 + [VOCAB - 4, 5, 6]])
        with pytest.raises(ValueError, match=f"text prompt given as token ids, got {kind} inputs"):
            model.generate(ids, **media, max_new_tokens=4, assistant_model=model)
    text = tiny_hybrid("qwen3_5")
    with pytest.raises(ValueError, match="batch size 1"):
        text.generate(torch.randint(0, VOCAB, (2, 5)), max_new_tokens=4, assistant_model=text)
    other_vocab = tiny_hybrid("qwen3_5", vocab=50, layers=2, attention_every=2)
    with pytest.raises(ValueError, match="vocabulary"):
        text.generate(torch.randint(0, 50, (1, 5)), max_new_tokens=4, assistant_model=other_vocab)
    flash = tiny_hybrid("qwen3_5", layers=2, attention_every=2)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(NotImplementedError, match="takes no tree mask"):
        adapter_for(flash)


# ---------------------------------------------------------------------------------------------------------------
# stock generate on CPU
# ---------------------------------------------------------------------------------------------------------------
def test_stock_generate_runs_the_torch_functions_on_cpu(family, target, monkeypatch):
    """After ``import specla_hf`` stock generate runs on CPU (flash-linear-attention's Triton kernels, bound by
    transformers, fail there) and decodes as with the unwrapped torch functions."""
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(29))
    out = target.generate(ids, max_new_tokens=12, do_sample=False)
    modeling = inspect.getmodule(type(target))
    for name in transformers_backend.KERNEL_BOUND:
        monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False), out)


def test_kernel_dispatch_by_device():
    """CPU tensors take the torch function, any other device the bound kernel; packed sequences are refused on
    CPU rather than silently mixed."""
    calls = []

    def torch_fn(x, y, scale=1.0):
        calls.append("torch")
        return x

    def bound(x, y, scale=1.0, cu_seqlens=None):
        calls.append("kernel")
        return x

    dispatch = transformers_backend.on_cpu_use_torch(bound, torch_fn)
    dispatch(torch.zeros(2), torch.zeros(2), scale=2.0, extra=None)          # dropped, as transformers drops it
    dispatch(torch.zeros(2, device="meta"), torch.zeros(2, device="meta"))
    assert calls == ["torch", "kernel"]
    with pytest.raises(ValueError, match="packed sequences"):
        dispatch(torch.zeros(2), torch.zeros(2), cu_seqlens=torch.tensor([0, 1, 2]))


# ---------------------------------------------------------------------------------------------------------------
# past_key_values
# ---------------------------------------------------------------------------------------------------------------
def _assert_same_transformers_cache(got, want):
    """Equal up to summation order. On a GPU plain decoding runs fla's Triton kernels, whose fp32 dot products use
    TF32 (Triton's default), and so do SpecLA's tree kernels: there each tensor is compared as a whole (measured on
    the H200 with identical tokens: recurrent states within 2.5e-4, keys within 8.5e-3 elementwise)."""
    def check(a, b):
        if b.is_cuda:
            assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    assert len(got.layers) == len(want.layers)
    for a, b in zip(got.layers, want.layers):
        assert type(a) is type(b)
        if hasattr(b, "recurrent_states"):
            check(a.conv_states[0], b.conv_states[0])
            check(a.recurrent_states[0], b.recurrent_states[0])
            assert a.has_previous_state[0]
        else:
            check(a.keys, b.keys)
            check(a.values, b.values)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_past_key_values_equal_plain(family):
    """With return_dict_in_generate, past_key_values is the transformers cache plain decoding leaves: from the
    committed state after a run to max_new_tokens (device and host loops), and after an EOS inside an accepted block
    (where the committed state has run past the stop)."""
    model = tiny_hybrid(family, seed=3)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(31))
    kwargs = dict(max_new_tokens=23, do_sample=False, return_dict_in_generate=True)
    plain = model.generate(ids, **kwargs)
    for threshold in (0.0, 0.02):
        spec = model.generate(ids, **kwargs, assistant_model=model, confidence_threshold=threshold)
        assert torch.equal(spec.sequences, plain.sequences)
        _assert_same_transformers_cache(spec.past_key_values, plain.past_key_values)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = config.pad_token_id = int(plain.sequences[0, 5 + 7])
    plain = model.generate(ids, generation_config=config, **kwargs)
    spec = model.generate(ids, generation_config=config, **kwargs, assistant_model=model, confidence_threshold=0.0)
    assert torch.equal(spec.sequences, plain.sequences) and model.specla_stats.accepted[-1] > 0
    _assert_same_transformers_cache(spec.past_key_values, plain.past_key_values)


def test_autoregressive_loop_and_fallback_equal_plain(target, drafters, monkeypatch):
    """``generate(specla=True)`` (SpecLA's autoregressive loop through the adapter) and a fallback to it mid-call
    decode what plain decoding does."""
    from specla_hf.loop import decode
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    for kwargs in (dict(), dict(repetition_penalty=1.3)):
        plain = target.generate(ids, max_new_tokens=16, do_sample=False, **kwargs)
        assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, specla=True, **kwargs), plain)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    # every speculative step looks slower: fall back
    monkeypatch.setattr(decode, "ar_step_seconds", lambda *args: 1e-9)
    spec = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafters["perturbed"],
                           tree=True, confidence_threshold=0.0, autoregressive_fallback=True)
    assert torch.equal(spec, plain) and target.specla_stats.mode == "autoregressive"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_to_plain_on_cuda(family, monkeypatch):
    """On a GPU in fp32 (our Triton tree kernels for the verify, transformers' kernels for consuming), with CUDA
    graphs on the target and the drafter (on by default there) and without: greedy output with an exact and a
    perturbed copy as drafter, chain and tree, and SpecLA's autoregressive loop equal plain decoding,
    ``past_key_values`` too. The dense family must capture every call, the drafters' too; the MoE families' stock
    experts copy between host and GPU, so they run eagerly, and asking for graphs is a clear error. (TF32 off for
    cuDNN: plain decoding's short convolution would otherwise not be fp32.)"""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    # the stock prompt pass in exact fp32: fla's chunk kernel (transformers' choice on a GPU) runs its products in
    # TF32, which moves a random tiny model's near-tied logits more than our tf32x3 kernels do
    modeling = inspect.getmodule(MODEL_CLASSES[family])
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))
    target = tiny_hybrid(family, seed=0).cuda()
    exact, perturbed = copy.deepcopy(target), copy.deepcopy(target)      # copied before the target holds graphs
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.005 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(21)
    # the long prompt first: its chain graphs are captured before any one-token step (a weight re-pointed after a
    # capture would leave those graphs reading freed memory: an illegal address on the next prompt)
    cases = [(torch.randint(0, VOCAB, (1, n_prompt), generator=gen).cuda(), n_new)
             for n_prompt, n_new in ((70, 40), (1, 24), (33, 16))]
    dense = family == "qwen3_5"
    if not dense:
        with pytest.raises(ValueError, match="MoE blocks .* cannot be captured"):
            HybridRunner(target, cuda_graphs=True)
        assert HybridRunner(target).graphs is None
    for graphed in (True, False) if dense else (False,):
        runner = HybridRunner(target, cuda_graphs=graphed)
        target.__dict__["_specla_runner_target"] = runner          # what generate's adapter_for finds
        for drafter in (exact, perturbed):
            drafter.__dict__["_specla_runner_drafter"] = HybridRunner(drafter, "drafter", cuda_graphs=graphed)
        for ids, n_new in cases:
            kwargs = dict(max_new_tokens=n_new, do_sample=False, return_dict_in_generate=True)
            plain = target.generate(ids, **kwargs)
            ours = target.generate(ids, specla=True, **kwargs)
            assert torch.equal(ours.sequences, plain.sequences), (family, graphed, ids.shape[1])
            _assert_same_transformers_cache(ours.past_key_values, plain.past_key_values)
            for drafter in (exact, perturbed):
                for tree in (False, True):
                    spec = target.generate(ids, assistant_model=drafter, tree=tree, confidence_threshold=0.0,
                                           **kwargs)
                    assert torch.equal(spec.sequences, plain.sequences), (family, graphed, ids.shape[1], tree)
                    _assert_same_transformers_cache(spec.past_key_values, plain.past_key_values)
        if not graphed:
            continue
        graphs = runner.graphs
        captured = {k: v is not None for k, v in graphs.calls.items()}
        print(f"{family}: captured {sum(captured.values())} of {len(captured)} calls: {captured}")
        trees = [k for k in graphs.forwards if k[1] is not None and k[0] < 64]
        assert trees, "no tree bucket went through the graphed path"
        # the drafters' own calls and the device loop's acceptance tails bound to them
        drafter_runners = [d.__dict__["_specla_runner_drafter"] for d in (exact, perturbed)]
        drafted = [(k, v is not None) for r in drafter_runners
                   for k, v in (*r.graphs.calls.items(), *graphs.store(owner=r).items())]
        print(f"{family} drafters: captured {sum(c for _, c in drafted)} of {len(drafted)} calls: {drafted}")
        assert any(k[0] == "step tail" for k, _ in drafted)
        assert all(captured.values()), captured
        assert all(g.commit and all(g.commit.values()) for g in graphs.forwards.values() if g.commit)
        assert all(c for _, c in drafted), [k for k, c in drafted if not c]


def test_fused_one_token_step_equals_the_general_path():
    """The fused one-token step (``_decode_step``: GEMVs with the norms, conv, gated norm, residual adds and SwiGLU
    fused around them) and the fused attention of several tokens (``_attention``: one projection GEMM, the
    norm-rotary-append kernel, the gate) give the module path's logits and cache on Qwen3.5 dense, consuming and
    verifying a tree, and follow norm weights updated in place between generations; MoE blocks and Qwen3-Next's
    interleaved projections take the general one-token path."""
    from specla_hf.models.qwen3_5 import supports_fused_step
    assert [supports_fused_step(tiny_hybrid(f)) for f in FAMILIES] == [f == "qwen3_5" for f in FAMILIES]
    model = tiny_hybrid("qwen3_5", seed=4)
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(61))
    fused, general = HybridRunner(model), HybridRunner(model)
    general.fused_step = general.fused_attention = False
    assert all(HybridRunner(tiny_hybrid(f)).fused_attention for f in FAMILIES)
    tree = torch.tensor([[3, 7, 1, 9, 4]]), torch.tensor([[-1, 0, 0, 1, 3]])

    def decode(runner):
        cache = runner.new_cache(1, max_length=32)
        logits = [runner.forward(ids[:, :6], cache, logits_positions=slice(-1, None)).logits]
        logits += [runner.forward(ids[:, i:i + 1], cache).logits for i in range(6, 14)]
        logits.append(runner.forward(tree[0], cache, parents=tree[1]).logits)
        cache.discard()
        return torch.cat(logits, 1), cache
    outputs = []
    for update in (False, True):
        if update:                               # in place, as an optimizer step: the fused calls must see it
            with torch.no_grad():
                for block in model.model.layers:
                    block.post_attention_layernorm.weight.add_(0.3)
                    if hasattr(block, "self_attn"):
                        block.self_attn.q_norm.weight.add_(0.2)
                model.model.norm.weight.mul_(-2.0)
        (want, want_cache), (got, got_cache) = decode(general), decode(fused)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        _assert_same_cache(got_cache, want_cache)
        outputs.append(got)
    assert fused.fused_step and (outputs[1] - outputs[0]).abs().max() > 1e-2        # the update mattered


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_fused_verify_equals_the_general_path(device):
    """Trees verified through ``_verify_fused`` (``fused_verify_max_nodes``: ``fused_gemm`` products with the norms,
    gated norm, residual adds and SwiGLU fused; on CUDA its kernels) give the module path's logits and hidden states
    on Qwen3.5 dense -- a fresh tree, then one hanging off its nodes -- and the same cache once a path is
    committed."""
    model = tiny_hybrid("qwen3_5", seed=6)
    gen = torch.Generator().manual_seed(62)
    with torch.no_grad():                        # norm weights away from their init, so each one's place matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    model.to(device)
    fused, general = HybridRunner(model, cuda_graphs=False), HybridRunner(model, cuda_graphs=False)
    general.fused_step = False
    ids = torch.randint(0, VOCAB, (1, 7 + 6 + 3), generator=gen).to(device)
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]]), torch.tensor([[4, -1, 7]])
    outputs, caches = [], []
    with tuning.using(fused_verify_max_nodes=8):
        for runner in (fused, general):
            calls = record_calls(runner, "_verify_fused")
            cache = runner.new_cache(1, max_length=32)
            runner.forward(ids[:, :7], cache, logits_positions=slice(0, 0))
            first = runner.forward(ids[:, 7:13], cache, parents=parents[0], hidden_layers=(0, 2, 4))
            second = runner.forward(ids[:, 13:], cache, parents=parents[1])
            assert len(calls) == (2 if runner is fused else 0)
            outputs.append((first.logits, second.logits, *first.hidden_states))
            cache.commit(7)
            caches.append(cache)
    for got, want in zip(*outputs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _assert_same_cache(*caches)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_fused_when_the_adapter_is_built(family):
    """Every parameter points at its final storage once the adapter exists: a CUDA graph captured later reads it, and
    one re-pointed after a capture (a prompt's chain graphs, then the one-token step) would leave that graph reading
    freed memory (``one_token.fused_rows``)."""
    model = tiny_hybrid(family, seed=6)
    runner = HybridRunner(model)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    cache = runner.new_cache(1, max_length=32)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(8))
    runner.forward(ids[:, :6], cache, parents=torch.tensor([list(range(-1, 5))]))
    runner.commit(cache, list(range(6)))
    runner.forward(ids[:, 6:7], cache)
    runner.forward(ids[:, 7:9], cache, parents=torch.tensor([[-1, 0]]))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs, emulated on a CPU (``StaticCall``'s re-runs stand in for replays: anything that a real replay would
# not redo, a host integer baked into a graph, shows up as wrong tokens)
# ---------------------------------------------------------------------------------------------------------------
def emulate_hybrid_graphs(model, role: str = "target") -> HybridRunner:
    runner = HybridRunner.for_model(model, role)
    runner.graphs = ForwardGraphs(runner, emulate=True,
                                  max_seq_tokens=DRAFT_SEQ_TOKENS if role == "drafter" else MAX_SEQ_TOKENS)
    runner.bucket_trees = True
    return runner


def test_eager_attention_cache_grows_past_its_capacity(target):
    """Without a reserved length the eager adapter's attention buffers start small and grow on the host: consuming
    and verifying past the first capacity gives the stock forward's logits."""
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(41))
    runner = HybridRunner(target)
    cache = runner.new_cache()
    first = runner.forward(ids[:, :60], cache).logits
    chain = runner.forward(ids[:, 60:150], cache, parents=torch.tensor([list(range(-1, 89))])).logits
    runner.commit(cache, list(range(90)))
    assert {l.capacity for l in cache.others} == {150}         # from 64: as much as the tree needed
    assert {l.committed_length() for l in cache.others} == {150}
    with torch.no_grad():
        stock = target(ids).logits
    torch.testing.assert_close(torch.cat([first, chain], 1), stock, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rows_are_the_modules_output(family, device, dtype):
    """The attention calls' cos / sin are rows of a per-layer table the rotary module computed once: bitwise the
    module's output at any positions below the layer's capacity, the table rebuilt when the layer grows; a rope type
    whose frequencies follow the length runs the module."""
    rotary = tiny_hybrid(family).model.rotary_emb.to(device)
    layer = SpecLAAttentionLayer(1, 1, 16, dtype, torch.device(device), capacity=37)
    x = torch.zeros(1, 1, 16, dtype=dtype, device=device)
    for capacity in (37, 1000):
        layer.key_buffer = layer.value_buffer = torch.zeros(1, 1, capacity, 16, dtype=dtype, device=device)
        positions = torch.randint(0, capacity, (1, 29), generator=torch.Generator().manual_seed(capacity)).to(device)
        for got, want in zip(rotary_rows(rotary, x, positions, layer),
                             rotary(x, rotary_positions(rotary, positions)), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert layer.rotary_table.shape[:2] == (2, capacity)

    class DynamicRotary:
        rope_type = "dynamic"

        def __call__(self, x, positions):
            return "the module's output"
    assert rotary_rows(DynamicRotary(), x, positions, SpecLAAttentionLayer(1, 1, 16, dtype, x.device)) \
        == "the module's output"


def test_graphed_verify_and_commit_equal_eager(family):
    """On the graphed path (a prompt as chains, a tree in two calls, the commit): the logits and the cache equal the
    eager adapter's, and the graphs were replayed."""
    model = tiny_hybrid(family, seed=0)
    eager = HybridRunner(model)
    graphed = emulate_hybrid_graphs(model)
    gen = torch.Generator().manual_seed(43)
    prompt = torch.randint(0, VOCAB, (1, 70), generator=gen)
    parents = [-1, 0, 0, 1, 2, 4, 4, 3, 1]        # the second call's nodes hang off the first's (padded to 8)
    tokens = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
    caches, outputs = [], []
    for runner in (eager, graphed):
        cache = runner.new_cache(1, max_length=100)
        out = [runner.forward(prompt, cache, logits_positions=slice(-1, None)).logits]
        out.append(runner.forward(tokens[:, :5], cache, parents=torch.tensor([parents[:5]])).logits)
        out.append(runner.forward(tokens[:, 5:], cache, parents=torch.tensor([parents[5:]])).logits)
        runner.commit(cache, [0, 2, 4])
        out.append(runner.forward(tokens[:, :1], cache).logits)
        caches.append(cache)
        outputs.append(torch.cat(out, 1))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
    _assert_same_cache(caches[1], caches[0])
    forwards = graphed.graphs.forwards
    assert {k[:2] for k in forwards if k[1] is not None} == {(64, 0), (8, 0), (4, 8)}
    assert all(g.commit and all(g.commit.values()) for k, g in forwards.items() if k[:2] == (64, 0))


def test_graphed_decoding_equals_plain(family):
    """With (emulated) CUDA graphs: SpecLA's autoregressive loop, chain and tree speculation with an exact and a
    perturbed drafter, short and chained prompts, equal plain greedy decoding, and ``past_key_values`` is the cache
    plain decoding leaves; a longer generation than the reserved cache holds replaces it (and drops its graphs)."""
    model = tiny_hybrid(family, seed=0)
    exact, perturbed = copy.deepcopy(model), copy.deepcopy(model)
    gen = torch.Generator().manual_seed(47)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.005 * torch.randn(p.shape, generator=gen))
    runner = emulate_hybrid_graphs(model)
    for n_prompt, n_new in ((1, 20), (70, 16)):
        ids = torch.randint(0, VOCAB, (1, n_prompt), generator=gen)
        plain = model.generate(ids, max_new_tokens=n_new, do_sample=False, return_dict_in_generate=True)
        ours = model.generate(ids, max_new_tokens=n_new, do_sample=False, specla=True, return_dict_in_generate=True)
        assert torch.equal(ours.sequences, plain.sequences), n_prompt
        _assert_same_transformers_cache(ours.past_key_values, plain.past_key_values)
        for drafter in (exact, perturbed):
            for tree in (False, True):
                spec = model.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                                      confidence_threshold=0.0)
                assert torch.equal(spec, plain.sequences), (n_prompt, tree)
    assert runner.graphs.calls[("ar step",)] is not None
    assert any(k[1] is not None and k[0] < 64 for k in runner.graphs.forwards)       # tree buckets
    capacity = runner.last_cache.others[0].capacity
    ids = torch.randint(0, VOCAB, (1, 4), generator=gen)
    plain = model.generate(ids, max_new_tokens=capacity, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=capacity, do_sample=False, specla=True), plain)
    assert runner.last_cache.others[0].capacity > capacity and runner.graphs.calls[("ar step",)] is not None


def test_graphed_hybrid_drafters_draft_as_eager(family, drafters):
    """With (emulated) CUDA graphs on the target and on a hybrid drafter (a copy, a perturbed copy, a small model):
    chains and trees, in the device loop and the host loop (a threshold), after a one-token prompt and one the
    drafter consumes as chains, draft, accept and emit exactly what the eager drafter does, and a second generate()
    replays the first one's graphs: the drafter's catch-up, depths and commits, and the device loop's acceptance
    tail."""
    model = tiny_hybrid(family, seed=0)
    gen = torch.Generator().manual_seed(59)
    cases = [(torch.randint(0, VOCAB, (1, n_prompt), generator=gen), n_new) for n_prompt, n_new in ((1, 16), (70, 12))]
    settings = [(False, 0.0), (True, 0.0), (True, 0.05)]
    drafters = {name: copy.deepcopy(d) for name, d in drafters.items()}   # the module's drafters stay eager

    def run(drafter):
        runs = []
        for ids, n_new in cases:
            for tree, threshold in settings:
                seq = model.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                                     confidence_threshold=threshold, adaptive_drafting=False)     # fixed shapes
                runs.append((seq, model.specla_stats.draft_nodes, model.specla_stats.accepted))
        return runs
    eager = {name: run(d) for name, d in drafters.items()}
    target_runner = emulate_hybrid_graphs(model)
    for name, drafter in drafters.items():
        runner = emulate_hybrid_graphs(drafter, "drafter")
        for trial in range(2):
            for got, want in zip(run(drafter), eager[name]):
                assert torch.equal(got[0], want[0]) and got[1:] == want[1:], (name, trial)
        assert adapter_for(drafter, "drafter") is runner and all(l.fixed for l in runner.last_cache.others)
        keys = list(runner.graphs.forwards)
        assert any(k[1] is None and k[0] > 1 for k in keys) and any(k[:2] == (64, 0) for k in keys), name
        assert any(k[1] == "depth" and v is not None for k, v in runner.graphs.calls.items())
        tails = target_runner.graphs.store(owner=runner)
        assert tails and all(k[0] == "step tail" and v is not None for k, v in tails.items())


def test_moe_models_run_without_graphs():
    """transformers' MoE experts copy between host and GPU inside their forward, which a capture refuses: the MoE
    families' adapters, and a MoE checkpoint's MTP head, default to eager calls and refuse ``cuda_graphs=True``
    with the reason, before the device is looked at."""
    for family in ("qwen3_5_moe", "qwen3_next"):
        model = tiny_hybrid(family, seed=0)
        with pytest.raises(ValueError, match=r"cuda_graphs=True: the MoE blocks \(\w+\) cannot be captured"):
            HybridRunner(model, cuda_graphs=True)
        assert HybridRunner(model).graphs is None
    assert HybridRunner(tiny_hybrid("qwen3_5", seed=0)).graph_blocker() is None


def test_a_failed_capture_runs_that_call_eagerly(monkeypatch):
    """A call whose capture fails (on a GPU: a host sync inside it) warns and runs eagerly, forward calls included:
    decoding stays exact."""
    import specla_hf.runtime.graphs as rg
    model = tiny_hybrid("qwen3_5", seed=2)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(53))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    drafter = copy.deepcopy(model)
    runner = emulate_hybrid_graphs(model)

    class Broken(rg.StaticCall):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(rg, "StaticCall", Broken)
    with pytest.warns(RuntimeWarning, match="capturing a forward call in a CUDA graph failed .* eagerly"):
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, specla=True), plain)
    for tree in (False, True):            # (a bucket whose capture failed before runs eagerly without a word)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                          tree=tree, confidence_threshold=0.0), plain)
    assert len(runner.graphs.forwards) > 1 and all(g is None for g in runner.graphs.forwards.values())


def test_tree_attention_backends_choose_kernels_not_tokens():
    """``tuning``'s ``tree_attention_backends`` picks the kernels of the attention modules' calls (an A/B on a GPU,
    ``hybrid_bench.py --tree-attention``): greedy output stays plain decoding's, transformers' attention registry
    is left as it was, and an unknown backend is a clear error naming the choices."""
    model = tiny_hybrid("qwen3_5", seed=4)
    drafter = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(61))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    for backends in (("math",), ("specla", "math"), ()):
        with tuning.using(tree_attention_backends=backends):
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                              tree=True, confidence_threshold=0.0), plain)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    with tuning.using(tree_attention_backends=("fastest",)):
        with pytest.raises(ValueError,
                           match=r"unknown attention backends \['fastest'\]; choose from .*'math'.*'specla'"):
            model.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
