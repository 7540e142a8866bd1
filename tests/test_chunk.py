"""The chunked torch gated delta rule against the token-by-token reference: outputs, final state and gradients."""
import pytest
import torch

from specla_kernels.chunk import chunk_gated_delta_rule_torch
from specla_kernels.reference import recurrent_gated_delta_rule_ref


def _inputs(B, T, H, HV, K, V, with_state, seed=0, g_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen) * g_scale
    beta = torch.rand(B, T, HV, generator=gen)
    s0 = torch.randn(B, HV, V, K, generator=gen) if with_state else None
    return q, k, v, g, beta, s0


def _run(fn, inputs, do, dS, **kw):
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    q, k, v, g, beta, s0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=s0, **kw)
    ((o * do).sum() + (S * dS).sum()).backward()
    return o.detach(), S.detach(), [x.grad for x in leaves if x is not None]


@pytest.mark.parametrize("B,T,H,HV,K,V,chunk,with_state", [
    (2, 77, 2, 2, 16, 32, 16, True),     # odd T over several chunks, with an initial state
    (1, 45, 2, 6, 16, 16, 16, False),    # grouped value heads (HV = 3 H), T not a multiple of the chunk
    (2, 9, 1, 2, 8, 24, 64, True),       # T shorter than one chunk
    (1, 128, 2, 2, 32, 64, 64, True),    # the default chunk size, exact multiple
])
def test_chunk_matches_recurrent_reference(B, T, H, HV, K, V, chunk, with_state):
    inputs = _inputs(B, T, H, HV, K, V, with_state)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, HV, V, generator=gen)
    dS = torch.randn(B, HV, V, K, generator=gen)
    o_c, S_c, grads_c = _run(chunk_gated_delta_rule_torch, inputs, do, dS, chunk_size=chunk)
    o_r, S_r, grads_r = _run(recurrent_gated_delta_rule_ref, inputs, do, dS)
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S_c, S_r, rtol=1e-4, atol=1e-5)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for name, gc, gr in zip(names, grads_c, grads_r):
        torch.testing.assert_close(gc, gr, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_strong_decay_keeps_gradients_finite():
    """Log-decays summing to -1e3 within a chunk: exp must never see a positive exponent (inf * 0 = nan)."""
    inputs = _inputs(1, 64, 2, 2, 16, 16, True, g_scale=40.0)
    o, S, grads = _run(chunk_gated_delta_rule_torch, inputs, torch.ones(1, 64, 2, 16), torch.ones(1, 2, 16, 16))
    o_r, S_r, _ = _run(recurrent_gated_delta_rule_ref, inputs, torch.ones(1, 64, 2, 16), torch.ones(1, 2, 16, 16))
    assert all(torch.isfinite(x).all() for x in grads)
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-5)


def test_low_precision_inputs_keep_dtype_and_fp32_state():
    q, k, v, g, beta, s0 = _inputs(1, 33, 2, 2, 16, 16, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = chunk_gated_delta_rule_torch(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=s0,
                                            chunk_size=16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_r, S_r = recurrent_gated_delta_rule_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=s0)
    torch.testing.assert_close(S, S_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o.float(), o_r.float(), rtol=2e-2, atol=2e-2)
