"""GDNRunner against the stock fla model: consuming tokens, verifying trees, committing any accepted path."""
import pytest
import torch

from conftest import VARIANTS, record_calls, tiny_gdn
from specla_hf.models.fla_gdn import GDNRunner
from specla_kernels.reference import chain_parents, tree_ancestors
from test_reference import random_parents

SHAPES = {**VARIANTS, "unfused_norm": dict(fuse_norm=False, layers=3, hidden=48, head_dim=8, heads=3)}


@pytest.mark.parametrize("name", SHAPES)
def test_consuming_tokens_equals_fla_forward(name):
    model = tiny_gdn(seed=5, **SHAPES[name])
    ids = torch.randint(0, 97, (2, 23))
    ref = model(ids).logits
    runner = GDNRunner(model)
    cache = runner.new_cache(2)
    a = runner.forward(ids[:, :10], cache, logits_positions=slice(None)).logits
    b = runner.forward(ids[:, 10:11], cache, logits_positions=slice(None)).logits
    c = runner.forward(ids[:, 11:], cache, logits_positions=slice(None)).logits
    torch.testing.assert_close(torch.cat([a, b, c], 1), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("accept", [-1, 0, 3, 6])
def test_verify_then_commit_equals_token_by_token(name, accept):
    """Verify a chain of 7 from the committed state, commit `accept`, continue: all equal to plain recurrence."""
    model = tiny_gdn(seed=6, **SHAPES[name])
    runner = GDNRunner(model)
    ids = torch.randint(0, 97, (1, 20))
    cache = runner.new_cache()
    runner.forward(ids[:, :8], cache)
    state_before = [layer.state.clone() for layer in cache.layers]
    out = runner.forward(ids[:, 8:15], cache, parents=chain_parents(7))
    for layer, s in zip(cache.layers, state_before):   # the verify pass leaves the committed state untouched
        assert torch.equal(layer.state, s)
    cache.commit(accept)
    kept = 8 + accept + 1
    ref_cache = runner.new_cache()
    ref_logits = runner.forward(ids[:, :15], ref_cache, logits_positions=slice(None)).logits
    torch.testing.assert_close(out.logits, ref_logits[:, 8:15], rtol=1e-4, atol=1e-5)

    ref_cache = runner.new_cache()
    runner.forward(ids[:, :kept], ref_cache)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(layer.state, ref_layer.state, rtol=1e-4, atol=1e-5)
        if ref_layer.window is not None:
            torch.testing.assert_close(layer.window, ref_layer.window)
        assert layer.k_hat.shape[1] == 0            # factors cleared after commit
    nxt = runner.forward(ids[:, kept:kept + 3], cache, logits_positions=slice(None)).logits
    ref_nxt = runner.forward(ids[:, kept:kept + 3], ref_cache, logits_positions=slice(None)).logits
    torch.testing.assert_close(nxt, ref_nxt, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["star", "bushy", "deep", "forest"])
def test_tree_verify_equals_each_path(kind):
    model = tiny_gdn(seed=7, v_heads=4)
    runner = GDNRunner(model)
    gen = torch.Generator().manual_seed(len(kind))
    N = 9
    parents = torch.tensor([random_parents(N, kind, gen)])
    prompt = torch.randint(0, 97, (1, 6))
    nodes = torch.randint(0, 97, (1, N))
    cache = runner.new_cache()
    runner.forward(prompt, cache)
    out = runner.forward(nodes, cache, parents=parents).logits
    anc = tree_ancestors(parents)[0]
    for i in range(N):
        path = anc[i].nonzero().flatten()
        ref_cache = runner.new_cache()
        seq = torch.cat([prompt, nodes[:, path]], 1)
        ref = runner.forward(seq, ref_cache, logits_positions=slice(-1, None)).logits
        torch.testing.assert_close(out[:, i], ref[:, 0], rtol=1e-4, atol=1e-5)
    # commit a leaf: the state equals the one after consuming its path
    leaf = N - 1
    cache.commit(leaf)
    ref_cache = runner.new_cache()
    runner.forward(torch.cat([prompt, nodes[:, anc[leaf].nonzero().flatten()]], 1), ref_cache)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(layer.state, ref_layer.state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.window, ref_layer.window)


def test_tree_extension_equals_one_pass():
    model = tiny_gdn(seed=8)
    runner = GDNRunner(model)
    prompt, nodes = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 6))
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    c1, c2 = runner.new_cache(), runner.new_cache()
    runner.forward(prompt, c1)
    runner.forward(prompt, c2)
    whole = runner.forward(nodes, c1, parents=parents).logits
    part = [runner.forward(nodes[:, :1], c2, parents=parents[:, :1]).logits,
            runner.forward(nodes[:, 1:3], c2, parents=parents[:, 1:3]).logits,
            runner.forward(nodes[:, 3:], c2, parents=parents[:, 3:]).logits]
    torch.testing.assert_close(torch.cat(part, 1), whole, rtol=1e-4, atol=1e-5)


def test_factor_memory_is_compact():
    """Per draft node the cache keeps K + V + 1 numbers per head (+ raw conv inputs), never a state."""
    model = tiny_gdn(seed=9)
    runner = GDNRunner(model)
    cache = runner.new_cache()
    runner.forward(torch.randint(0, 97, (1, 4)), cache)
    runner.forward(torch.randint(0, 97, (1, 16)), cache, parents=chain_parents(16))
    state_bytes = sum(layer.state.numel() * 4 for layer in cache.layers)
    assert cache.factor_bytes() < 16 * state_bytes / 4   # far below a snapshot per node


def test_for_model_rebuilds_the_runner_after_a_dtype_change():
    model = tiny_gdn(seed=61)
    runner = GDNRunner.for_model(model)
    assert GDNRunner.for_model(model) is runner
    model.to(torch.float64)
    rebuilt = GDNRunner.for_model(model)
    assert rebuilt is not runner and rebuilt.new_cache(1).layers[0].window.dtype == torch.float64
    model.to(torch.float32)


def _spread_norm_weights(model, seed: int) -> None:
    """fla initialises every norm weight to one; random ones catch a norm weight applied to the wrong elements."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


@pytest.mark.parametrize("name", [*VARIANTS, "unfused_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("products", ["gemv", "fused_gemm"])
def test_fused_decode_step_equals_general_path(name, dtype, products):
    """Batch-1 one-token steps through ``_decode_step`` (fused GEMVs, or ``fused_gemm`` on one row under
    ``one_token_fused_gemm``; in-place recurrence) give the general path's logits, state and conv window, step after
    step; models it cannot compute take the general path."""
    from specla_hf.models.fla_gdn import supports_fused_step
    from specla_kernels import tuning
    model = tiny_gdn(seed=6, **SHAPES[name]).to(dtype)
    _spread_norm_weights(model, 6)
    fused, general = GDNRunner(model), GDNRunner(model)
    assert fused.fused_step == supports_fused_step(model) == (name not in ("no_conv", "no_gate", "unfused_norm"))
    general.fused_step = False
    caches = fused.new_cache(1), general.new_cache(1)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(6))
    for runner, cache in zip((fused, general), caches):
        runner.forward(ids[:, :5], cache, logits_positions=slice(0, 0))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for t in range(5, 12):
        with tuning.using(one_token_fused_gemm=products == "fused_gemm"):
            a, b = (runner.forward(ids[:, t:t + 1], cache).logits for runner, cache in zip((fused, general), caches))
        torch.testing.assert_close(a, b, **tol)
        for la, lb in zip(*(c.layers for c in caches)):
            torch.testing.assert_close(la.state, lb.state, **tol)
            if la.window is not None:
                torch.testing.assert_close(la.window, lb.window, **tol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("name", ["base", "gva", "neg_eig"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_verify_equals_general_path(name, dtype, device):
    """Trees verified through ``_verify_fused`` (``fused_verify_max_nodes``; on CUDA its ``fused_gemm`` kernels)
    give the general path's logits, hidden states and factors -- a fresh tree, then one extending its pending nodes
    -- and the same state once a path is committed; a tree above the limit takes the general path."""
    from specla_kernels import tuning
    model = tiny_gdn(seed=11, **SHAPES[name]).to(device, dtype)
    _spread_norm_weights(model, 11)
    fused, general = GDNRunner(model, cuda_graphs=False), GDNRunner(model, cuda_graphs=False)
    general.fused_step = False
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 97, (1, 6 + 9 + 4), generator=gen).to(device)
    parents = torch.tensor([random_parents(9, "bushy", gen)])
    extension = torch.tensor([[-1, 9, 3, 11]])                  # a new root, and children of pending nodes
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    verified, caches = [], []
    with tuning.using(fused_verify_max_nodes=9):
        for runner in (fused, general):
            cache = runner.new_cache(1)
            runner.forward(ids[:, :6], cache, logits_positions=slice(0, 0))
            calls = record_calls(runner, "_verify_fused")
            first = runner.forward(ids[:, 6:15], cache, parents=parents, hidden_layers=(0, 2))
            second = runner.forward(ids[:, 15:], cache, parents=extension)
            with tuning.using(fused_verify_max_nodes=3):      # 4 nodes: above the limit
                runner.forward(ids[:, 15:], runner.new_cache(1), parents=chain_parents(4))
            assert len(calls) == (2 if runner is fused else 0), name
            verified.append((first, second))
            caches.append(cache)
    (a1, a2), (b1, b2) = verified
    torch.testing.assert_close(a1.logits, b1.logits, **tol)
    torch.testing.assert_close(a2.logits, b2.logits, **tol)
    for ha, hb in zip(a1.hidden_states, b1.hidden_states, strict=True):
        torch.testing.assert_close(ha, hb, **tol)
    for la, lb in zip(*(c.layers for c in caches)):
        for fa, fb in ((la.k_hat, lb.k_hat), (la.u, lb.u), (la.g, lb.g), (la.x, lb.x)):
            torch.testing.assert_close(fa, fb, **tol)
    for cache in caches:
        cache.commit(11)
    for la, lb in zip(*(c.layers for c in caches)):
        torch.testing.assert_close(la.state, lb.state, **tol)
        torch.testing.assert_close(la.window, lb.window, **tol)


def test_inputs_wider_than_the_gemv_tile_take_the_general_path(monkeypatch):
    """The fused GEMVs keep the whole input in registers: a wider model is not given the fused step."""
    import specla_hf.models.fla_gdn as gdn
    model = tiny_gdn(seed=7)
    assert gdn.supports_fused_step(model)
    monkeypatch.setattr(gdn, "GEMV_MAX_K", model.config.hidden_size - 1)
    assert not gdn.supports_fused_step(model)
    runner = GDNRunner(model)
    assert not runner.fused_step
    ids = torch.randint(0, 97, (1, 6))
    cache = runner.new_cache(1)
    runner.forward(ids[:, :5], cache, logits_positions=slice(0, 0))
    torch.testing.assert_close(runner.forward(ids[:, 5:], cache).logits[:, -1], model(ids).logits[:, -1],
                               rtol=1e-4, atol=1e-5)


def test_value_heads_narrower_than_a_fused_gemm_step_take_the_general_path():
    """A tree pass's ``fused_gemm`` steps K by one gated head, at least 16 wide (``tl.dot``): 8-wide value heads leave
    the model on the general path, whose verify pass matches fla's forward."""
    from specla_hf.models.fla_gdn import supports_fused_step
    model = tiny_gdn(seed=8, head_dim=4)                         # value heads of 8 (expand_v 2)
    assert model.model.layers[0].attn.head_v_dim == 8 and not supports_fused_step(model)
    runner = GDNRunner(model)
    assert not runner.fused_step
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    cache = runner.new_cache(1)
    runner.forward(ids[:, :5], cache, logits_positions=slice(0, 0))
    torch.testing.assert_close(runner.forward(ids[:, 5:], cache, parents=chain_parents(4)).logits,
                               model(ids).logits[:, 5:], rtol=1e-4, atol=1e-5)


def test_weights_are_fused_when_the_adapter_is_built():
    """Every parameter points at its final storage once the adapter exists: a CUDA graph captured later reads it, and
    one re-pointed after a capture would leave that graph reading freed memory (``one_token.fused_rows``)."""
    model = tiny_gdn(seed=8)
    runner = GDNRunner(model)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    cache = runner.new_cache(1)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    runner.forward(ids[:, :6], cache)
    runner.forward(ids[:, 6:7], cache)
    runner.forward(ids[:, 7:9], cache, parents=torch.tensor([[-1, 0]]))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
