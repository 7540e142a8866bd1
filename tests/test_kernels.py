"""Triton kernels against the torch reference.

CPU cases run the kernels in Triton's interpreter at tiny, deliberately awkward sizes. ``TRITON_INTERPRET=1`` must be
set before Triton is imported, and conftest imports it (through fla) before this module, so a plain run hands the CPU
cases to a child pytest started with the variable set (``test_cpu_cases_under_interpreter``); the variable never
leaks into other test modules. With a GPU the same tests run compiled at the fla 1.3B GDN shapes (K=256, V=512,
6 heads). Every check draws fresh random inputs and random tree topologies, and every output buffer the kernels
allocate starts poisoned with NaN, so an element a kernel forgets to write fails the test.
"""
import functools
import itertools
import os
import subprocess
import sys
import zlib

import pytest
import torch
import triton
import triton.language as tl

from specla_kernels import accept as accept_kernels
from specla_kernels import commit as commit_kernels
from specla_kernels import tuning
from specla_kernels import ops
from specla_kernels import reference as ref
from specla_kernels.ops import commit_, commit_state_, commit_window_
from specla_kernels.draw import _kth_key
from specla_kernels.gate import gdn_gate_beta
from specla_kernels.masked_attention import masked_attention as masked_attention_kernel
from specla_kernels.topk import row_topk as topk_kernel
from specla_kernels.tree_conv import tree_conv, tree_conv_gates
from specla_kernels.tree_delta import INTERPRETED, tree_ancestors, tree_gated_delta_rule

DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.interpret, pytest.mark.skipif(
        not INTERPRETED, reason="run by test_cpu_cases_under_interpreter in a child with TRITON_INTERPRET=1")]),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
# (B, H, HV, K, V) for fp32 / bf16 cases: tiny, non-power-of-two, grouped value heads on CPU; on CUDA the 1.3B layer
# (bf16, as the model runs) and a grouped-value-head twin
SHAPES = {"cpu": [(2, 1, 2, 20, 24), (1, 2, 2, 24, 40)], "cuda": [(2, 3, 6, 256, 512), (1, 6, 6, 256, 512)]}
# Qwen3.5's GDN layers on CUDA (0.8B: 16 / 16 heads of 128; 9B: 16 / 32)
QWEN3_5_SHAPES = [(1, 16, 16, 128, 128), (1, 16, 32, 128, 128)]
# node counts per topology
SIZES = {"cpu": dict(chain=19, star=7, deep=100, bushy=45, single=1, forest=23),
         "cuda": dict(chain=64, star=16, deep=128, bushy=100, single=1, forest=37)}
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# u is fp32 whatever the inputs: from bf16 inputs the WY/UT kernel forms it from exact bf16 products and bf16x3 ones
# (~16 mantissa bits), so it must be far closer than the inputs' rounding (one bf16 product would give ~2e-3)
U_TOL = {**TOL, torch.bfloat16: 1e-4}
# the model dtypes of the tree kernels' inputs (state and factors stay fp32); the GEMV and norm kernels serve the
# fp32 / bf16 models the decoding loop runs
MODEL_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                       ids=["fp32", "bf16", "fp16"])


def seeded(*key) -> torch.Generator:
    """A generator seeded from the test case, so that a failure reproduces."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(out: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == want.shape, what
    assert torch.isfinite(out).all(), f"{what}: NaN/inf (an element was not written?)"
    err = rel(out, want)
    assert err < tol, f"{what}: rel err {err:.2e} >= {tol:.0e}"


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Every floating tensor the kernels' wrappers allocate with ``empty_like``/``new_empty`` starts as NaN."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(new_empty(self, *a, **kw)))


@pytest.mark.interpret
@pytest.mark.skipif(INTERPRETED, reason="this process already interprets: the CPU cases run here")
def test_cpu_cases_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider",
                          "-k", "cpu and not test_cpu_cases_under_interpreter"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = [line for line in run.stdout.splitlines() if " passed" in line]
    assert summary and "skipped" not in summary[-1], run.stdout[-2000:]       # every CPU case really ran


def random_parents(kind: str, batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Parent pointers (``parents[b, i] < i``, -1 = child of the committed state); each batch row its own tree."""
    rows = []
    for _ in range(batch):
        r = torch.rand(n, generator=gen)
        p = []
        for i in range(n):
            if kind == "chain":
                p.append(i - 1)
            elif kind == "star":
                p.append(-1 if i == 0 else 0)
            elif kind == "deep":        # mostly a chain, with side branches
                p.append(i - 1 if r[i] < 0.85 or i < 2 else int(torch.randint(0, i, (1,), generator=gen)))
            elif kind == "bushy":       # random recursive tree: shallow, many children per node
                p.append(int(torch.randint(-1, i, (1,), generator=gen)) if i else -1)
            elif kind == "forest":      # several roots on the committed state
                p.append(-1 if i == 0 or r[i] < 0.3 else int(torch.randint(0, i, (1,), generator=gen)))
            elif kind == "single":
                p.append(-1)
        rows.append(p)
    return torch.tensor(rows, dtype=torch.long)


def gdn_inputs(B, N, H, HV, K, V, dtype, device, gen):
    """q, k, v in ``dtype`` and the fp32 gates, as fla's layer would produce them (g <= 0, beta in (0, 1))."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)
    q, k, v = rnd(B, N, H, K).to(dtype), rnd(B, N, H, K).to(dtype), rnd(B, N, HV, V).to(dtype)
    g = -torch.rand(B, N, HV, generator=gen).to(device) * 0.3
    beta = torch.rand(B, N, HV, generator=gen).to(device)
    state = rnd(B, HV, V, K) * 0.5
    return q, k, v, g, beta, state


# ----------------------------------------------------------------------------------------------------------------
# gated delta rule over a tree
# ----------------------------------------------------------------------------------------------------------------
# the WY/UT kernel's solves: the block solve, and sweeps up to depth 16 (deeper trees, the chains and deep trees of
# SIZES, then take the block solve inside the same kernel)
SOLVES = pytest.mark.parametrize("solve", [dict(SWEEP_MAX=0), dict(SWEEP_MAX=16)], ids=["block", "sweeps"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "star", "deep", "bushy", "single", "forest"])
@MODEL_DTYPES
@SOLVES
def test_tree_delta_matches_reference(device, kind, dtype, solve):
    gen = seeded(kind, dtype)
    B, H, HV, K, V = SHAPES[device][dtype != torch.float32]
    N = SIZES[device][kind]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, dtype, device, gen)
    parents = random_parents(kind, B, N, gen).to(device)
    state_before = state.clone()
    cfg = solve
    o, k_hat, u = tree_gated_delta_rule(q, k, v, g, beta, parents, state, config=cfg)
    o_ref, k_hat_ref, u_ref = ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)
    assert o.dtype == v.dtype and k_hat.dtype == u.dtype == torch.float32
    check(o, o_ref, TOL[dtype], "o")
    check(k_hat, k_hat_ref, TOL[dtype], "k_hat")
    check(u, u_ref, U_TOL[dtype], "u")
    assert torch.equal(state, state_before), "verification must not touch the committed state"
    # the mask given (as the runner gives every layer the cache's) computes the same
    anc = ref.tree_ancestors(parents.cpu()).to(device)
    given = tree_gated_delta_rule(q, k, v, g, beta, parents, state, ancestors=anc, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(given, (o, k_hat, u)))
    with pytest.raises(ValueError, match="ancestors"):
        tree_gated_delta_rule(q, k, v, g, beta, parents, state, ancestors=torch.ones(B, N, N + 1, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", QWEN3_5_SHAPES, ids=["qwen3.5-0.8b", "qwen3.5-9b"])
@pytest.mark.parametrize("kind", ["chain", "bushy", "single"])
@MODEL_DTYPES
def test_tree_delta_at_qwen3_5_shapes(shape, kind, dtype):
    """The tree kernel at Qwen3.5's GDN head dims (128) and value-head grouping, against the reference."""
    gen = seeded("qwen3.5", shape, kind, dtype)
    B, H, HV, K, V = shape
    N = SIZES["cuda"][kind]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, dtype, "cuda", gen)
    parents = random_parents(kind, B, N, gen).cuda()
    o, k_hat, u = tree_gated_delta_rule(q, k, v, g, beta, parents, state)
    o_ref, k_hat_ref, u_ref = ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)
    check(o, o_ref, TOL[dtype], "o")
    check(k_hat, k_hat_ref, TOL[dtype], "k_hat")
    check(u, u_ref, U_TOL[dtype], "u")


@pytest.mark.parametrize("device", DEVICES)
@MODEL_DTYPES
def test_small_trees_both_kernels_match_reference(device, dtype):
    """Up to 8 nodes both kernels can run (the node-by-node one by default up to ``SMALL_MAX``): each equals the
    reference on chains, stars, random trees and forests of every size, with grouped value heads on the GPU."""
    gen = seeded("small", dtype)
    B, H, HV, K, V = SHAPES[device][dtype != torch.float32]
    sizes = range(1, 9) if device == "cuda" else (1, 3, 4, 6)
    for kind in ("chain", "star", "bushy", "forest"):
        for N in sizes:
            q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, dtype, device, gen)
            parents = random_parents(kind, B, N, gen).to(device)
            want = ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)
            for small in (True, False):
                got = tree_gated_delta_rule(q, k, v, g, beta, parents, state, config=dict(SMALL=small))
                for x, w, name in zip(got, want, ("o", "k_hat", "u")):
                    check(x, w, TOL[dtype], f"{kind} of {N} nodes, {'small' if small else 'WY'} kernel: {name}")
    with pytest.raises(ValueError, match="at most 8"):
        tree_gated_delta_rule(*gdn_inputs(1, 9, H, HV, K, V, dtype, device, gen)[:5],
                              ref.chain_parents(9, device=device), state[:1], config=dict(SMALL=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "deep", "chain17"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@SOLVES
def test_tree_delta_is_stable_on_repeated_tokens(device, kind, dtype, solve):
    """The hard case for the solve: one key repeated along long paths, writes at full strength, no decay, so the
    strictly lower L is ~all ones on ancestors (its powers grow like binomial coefficients: a Neumann product of them
    loses fp32 precision; substitution, block doubling and sweeps must not, in tf32x3 or in bf16x3). ``chain17``: a
    chain of depth 16, the deepest that sweeps take, where their intermediate values grow the most."""
    gen = seeded(kind, 'repeated')
    B, H, HV, K, V = SHAPES[device][dtype != torch.float32]
    N = 17 if kind == "chain17" else SIZES[device][kind]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, dtype, device, gen)
    k = k[:, :1].expand_as(k).contiguous()
    g, beta = torch.full_like(g, -1e-4), torch.full_like(beta, 0.999)
    parents = random_parents(kind.removesuffix("17"), B, N, gen).to(device)
    want = ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)
    got = tree_gated_delta_rule(q, k, v, g, beta, parents, state, config=solve)
    for x, w, name in zip(got, want, ("o", "k_hat", "u")):
        check(x, w, TOL[dtype] if name == "o" else 1e-3, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "single"])
def test_tree_delta_reads_column_slices_in_place(device, kind):
    """q, k, v as column slices of one wider [B, N, D] tensor (the runner's conv output): same results as contiguous
    inputs, for several sequences and for a single node."""
    gen = seeded(kind, 'strided')
    B, H, HV, K, V = SHAPES[device][0]
    N = SIZES[device][kind]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, torch.float32, device, gen)
    wide = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2), torch.zeros(B, N, 3, device=device)], -1)
    qs, ks, vs = torch.split(wide[..., :-3], [H * K, H * K, HV * V], -1)
    qs, ks, vs = qs.view(B, N, H, K), ks.view(B, N, H, K), vs.view(B, N, HV, V)
    assert not qs.is_contiguous()
    parents = random_parents(kind, B, N, gen).to(device)
    for got, want in zip(tree_gated_delta_rule(qs, ks, vs, g, beta, parents, state),
                         tree_gated_delta_rule(q, k, v, g, beta, parents, state)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "star", "deep", "bushy", "single", "forest"])
def test_tree_ancestors_matches_reference(device, kind):
    """The ancestor mask kernel (built once per tree, read by every layer's verify and the commit) on each topology
    and on every padded size (non-powers of two, up to 128 nodes)."""
    gen = seeded(kind, 'ancestors')
    for n in {SIZES[device][kind], 3, 17, 128} if kind not in ("single", "star") else {SIZES[device][kind]}:
        parents = random_parents(kind, 3, n, gen).to(device)
        assert torch.equal(tree_ancestors(parents).cpu(), ref.tree_ancestors(parents.cpu())), f"{kind}, {n} nodes"


@pytest.mark.parametrize("device", DEVICES)
def test_tree_equals_its_paths(device):
    """Verifying a tree gives, at every node, what verifying its root-to-node path as a chain gives."""
    gen = torch.Generator().manual_seed(7)
    B, H, HV, K, V = SHAPES[device][1]
    N = SIZES[device]["bushy"]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, torch.float32, device, gen)
    parents = random_parents("bushy", B, N, gen).to(device)
    o, k_hat, u = tree_gated_delta_rule(q, k, v, g, beta, parents, state)
    anc = ref.tree_ancestors(parents.cpu())
    for b in range(B):
        leaves = [i for i in range(N) if not (parents[b] == i).any()]
        for leaf in leaves[:4]:
            path = torch.nonzero(anc[b, leaf]).flatten().to(device)     # ancestors in index (= path) order
            pick = lambda t: t[b:b + 1, path]                            # noqa: E731
            chain = ref.chain_parents(len(path), 1, device=device)
            o_p, _, u_p = tree_gated_delta_rule(pick(q), pick(k), pick(v), pick(g), pick(beta), chain, state[b:b + 1])
            check(o[b:b + 1, path], o_p, 1e-4, f"o on path to {leaf}")
            check(u[b:b + 1, path], u_p, 1e-4, f"u on path to {leaf}")


@pytest.mark.parametrize("device", DEVICES)
def test_chain_verify_then_commit_equals_recurrence(device):
    """A chain verified in one pass and committed at node m equals fla's token-by-token recurrence over m+1 tokens."""
    gen = torch.Generator().manual_seed(11)
    B, H, HV, K, V = SHAPES[device][1]
    N = SIZES[device]["chain"]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, torch.float32, device, gen)
    o, k_hat, u = tree_gated_delta_rule(q, k, v, g, beta, ref.chain_parents(N, B, device=device), state)
    o_rec, _ = ref.recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    check(o, o_rec, 1e-3, "o vs recurrence")
    m = N // 2
    s = state.clone()
    commit_state_(s, k_hat, u, g, ref.chain_parents(N, B, device=device), torch.full((B,), m, device=device))
    _, s_rec = ref.recurrent_gated_delta_rule_ref(q[:, :m + 1], k[:, :m + 1], v[:, :m + 1], g[:, :m + 1],
                                                  beta[:, :m + 1], state)
    check(s, s_rec, 1e-3, "committed state vs recurrence")


def test_tree_delta_rejects_prefix():
    q = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ValueError):
        tree_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], ref.chain_parents(2), torch.zeros(1, 1, 16, 16),
                              prefix=(q, q, q[..., 0]))


# ----------------------------------------------------------------------------------------------------------------
# commit
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "bushy", "forest", "single"])
def test_commit_state_matches_reference(device, kind):
    gen = seeded(kind, 'commit')
    B, H, HV, K, V = SHAPES[device][0]
    B = 3
    Nt = SIZES[device][kind]
    k_hat = ref.l2norm(torch.randn(B, Nt, H, K, generator=gen)).to(device)
    u = torch.randn(B, Nt, HV, V, generator=gen).to(device)
    g = (-torch.rand(B, Nt, HV, generator=gen) * 0.3).to(device)
    parents = random_parents(kind, B, Nt, gen).to(device)
    state = torch.randn(B, HV, V, K, generator=gen).to(device)
    accepted = torch.tensor([-1, Nt - 1, int(torch.randint(0, Nt, (1,), generator=gen))], device=device)
    want = ref.commit_state_ref(state, k_hat, u, g, parents, accepted)
    s = state.clone()
    assert commit_state_(s, k_hat, u, g, parents, accepted) is s
    check(s, want, 1e-3, "state")
    assert torch.equal(s[0], state[0]), "accepted == -1 must leave the state untouched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["deep", "bushy", "forest"])
def test_verify_then_commit_equals_recurrence_along_path(device, kind):
    """Factors from the tree kernel, committed at a node, give the state of the recurrence along that node's path."""
    gen = seeded(kind, 'path')
    B, H, HV, K, V = SHAPES[device][1]
    N = SIZES[device][kind]
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, torch.bfloat16, device, gen)
    parents = random_parents(kind, B, N, gen).to(device)
    _, k_hat, u = tree_gated_delta_rule(q, k, v, g, beta, parents, state)
    accepted = torch.randint(0, N, (B,), generator=gen).to(device)
    s = state.clone()
    commit_state_(s, k_hat, u, g, parents, accepted)
    anc = ref.tree_ancestors(parents.cpu())
    for b in range(B):
        path = torch.nonzero(anc[b, int(accepted[b])]).flatten().to(device)
        pick = lambda t: t[b:b + 1, path]                                # noqa: E731
        _, s_rec = ref.recurrent_gated_delta_rule_ref(pick(q), pick(k), pick(v), pick(g), pick(beta),
                                                      state[b:b + 1])
        check(s[b:b + 1], s_rec, 1e-2, f"state after path to {int(accepted[b])}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "deep", "forest", "single"])
def test_commit_all_layers_in_one_launch(device, kind):
    """``commit_`` (one launch for every layer's state and window, per-layer address tables) equals the per-layer reference
    on layers with their own states, factors and windows (separate allocations, as in a model)."""
    gen = seeded(kind, 'layers')
    _, H, HV, K, V = SHAPES[device][0]
    _, D, W = CONV[device][1]
    B, L, Nt = 2, 3, SIZES[device][kind]
    parents = random_parents(kind, B, Nt, gen).to(device)
    accepted = torch.tensor([int(torch.randint(0, Nt, (1,), generator=gen)), -1 if Nt > 1 else 0], device=device)
    layers = [dict(state=torch.randn(B, HV, V, K, generator=gen), k_hat=ref.l2norm(torch.randn(B, Nt, H, K, generator=gen)),
                   u=torch.randn(B, Nt, HV, V, generator=gen), g=-torch.rand(B, Nt, HV, generator=gen) * 0.3,
                   x=torch.randn(B, Nt, D, generator=gen).bfloat16(), window=torch.randn(B, D, W, generator=gen).bfloat16())
              for _ in range(L)]
    layers = [{k: t.to(device) for k, t in layer.items()} for layer in layers]
    want = [(ref.commit_state_ref(l["state"], l["k_hat"], l["u"], l["g"], parents, accepted),
             ref.commit_window_ref(l["x"], l["window"], parents, accepted)) for l in layers]
    states = [l["state"].clone() for l in layers]
    windows = [l["window"].clone() for l in layers]
    # the path read off the mask (built, or given as the cache gives it) or handed over as the acceptance step has
    # it: padded with the accepted node, in a buffer wider than the tree whose rows and lengths are strided views;
    # chunks of 16 nodes (several on the deep tree's long paths) and one chunk of 128
    anc = tree_ancestors(parents)
    nodes, length = commit_kernels.root_path(anc, accepted)
    packed = torch.zeros(B, 2 + Nt + 5, dtype=torch.long, device=device)
    packed[:, 1] = length
    packed[:, 2:] = accepted.clamp(min=0)[:, None]
    for b in range(B):
        packed[b, 2:2 + int(length[b])] = nodes[b, :int(length[b])]
    handed = (packed[:, 2:], packed[:, 1])
    via = lambda path, **tile: lambda parents, accepted, ancestors, **parts: commit_kernels.commit_(   # noqa: E731
        *path, tile=tile, **parts)
    for ancestors, commit in ((None, commit_), (anc, commit_), (anc, functools.partial(commit_, path=handed)),
                              (anc, via(handed, BP=128)), (anc, via((nodes, length), BP=16, BV=32, BK=128))):
        for s, w, l in zip(states, windows, layers):
            s.copy_(l["state"])
            w.copy_(l["window"])
        commit(parents, accepted, ancestors=ancestors,
               states=(states, *([l[name] for l in layers] for name in ("k_hat", "u", "g"))),
               windows=([l["x"] for l in layers], windows))
        for i, (s, w, (s_want, w_want)) in enumerate(zip(states, windows, want)):
            check(s, s_want, 1e-3, f"state of layer {i}")
            assert torch.equal(w, w_want), f"window of layer {i}"
    # states 4 bytes off a 16-byte boundary (views into a larger buffer): the kernel must drop its 128-bit access
    # (a vector load there faults on a GPU) and stay right
    shifted = [torch.empty(s.numel() + 1, device=device)[1:].view_as(s).copy_(l["state"])
               for s, l in zip(states, layers)]
    assert shifted[0].data_ptr() % 16
    commit_(parents, accepted, ancestors=anc,
            states=(shifted, *([l[name] for l in layers] for name in ("k_hat", "u", "g"))))
    for i, (s, (s_want, _)) in enumerate(zip(shifted, want)):
        check(s, s_want, 1e-3, f"state of layer {i}, unaligned")
    with pytest.raises(ValueError, match="one shape"):
        commit_(parents, accepted, windows=([layers[0]["x"], layers[1]["x"][:, :, :-1]], windows[:2]))


def test_commit_kv_reference_moves_each_path_entry_down():
    """``commit_kv_ref`` against slot-by-slot moves: slot ``committed + i`` takes node ``path[i]``'s entry, the rest
    of the buffer is unchanged."""
    gen = seeded("kv reference")
    buffer = torch.randn(2, 3, 20, 5, generator=gen)
    committed, length = torch.tensor([4, 9]), torch.tensor([3, 0])
    path = torch.tensor([[0, 2, 5, 5], [1, 1, 1, 1]])
    want = buffer.clone()
    for i, node in enumerate([0, 2, 5]):
        want[0, :, 4 + i] = buffer[0, :, 4 + node]
    assert torch.equal(ref.commit_kv_ref(buffer, committed, path, length), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "deep", "forest", "single"])
def test_commit_kv_all_layers_in_one_launch(device, kind):
    """``ops.commit_kv_`` (one launch for every attention layer's keys and values, per-layer address tables) equals
    the per-layer reference and advances each layer's committed count, on separate allocations with their own counts
    (different per sequence; a sequence that keeps no path is untouched), paths read off the tree or padded into a
    wider strided buffer as the acceptance hands them over."""
    gen = seeded(kind, "kv")
    B, L, Nt = 2, 3, SIZES[device][kind]
    H, D = (2, 256) if device == "cuda" else (3, 20)      # Qwen3.5's KV heads on CUDA
    capacity = 40 + Nt + 7
    parents = random_parents(kind, B, Nt, gen).to(device)
    accepted = torch.tensor([int(torch.randint(0, Nt, (1,), generator=gen)), -1 if Nt > 1 else 0], device=device)
    nodes, length = commit_kernels.root_path(tree_ancestors(parents), accepted)
    packed = torch.zeros(B, 2 + Nt + 5, dtype=torch.long, device=device)
    packed[:, 1] = length
    packed[:, 2:] = accepted.clamp(min=0)[:, None]
    for b in range(B):
        packed[b, 2:2 + int(length[b])] = nodes[b, :int(length[b])]
    for dtype in (torch.float32, torch.bfloat16):
        for path in ((nodes, length), (packed[:, 2:], packed[:, 1])):
            layers = [dict(keys=torch.randn(B, H, capacity, D, generator=gen).to(device, dtype),
                           values=torch.randn(B, H, capacity, D, generator=gen).to(device, dtype),
                           committed=torch.randint(0, 40, (B,), generator=gen).to(device))
                      for _ in range(L)]
            want = [{name: ref.commit_kv_ref(l[name], l["committed"], *path) for name in ("keys", "values")}
                    for l in layers]
            done = [{name: t.clone() for name, t in l.items()} for l in layers]
            ops.commit_kv_(*path, *([l[name] for l in done] for name in ("keys", "values", "committed")))
            for i, (got, w, l) in enumerate(zip(done, want, layers)):
                assert torch.equal(got["keys"], w["keys"]) and torch.equal(got["values"], w["values"]), (i, dtype)
                assert torch.equal(got["committed"], l["committed"] + path[1]), i
    with pytest.raises(ValueError, match="one shape"):
        ops.commit_kv_(nodes, length, [done[0]["keys"], done[1]["keys"][:, :, :-1]], [done[0]["values"]] * 2,
                       [done[0]["committed"]] * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_commit_captured_with_factors_made_inside_the_capture():
    """A CUDA graph whose commit reads factors allocated inside the capture (the device loop's drafter catch-up):
    the warm-up's tensors had other addresses, so the address tables are written by kernels the graph replays (a
    host copy cannot be captured); each replay commits what the reference commits, for the accepted node of the
    replay."""
    gen = seeded("captured")
    _, H, HV, K, V = SHAPES["cuda"][0]
    Nt = 9
    parents = torch.arange(-1, Nt - 1, device="cuda")[None]
    src = dict(k_hat=ref.l2norm(torch.randn(1, Nt, H, K, generator=gen)), u=torch.randn(1, Nt, HV, V, generator=gen),
               g=-torch.rand(1, Nt, HV, generator=gen) * 0.3)
    src = {k: t.cuda() for k, t in src.items()}
    state0 = torch.randn(1, HV, V, K, generator=gen).cuda()
    state, accepted = state0.clone(), torch.zeros(1, dtype=torch.long, device="cuda")

    def commit():
        k_hat, u, g = (src[name] * 1 for name in ("k_hat", "u", "g"))     # made here: new addresses each capture
        commit_(parents, accepted, states=([state], [k_hat], [u], [g]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        commit()                                                           # warm-up (compile)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        commit()
    for m in (3, 8, 0):
        state.copy_(state0)
        accepted.fill_(m)
        graph.replay()
        want = ref.commit_state_ref(state0, src["k_hat"], src["u"], src["g"], parents, accepted)
        check(state, want, 1e-3, f"state after accepting node {m}")


# ----------------------------------------------------------------------------------------------------------------
# short convolution
# ----------------------------------------------------------------------------------------------------------------
CONV = {"cpu": [(2, 40, 4), (3, 24, 3)], "cuda": [(1, 1536, 4), (2, 3072, 4)]}   # (B, D, W)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "deep", "bushy", "single", "forest"])
@MODEL_DTYPES
def test_tree_conv_matches_reference(device, kind, dtype):
    gen = seeded(kind, dtype, 'conv')
    for B, D, W in CONV[device]:
        N = SIZES[device][kind]
        x = torch.randn(B, N, D, generator=gen).to(device, dtype)
        window = torch.randn(B, D, W, generator=gen).to(device, dtype)
        weight = torch.randn(D, W, generator=gen).to(device)
        bias = torch.randn(D, generator=gen).to(device)
        parents = random_parents(kind, B, N, gen).to(device)
        for b_, act in [(bias, "silu"), (None, None)]:
            y = tree_conv(x, weight, b_, window, parents, act)
            assert y.dtype == dtype
            check(y, ref.tree_conv_ref(x, weight, b_, window, parents, act), TOL[dtype], f"y (bias={b_ is not None})")
        # x as a column slice of a wider projection output, read in place, its contiguous copy written on the way
        wide = torch.randn(B, N, D + 9, generator=gen).to(device, dtype)
        x_slice, x_out = wide[..., 5:5 + D], torch.full((B, N, D), float("nan"), device=device, dtype=dtype)
        y = tree_conv(x_slice, weight, bias, window, parents, "silu", x_out=x_out)
        check(y, ref.tree_conv_ref(x_slice, weight, bias, window, parents, "silu"), TOL[dtype], "y (column slice)")
        assert torch.equal(x_out, x_slice)


@pytest.mark.parametrize("device", DEVICES)
def test_tree_conv_on_chain_equals_sequence_conv(device):
    gen = torch.Generator().manual_seed(3)
    B, D, W = CONV[device][0]
    N = SIZES[device]["chain"]
    x = torch.randn(B, N, D, generator=gen).to(device)
    window = torch.randn(B, D, W, generator=gen).to(device)
    weight, bias = torch.randn(D, W, generator=gen).to(device), torch.randn(D, generator=gen).to(device)
    y = tree_conv(x, weight, bias, window, ref.chain_parents(N, B, device=device))
    y_seq, new_window = ref.conv_sequence_ref(x, weight, bias, window)
    check(y, y_seq, 1e-5, "y vs sequence conv")
    w = window.clone()
    commit_window_(x, w, ref.chain_parents(N, B, device=device), torch.full((B,), N - 1, device=device))
    assert torch.equal(w, new_window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["chain", "deep", "bushy", "single", "forest"])
@MODEL_DTYPES
def test_commit_window_matches_reference(device, kind, dtype):
    gen = seeded(kind, dtype, 'window')
    for _, D, W in CONV[device]:
        B, N = 3, SIZES[device][kind]
        x = torch.randn(B, N, D, generator=gen).to(device, dtype)
        window = torch.randn(B, D, W, generator=gen).to(device, dtype)
        parents = random_parents(kind, B, N, gen).to(device)
        accepted = torch.tensor([-1, N - 1, int(torch.randint(0, N, (1,), generator=gen))], device=device)
        want = ref.commit_window_ref(x, window, parents, accepted)
        w = window.clone()
        assert commit_window_(x, w, parents, accepted) is w
        assert torch.equal(w, want)


# ----------------------------------------------------------------------------------------------------------------
# gate and write strength
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_beta_matches_reference(device, dtype):
    """Also on column slices of a wider projection output (the runner's fused GEMM), with and without dt_bias, for
    odd head counts and extreme pre-activations (softplus' linear branch, very negative inputs)."""
    gen = seeded(dtype, 'gate')
    for B, T, HV, neg in [(1, 13, 6, False), (2, 5, 3, True), (1, 1, 32, False)]:
        proj = (torch.randn(B, T, 7 + 2 * HV, generator=gen) * 8).to(device, dtype)
        a, b = proj[..., 7:7 + HV], proj[..., 7 + HV:]
        A_log = torch.randn(HV, generator=gen).to(device)
        for dt_bias in (torch.randn(HV, generator=gen).to(device), None):
            g, beta = gdn_gate_beta(a, b, A_log, dt_bias, neg)
            g_ref, beta_ref = ref.gdn_gate_beta_ref(a, b, A_log, dt_bias, neg)
            assert g.dtype == beta.dtype == torch.float32
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "deep", "forest"])
@MODEL_DTYPES
def test_tree_conv_gates_matches_references(device, kind, dtype):
    """The conv and the gates in one launch, read in place from one projection output as a verify pass lays it out
    (q|k|v, then a and b): a fresh tree with the contiguous copy written, and new nodes after pending ones (the gates
    of the last T only); odd head counts, with and without dt_bias and conv bias, negative eigenvalues allowed."""
    gen = seeded(kind, dtype, 'conv_gates')
    for (B, D, W), HV, neg in zip(CONV[device], (5, 16), (False, True)):
        N = SIZES[device][kind]
        proj = (torch.randn(B, N, D + 3 + 2 * HV, generator=gen) * 4).to(device, dtype)
        x, a, b = proj[..., :D], proj[..., D + 3:D + 3 + HV], proj[..., D + 3 + HV:]
        window = torch.randn(B, D, W, generator=gen).to(device, dtype)
        weight = torch.randn(D, W, generator=gen).to(device)
        A_log = torch.randn(HV, generator=gen).to(device)
        parents = random_parents(kind, B, N, gen).to(device)
        for bias, dt_bias in ((torch.randn(D, generator=gen).to(device), torch.randn(HV, generator=gen).to(device)),
                              (None, None)):
            for T in (N, max(1, N // 3)):                        # every node new, or the last T after pending ones
                x_out = torch.full((B, N, D), float("nan"), device=device, dtype=dtype) if T == N else None
                y, g, beta = tree_conv_gates(x, weight, bias, window, parents, a[:, -T:], b[:, -T:], A_log,
                                             dt_bias, neg, x_out=x_out)
                what = f"T={T}/{N}, bias={bias is not None}"
                check(y, ref.tree_conv_ref(x, weight, bias, window, parents, "silu"), TOL[dtype], f"y ({what})")
                g_ref, beta_ref = ref.gdn_gate_beta_ref(a[:, -T:], b[:, -T:], A_log, dt_bias, neg)
                assert g.shape == beta.shape == (B, T, HV) and g.dtype == beta.dtype == torch.float32
                torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"g ({what}): {m}")
                torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"beta ({what}): {m}")
                if x_out is not None:
                    assert torch.equal(x_out, x)
    with pytest.raises(ValueError, match="last T of the"):
        tree_conv_gates(x, weight, None, window, parents, a[:, :1].expand(B, N + 1, HV), b[:, :1].expand(B, N + 1, HV),
                        A_log, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_norm_matches_reference(device, dtype):
    """The output norm with the gate read in place from a column slice of a wider projection (and contiguous), with
    and without weight / bias, swish and sigmoid gates, odd head dims, one token and several, batch > 1."""
    from specla_kernels.gated_norm import rms_norm_gated
    gen = seeded(dtype, 'gated_norm')
    for B, T, H, D in [(1, 13, 6, 40), (2, 5, 3, 24), (1, 1, 2, 512), (3, 1, 4, 33)]:
        x = torch.randn(B, T, H, D, generator=gen).to(device, dtype)
        wide = torch.randn(B, T, H * D + 11, generator=gen).to(device, dtype) * 3
        g = wide[..., 7:7 + H * D].view(B, T, H, D)
        w, b = torch.randn(D, generator=gen).to(device), torch.randn(D, generator=gen).to(device)
        for weight, bias, act in [(w, None, "swish"), (None, None, "sigmoid"), (w, b, "silu")]:
            for gate in (g, g.contiguous()):
                y = rms_norm_gated(x, gate, weight, bias, 1e-5, act)
                assert y.dtype == dtype
                check(y, ref.rms_norm_gated_ref(x, gate, weight, bias, 1e-5, act), TOL[dtype], f"{act} {B, T}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_embed_norm_cat_matches_reference(device, dtype):
    """A drafter pass's input rows against ``embed_norm_cat_ref``: repeated and out-of-order tokens, strided feature
    rows, both halves' order, unit-offset fp32 scales (the MTP head's) and model-dtype ones, odd widths; on CUDA the
    1.3B drafter's and the 9B MTP head's widths."""
    from specla_kernels.input_norm import embed_norm_cat
    gen = seeded(dtype, "embed_norm_cat")
    widths = [(37, 11, 24), (5, 1, 40), (300, 17, 64)] if device == "cpu" else [(8192, 29, 2048), (2000, 9, 4096)]
    for V, T, H in widths:
        table = torch.randn(V, H, generator=gen).to(device, dtype) * 3
        tokens = torch.randint(0, V, (T,), generator=gen)
        tokens[-1] = tokens[0]                                          # a token twice
        tokens = tokens.to(device)
        wide = torch.randn(T, H + 5, generator=gen).to(device, dtype) * 0.2
        feature = wide[:, 3:3 + H]                                     # rows H + 5 apart
        r = lambda: torch.randn(H, generator=gen).to(device)  # noqa: E731
        for w_e, w_f in [(r().to(dtype), r().to(dtype)), (1 + r() * 0.1, 1 + r())]:
            for feature_first in (False, True):
                y = embed_norm_cat(table, tokens, feature, w_e, 1e-6, w_f, 1e-5, feature_first)
                assert y.dtype == dtype
                want = ref.embed_norm_cat_ref(table, tokens, feature, w_e, 1e-6, w_f, 1e-5, feature_first)
                check(y, want, 1e-6 if dtype == torch.float32 else 1e-2, f"{V, T, H} {feature_first}")
                assert not torch.equal(y[:, :H], y[:, H:])
                # a runner's batch of one: [1, T] tokens, [1, T, H] features
                assert torch.equal(embed_norm_cat(table, tokens[None], feature[None], w_e, 1e-6, w_f, 1e-5,
                                                  feature_first), y[None])
    with pytest.raises(ValueError, match="table"):                     # a table of another width: no stray reads
        embed_norm_cat(table[:, :-1].contiguous(), tokens, feature, w_e, 1e-6, w_f, 1e-5)


# ----------------------------------------------------------------------------------------------------------------
# the decode step's GEMVs with their fused prologues / epilogues
# ----------------------------------------------------------------------------------------------------------------
# hidden, heads, head_dim (of values), MLP width, conv rows, vocabulary: tiny and awkward on CPU; the 1.3B layer on
# CUDA (conv rows = q|k|v, a projection of q|k|v|g|a|b padded to 64 rows) and an odd-sized product
GEMV_SHAPES = {"cpu": dict(hidden=40, heads=3, head_dim=16, inter=56, conv=24, proj=53, vocab=37),
               "cuda": dict(hidden=2048, heads=6, head_dim=512, inter=5632, conv=6144, proj=9280, vocab=16381)}


# (query heads, KV heads, head dim, rotary dims, capacity): odd sizes on CPU; Qwen3.5's attention on CUDA
QK_SHAPES = {"cpu": [(3, 1, 24, 8, 7), (2, 2, 16, 16, 5)], "cuda": [(8, 2, 256, 64, 300), (16, 4, 256, 64, 33)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_append_matches_reference(device, dtype):
    """The attention layer's norm-rotary-append kernel against ``qk_norm_rope_append_ref``: one token (the one-token
    step) and several (a verify pass: rows of a wider projection, a rotary row per token, written after pending
    entries), queries returned, keys and values written at their slots and nothing else of the KV buffers touched."""
    from specla_kernels.qk_norm_rope import qk_norm_rope_append
    gen = seeded(dtype, "qk_norm_rope")
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    for H, KV, D, R, capacity in QK_SHAPES[device]:
        for T, first in ((1, 0), (5, 3)):
            W = (2 * H + 2 * KV) * D
            qkv = rnd(W + 5)[:W] if T == 1 else rnd(T, W + 7)[:, 2:W + 2]
            q_w = (torch.randn(D, generator=gen) * 0.3 + 1).to(device)         # fp32 scales, as unit_offset_weight
            k_w = (torch.randn(D, generator=gen) * 0.3 + 1).to(device)
            angles = torch.rand(*((T,) if T > 1 else ()), R // 2, generator=gen) * 6
            cos, sin = (torch.cat([f(angles)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
            length = torch.tensor([capacity // 2], device=device)
            size = capacity + first + T
            buffers = [(rnd(1, KV, size, D), rnd(1, KV, size, D)) for _ in range(2)]
            want_buffers = [b.clone() for b in buffers[0]]
            want = ref.qk_norm_rope_append_ref(qkv, q_w, k_w, 1e-6, cos, sin, *want_buffers, length, H, first)
            got_buffers = [b.clone() for b in buffers[0]]
            got = qk_norm_rope_append(qkv, q_w, k_w, 1e-6, cos, sin, *got_buffers, length, H, first)
            assert got.shape == (T, H, D)
            tol = 2 * TOL[dtype] if device == "cpu" else TOL[dtype]
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            written = (torch.arange(size, device=device) - length - first).clamp(-1, T) % (T + 1) < T
            for g, w, old in zip(got_buffers, want_buffers, buffers[0]):
                torch.testing.assert_close(g, w, rtol=tol, atol=tol)
                assert torch.equal(g[:, :, ~written], old[:, :, ~written])
                assert not torch.equal(g[:, :, written], old[:, :, written])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_matches_reference(device, dtype):
    """Each fused GEMV of the decode step against ``gemv_ref``: input projection (norm before, short conv and window
    shift after), output projection (gated head norm before), gate|up (residual add and norm before, the sum
    written out), down projection (SwiGLU before, residual after), LM head (norm before, odd row count)."""
    from specla_kernels import gemv as gemv_mod
    from specla_kernels.gemv import gemv
    s = GEMV_SHAPES[device]
    gen = seeded(dtype, 'gemv')
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device, dtype)  # noqa: E731
    hid, vd, inter = s["hidden"], s["heads"] * s["head_dim"], s["inter"]
    h, res, norm_w = rnd(hid), rnd(hid), rnd(hid).abs() + 0.5
    head_w = rnd(s["head_dim"]).abs() + 0.5
    cases = {
        "in_proj": (rnd(s["proj"], hid, scale=hid ** -0.5), h,
                    dict(norm=(norm_w, 1e-6), conv=(rnd(s["conv"], 4), rnd(s["conv"], 4), rnd(s["conv"])))),
        "in_proj_no_conv_bias": (rnd(s["proj"], hid, scale=hid ** -0.5), h,
                                 dict(norm=(norm_w, 1e-6), conv=(rnd(s["conv"], 4), rnd(s["conv"], 4), None))),
        "o_proj": (rnd(hid, vd, scale=vd ** -0.5), rnd(vd), dict(norm=(head_w, 1e-5), gate=rnd(vd + 7)[3:3 + vd])),
        "gate_up": (rnd(2 * inter, hid, scale=hid ** -0.5), h, dict(norm=(norm_w, 1e-6), add=res)),
        "down": (rnd(hid, inter, scale=inter ** -0.5), rnd(2 * inter), dict(swiglu=True, residual=res)),
        "lm_head": (rnd(s["vocab"], hid, scale=hid ** -0.5), h, dict(norm=(norm_w, 1e-6))),
        "plain": (rnd(s["vocab"], inter), rnd(inter), {}),
        "small": (rnd(45, 33), rnd(33), dict(norm=(rnd(33).abs() + 0.5, 1e-6), residual=rnd(45))),   # untuned path
    }
    # the interpreter casts fp32 to bf16 by truncation (compiled kernels round to nearest): one ulp more per cast
    tol = 2 * TOL[dtype] if device == "cpu" else TOL[dtype]

    def run(fn, w, x, fused, **extra):
        kw = dict(fused)
        if "conv" in kw:
            kw["conv"] = (kw["conv"][0].clone(), *kw["conv"][1:])
        if "add" in kw:
            kw["add_out"] = torch.full_like(h, float("nan"))
        return fn(w, x, **kw, **extra), kw

    # the default launch, the row-owner kernel with three stages (each program loops over several blocks), and on
    # CUDA launches through the step-config table (tuning): the last candidate (split-K, the most rows a program) and the shipped
    # table's launch for a product of these columns, prologue and epilogue (its rows may differ: lm_head's are odd)
    variants = {"default": {}, "3 stages": dict(split=0, config=dict(BN=2, PER_SM=2, STAGES=3, num_warps=4))}
    shipped = {k[3:]: launch for k, launch in tuning.load_step_configs().items()}
    for name, (w, x, fused) in cases.items():
        want, kw_ref = run(ref.gemv_ref, w, x, fused)
        tables = {}
        if device == "cuda":
            key = gemv_mod.product_key(w, x, **fused)
            tables["last candidate"] = gemv_mod.launch_candidates(w, x, **fused)[-1]
            if key[3:] in shipped:
                tables["shipped table"] = shipped[key[3:]]
        for variant, extra in [*variants.items(), *((t, {}) for t in tables)]:
            with tuning.using(gemv_step_configs={key: tables[variant]} if variant in tables else {}):
                y, kw = run(gemv, w, x, fused, **extra)
            what = f"{name} ({variant})"
            assert y.dtype == dtype and y.shape == want.shape, what
            check(y, want, tol, what)
            if "conv" in kw:
                got_w, want_w = kw["conv"][0], kw_ref["conv"][0]
                assert torch.equal(got_w[:, :-1], want_w[:, :-1]), f"{what}: window shift"
                check(got_w[:, -1], want_w[:, -1], tol, f"{what}: window's new column")
            if "add" in kw and tol == TOL[dtype]:
                assert torch.equal(kw["add_out"], kw_ref["add_out"]), f"{what}: residual sum"
            elif "add" in kw:
                check(kw["add_out"], kw_ref["add_out"], tol, f"{what}: residual sum")
    if device == "cuda":      # the table is read: an entry it holds decides the launch (here, a refused one)
        w, x, fused = cases["lm_head"]
        with tuning.using(gemv_step_configs={gemv_mod.product_key(w, x, **fused): {"split": 3}}):
            with pytest.raises(ValueError, match="split must be a power of two"):
                gemv(w, x, **fused)


def test_shipped_step_configs_are_tested_launches():
    """Every launch of the shipped ``gemv_step_configs.json`` (benchmarks/tune_step.py) is one of its product's
    ``launch_candidates``: launch shapes the GEMV tests run and the autotuner would consider, never a hand edit."""
    from specla_kernels import gemv
    if not tuning.STEP_CONFIGS_FILE.exists():
        pytest.skip("no step-tuned table shipped")
    products = tuning.step_config_entries()
    assert products and set(tuning.load_step_configs()) == {
        (e["device"], e["dtype"], e["N"], e["K"], e["PRO"], e["EPI"], e["KC"]) for e in products}
    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    for e in products:
        N, K, pro, epi = e["N"], e["K"], e["PRO"], e["EPI"]
        fused = {}
        if pro == gemv.GATED_NORM.value:
            fused.update(norm=(meta(e["KC"]), 1e-5), gate=meta(K))
        elif pro in (gemv.NORM.value, gemv.NORM_ADD.value):
            fused.update(norm=(meta(K), 1e-6), add=meta(K) if pro == gemv.NORM_ADD.value else None)
        fused.update(swiglu=pro == gemv.SWIGLU.value)
        if epi == gemv.RESIDUAL.value:
            fused["residual"] = meta(N)
        elif epi == gemv.CONV.value:
            fused["conv"] = (meta(N, 4), meta(N, 4), None)
        assert e["launch"] in gemv.launch_candidates(meta(N, K), meta(K), **fused), e["name"]



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_split_k_matches_reference(device, dtype):
    """The split-K GEMV against ``gemv_ref`` with every prologue and epilogue of the decode step: slices of one head
    and of several, a last slice only partly inside the row, odd row counts, a norm whose statistic spans slices
    (with the residual sum written out), the conv epilogue's window shift. Each product runs twice: the per-block
    counters re-arm themselves, and the in-order sum of the partials gives the same bits both times."""
    from specla_kernels.gemv import gemv
    s = GEMV_SHAPES[device]
    gen = seeded(dtype, 'gemv_split')
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device, dtype)  # noqa: E731
    hid, vd, inter, hd = s["hidden"], s["heads"] * s["head_dim"], s["inter"], s["head_dim"]
    head_w, res, norm_w, h = rnd(hd).abs() + 0.5, rnd(hid), rnd(hid).abs() + 0.5, rnd(hid)
    o_w, o_x, gate = rnd(hid, vd, scale=vd ** -0.5), rnd(vd), rnd(vd)
    down_w, down_x = rnd(hid, inter, scale=inter ** -0.5), rnd(2 * inter)
    plain_w, plain_x = rnd(hid + 3, inter), rnd(inter)
    proj_w, window = rnd(s["proj"], hid, scale=hid ** -0.5), rnd(s["conv"], 4)
    conv = (rnd(s["conv"], 4), rnd(s["conv"]))
    wide = 512 if device == "cuda" else 32
    cases = [("o_proj, a head per slice", o_w, o_x, dict(norm=(head_w, 1e-5), gate=gate), hd),
             ("o_proj, two heads per slice", o_w, o_x, dict(norm=(head_w, 1e-5), gate=gate), 2 * hd),
             ("down", down_w, down_x, dict(swiglu=True, residual=res), wide // 2),
             ("plain, odd rows", plain_w, plain_x, {}, wide),
             ("in_proj: norm, conv", proj_w, h, dict(norm=(norm_w, 1e-6), conv=conv), wide // 2),
             ("gate_up: add, norm", rnd(2 * inter, hid, scale=hid ** -0.5), h, dict(norm=(norm_w, 1e-6), add=res),
              wide // 4)]
    tol = 2 * TOL[dtype] if device == "cpu" else TOL[dtype]
    for name, w, x, kw, split in cases:
        assert w.shape[1] > split, f"{name}: the case must split"
        runs = []
        for fn, extra in [(gemv, dict(split=split)), (gemv, dict(split=split)), (ref.gemv_ref, {})]:
            call = dict(kw, **extra)
            if "conv" in kw:
                call["conv"] = (window.clone(), *kw["conv"])
            if "add" in kw:
                call["add_out"] = torch.full_like(h, float("nan"))
            runs.append((fn(w, x, **call), call))
        (y, got), (y2, _), (want, want_kw) = runs
        check(y, want, tol, name)
        assert torch.equal(y2, y), f"{name}: second run"
        if "conv" in kw:
            assert torch.equal(got["conv"][0][:, :-1], want_kw["conv"][0][:, :-1]), f"{name}: window shift"
            check(got["conv"][0][:, -1], want_kw["conv"][0][:, -1], tol, f"{name}: window's new column")
        if "add" in kw:
            check(got["add_out"], want_kw["add_out"], tol, f"{name}: residual sum")
    with pytest.raises(ValueError, match="multiple of its head size"):
        gemv(o_w, o_x, norm=(head_w, 1e-5), gate=gate, split=hd // 2)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_gemm_matches_reference(device, dtype):
    """The verify pass's fused products against ``fused_gemm_ref`` (``gemv_ref`` row by row) for 1 to 64 rows (padded
    to 16, 32, 64): input projection (norm), output projection (gated head norm, x and gate strided column slices of
    one projection), gate|up (residual add and norm, the sum written out), down (SwiGLU, residual), an odd-row plain
    product; each with the whole row in one program and in K slices summed by the last program (twice: the counters
    re-arm, the in-order sum gives the same bits)."""
    from specla_kernels.fused_gemm import MAX_ROWS, fused_gemm
    s = GEMV_SHAPES[device]
    gen = seeded(dtype, 'fused_gemm')
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device, dtype)  # noqa: E731
    hid, hd, inter = s["hidden"], s["head_dim"], s["inter"]
    vd = s["heads"] * hd
    norm_w, head_w = rnd(hid).abs() + 0.5, rnd(hd).abs() + 0.5
    weights = dict(in_proj=rnd(s["proj"], hid, scale=hid ** -0.5), o_proj=rnd(hid, vd, scale=vd ** -0.5),
                   gate_up=rnd(2 * inter, hid, scale=hid ** -0.5), down=rnd(hid, inter, scale=inter ** -0.5),
                   plain=rnd(s["vocab"], inter))
    # the interpreter's default launch slices K; on CUDA the tuned launch and two fixed ones (one stage: a 512-wide
    # gated head at 64 rows has no room for two)
    whole = dict(BN=16, BK=max(16, hd), KS=0) if device == "cpu" else dict(BN=16, BK=512, KS=0, num_warps=8,
                                                                          num_stages=1)
    sliced = dict(BN=32, BK=max(16, hd), KS=2 * max(16, hd), num_warps=8, num_stages=1)
    tol = 2 * TOL[dtype] if device == "cpu" else TOL[dtype]
    for M in (1, 5, 19, 37) if device == "cpu" else (1, 16, 37, MAX_ROWS):
        h, res, down_res = rnd(M, hid), rnd(M, hid), rnd(M, hid)
        projected = rnd(M, 2 * vd + 5)                   # o and its gate: column slices of one projection's rows
        cases = {"in_proj": (h, dict(norm=(norm_w, 1e-6))),
                 "o_proj": (projected[:, :vd], dict(norm=(head_w, 1e-5), gate=projected[:, vd + 5:])),
                 "gate_up": (h, dict(norm=(norm_w, 1e-6), add=res)),
                 "down": (rnd(M, 2 * inter), dict(swiglu=True, residual=down_res)),
                 "plain": (rnd(M, inter), {})}
        for name, (x, fused) in cases.items():
            runs = {}
            for variant, fn, extra in [("reference", ref.fused_gemm_ref, {}), ("default", fused_gemm, {}),
                                       ("whole rows", fused_gemm, dict(config=whole)),
                                       ("K slices", fused_gemm, dict(config=sliced)),
                                       ("K slices again", fused_gemm, dict(config=sliced))]:
                call = dict(fused, **extra)
                if "add" in fused:
                    call["add_out"] = torch.full_like(h, float("nan"))
                runs[variant] = (fn(weights[name], x, **call), call.get("add_out"))
            want, want_sum = runs.pop("reference")
            for variant, (y, total) in runs.items():
                what = f"{name}, {M} rows ({variant})"
                assert y.dtype == dtype, what
                check(y, want, tol, what)
                if total is not None:
                    check(total, want_sum, tol, f"{what}: residual sum")
            assert torch.equal(runs["K slices again"][0], runs["K slices"][0]), f"{name}, {M} rows: slices' sum"
    # one token's input projection with the short conv after it: its window shifted in place (the one-token step)
    proj_w, h = weights["in_proj"], rnd(1, hid)
    window, conv_w = rnd(s["conv"], 4), rnd(s["conv"], 4)
    for bias in (rnd(s["conv"]), None):
        runs = {}
        for variant, fn, extra in [("reference", ref.fused_gemm_ref, {}), ("default", fused_gemm, {}),
                                   ("K slices", fused_gemm, dict(config=sliced))]:
            shifted = window.clone()
            runs[variant] = fn(proj_w, h, norm=(norm_w, 1e-6), conv=(shifted, conv_w, bias), **extra), shifted
        (want, want_window) = runs.pop("reference")
        for variant, (y, got_window) in runs.items():
            what = f"in_proj with conv{'' if bias is not None else ', no bias'} ({variant})"
            check(y, want, tol, what)
            assert torch.equal(got_window[:, :-1], want_window[:, :-1]), f"{what}: window shift"
            check(got_window[:, -1], want_window[:, -1], tol, f"{what}: window's new column")
    with pytest.raises(ValueError, match="one token"):
        fused_gemm(proj_w, rnd(2, hid), conv=(window, window, None))
    x, fused = cases["plain"]
    with pytest.raises(ValueError, match="1 to 64 rows"):
        fused_gemm(weights["plain"], rnd(MAX_ROWS + 1, inter))
    with pytest.raises(ValueError, match=r"x must be \[rows, "):
        fused_gemm(weights["down"], x, swiglu=True)
    with pytest.raises(ValueError, match="power-of-two head size"):
        fused_gemm(weights["o_proj"], projected[:, :vd], norm=(rnd(hd + 1), 1e-5), gate=projected[:, vd + 5:])
    with pytest.raises(ValueError, match="of at least 16"):
        fused_gemm(weights["o_proj"][:, :8], projected[:, :8], norm=(rnd(8), 1e-5), gate=projected[:, vd:vd + 8])


@pytest.mark.parametrize("device", DEVICES[:1])
def test_fused_gemm_every_listed_launch_matches_reference(device):
    """Every launch of the autotuner's list that its pruning keeps for bf16 (column blocks 16-128, K steps 128-512,
    whole rows and 512 / 1024-column slices, at 16 and 64 padded rows), in the interpreter, against
    ``fused_gemm_ref``: the tuned launches a GPU picks from, where the reference test's fixed interpreter launch
    steps K by 16. Products of 1536 columns (three K slices at the narrowest), ragged output columns, gated heads of
    128, 256 and 512."""
    from specla_kernels.fused_gemm import _kinds, _prune, _tuned, fused_gemm
    gen = seeded('fused_gemm launches')
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).bfloat16()  # noqa: E731
    K, N = 1536, 72
    w = rnd(N, K, scale=K ** -0.5)
    norm_w = rnd(K).abs() + 0.5
    tried = set()
    for M in (5, 37):
        x, gate, res, out_res = rnd(M, 2 * K), rnd(M, K), rnd(M, K), rnd(M, N)
        cases = {"norm": (x[:, :K], dict(norm=(norm_w, 1e-6))),
                 "add and norm": (x[:, :K], dict(norm=(norm_w, 1e-6), add=res)),
                 "SwiGLU, residual": (x, dict(swiglu=True, residual=out_res)),
                 **{f"gated head {hd}": (x[:, :K], dict(norm=(norm_w[:hd], 1e-5), gate=gate)) for hd in (128, 256, 512)}}
        for name, (inp, fused) in cases.items():
            if "add" in fused:
                fused["add_out"] = torch.full_like(res, float("nan"))
            want = ref.fused_gemm_ref(w, inp, **fused)
            want_sum = fused["add_out"].clone() if "add" in fused else None
            launch = dict(MP=16 if M <= 16 else 64, PRO=_kinds(**fused)[0],
                          HD=fused["norm"][0].numel() if "gate" in fused else 1)
            for c in _prune(_tuned.configs, {"x": inp, "K": K}, **launch):
                what = f"{name}, {M} rows, {c}"
                if "add" in fused:
                    fused["add_out"].fill_(float("nan"))
                got = fused_gemm(w, inp, **fused, config=dict(c.kwargs, num_warps=c.num_warps,
                                                               num_stages=c.num_stages))
                check(got, want, 2 * TOL[torch.bfloat16], what)
                if want_sum is not None:
                    check(fused["add_out"], want_sum, 2 * TOL[torch.bfloat16], f"{what}: residual sum")
                tried.add((c.kwargs["BK"], c.kwargs["KS"] > 0))
    assert tried >= {(128, False), (256, False), (512, False), (128, True), (256, True), (512, True)}


@pytest.mark.parametrize("head", [16, 32, 64, 128, 256, 512])
def test_fused_gemm_keeps_launches_that_step_one_gated_head(head):
    """A gated norm normalises one head per K step, so every launch the autotuner keeps for a gated product steps K
    by exactly the head, also for heads narrower than every listed K step (the one fallback launch), which the
    interpreter's fixed launch does not reach."""
    from specla_kernels.fused_gemm import GATED_NORM, NORM, _prune, _tuned
    for rows, dtype in [(16, torch.float32), (16, torch.bfloat16), (64, torch.bfloat16)]:
        x = torch.empty(rows, 8 * head, dtype=dtype)
        kept = _prune(_tuned.configs, {"x": x, "K": 8 * head}, MP=rows, HD=head, PRO=GATED_NORM.value)
        assert kept and {c.kwargs["BK"] for c in kept} == {head}, (rows, dtype)
    plain = _prune(_tuned.configs, {"x": torch.empty(16, 8 * head), "K": 8 * head}, MP=16, HD=1, PRO=NORM.value)
    assert len({c.kwargs["BK"] for c in plain}) > 1


# ----------------------------------------------------------------------------------------------------------------
# the drafters' log-softmax and top-k of each row (the drafter's expansion)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_softmax_matches_reference(device, dtype, monkeypatch):
    """fp32 log-probs as ``log_softmax_ref`` gives them: rows held in registers and rows read twice (the loop,
    forced at small sizes on CPU), column counts that are not powers of two, -inf entries, a strided row view, leading
    dims kept."""
    from specla_kernels import log_softmax as kernel
    if device == "cpu":
        monkeypatch.setattr(kernel, "ONE_PASS", 512)
        monkeypatch.setattr(kernel, "LOOP_BLOCK", 64)
    gen = seeded(dtype, "log_softmax")
    for R, V in [(1, 16), (4, 97), (3, 1000), (2, 300), (5, 40000), (1, 248320)]:
        if device == "cpu" and V > 1000:
            continue
        x = (torch.randn(R + 2, V, generator=gen) * 6).to(dtype)
        x[1, :3] = float("-inf")
        for rows in (x[1:R + 1].to(device), x.to(device)[:, ::2], x[1:R + 1].to(device).view(R, 1, V)):
            got = kernel.log_softmax(rows)
            assert got.dtype == torch.float32 and got.shape == rows.shape
            torch.testing.assert_close(got, ref.log_softmax_ref(rows), rtol=1e-5, atol=1e-5, msg=f"{R}x{V}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_topk_matches_reference(device, dtype):
    """Values and indices equal the stable-sort reference exactly: rows in one slice and over several (the merge),
    column counts that are not powers of two, k from 1 to 16, coarse values with many exact ties, -inf entries, a
    strided row view (the drafter's frontier rows of a bigger tensor)."""
    gen = seeded(dtype, 'topk')
    block = 64 if device == "cpu" else 1024             # several slices per row on either device, at small sizes
    for R, V, k in [(1, 16, 4), (4, 97, 4), (3, 1000, 1), (2, 300, 16), (5, 5000, 3), (1, 65, 8)]:
        if device == "cpu" and V > 1000:
            continue
        x = (torch.randn(R + 2, V, generator=gen) * 4).round().to(dtype)        # integers: exact ties everywhere
        x[1, :3] = float("-inf")
        rows = x[1:R + 1].to(device)
        got = topk_kernel(rows, k, block=block)
        want = ref.row_topk_ref(rows, k)
        assert got[0].dtype == dtype and got[1].dtype == torch.int64
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (R, V, k)
        got = topk_kernel(x.to(device)[:, ::2], k, block=block)                 # a strided view
        want = ref.row_topk_ref(x[:, ::2].to(device), k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (R, V, k, "strided")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "deep", "forest", "star", "single"])
def test_accept_walk_matches_reference(device, kind):
    """The acceptance walk (one program) equals ``accept_walk_ref`` exactly, greedy and sampled, on trees with
    duplicate sibling tokens, padding nodes (a forest's extra roots), paths shorter and as long as ``cap``, and the
    ancestor mask as a view into the cache's larger buffer."""
    gen = seeded(kind, "walk")
    N = SIZES[device][kind]
    parents = random_parents(kind, 1, N, gen)[0].to(device)
    anc_buffer = torch.zeros(N + 3, N + 5, dtype=torch.bool, device=device)
    anc_buffer[:N, :N] = tree_ancestors(parents[None])[0]
    ancestors = anc_buffer[:N, :N]
    deepest = int(ancestors.sum(1).max())
    for trial in range(6):
        tokens = torch.randint(0, 3, (N,), generator=gen).to(device)         # 3 tokens: many twins and matches
        # the target's choice: mostly one of the node's children's tokens
        argmax = torch.where(torch.rand(N, generator=gen).to(device) < 0.8,
                             tokens[torch.randint(0, N, (N,), generator=gen).to(device)], 7)
        hit = (torch.rand(N, generator=gen) < 0.6).to(device)
        cap = deepest + (trial % 3)
        for given in (dict(argmax=argmax), dict(hit=hit)):
            got = ops.accept_walk(tokens, parents, ancestors, cap, **given)
            want = ref.accept_walk_ref(tokens, parents, ancestors, cap, **given)
            assert torch.equal(got, want), (trial, list(given), got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bushy", "deep", "star"])
def test_drawn_hits_match_reference(device, kind):
    """Recursive rejection sampling of drawn children (a launch per sibling rank over rows split in blocks) against
    ``drawn_hits_ref`` with the same uniforms: the same hits, and residual rows proportional to the reference's for
    every node with children; vocabularies of one block and of several (a last block partly past the vocabulary),
    children past ``siblings`` (never hit), a repeated sibling token, a child ``q`` gives no mass and a parent whose
    ``q`` equals ``p`` (no residual: ``p`` goes on)."""
    gen = seeded(kind, "drawn")
    N = min(SIZES[device][kind], 40)
    parents = random_parents(kind, 1, N, gen)[0].to(device)
    siblings = 3
    for V, close in itertools.product((300, 2500) if device == "cpu" else (8192, 248320), (False, True)):
        logits = torch.randn(N, V, generator=gen) * 3
        draft = torch.softmax(logits, -1)
        if close:       # a drafter near the target, drafts drawn from it: p / q near 1, so every rank's hit turns
            probs = torch.softmax(logits + torch.randn(N, V, generator=gen) * 0.7, -1)  # on the residual's scale
            tokens = torch.multinomial(draft[parents.cpu().clamp(min=0)], 1, generator=gen)[:, 0]
        else:
            probs = torch.softmax(torch.randn(N, V, generator=gen) * 3, -1)
            tokens = torch.randint(0, V, (N,), generator=gen)
        kids = [[c for c in range(N) if int(parents[c]) == u] for u in range(N)]
        u_multi = next((u for u in range(N) if len(kids[u]) >= 2), None)
        if u_multi is not None:
            a, b = kids[u_multi][:2]
            tokens[b] = tokens[a]                                 # a repeated sibling token
            draft[u_multi, tokens[a]] += 0.5                      # and one q likes
            draft[u_multi] /= draft[u_multi].sum()
            u_zero = next((u for u in range(N) if kids[u] and u != u_multi), None)
            if u_zero is not None:
                draft[u_zero, tokens[kids[u_zero][0]]] = 0         # a draw q gives no mass
                draft[u_zero] /= draft[u_zero].sum()
        q_is_p = int(parents[1]) if N > 1 and int(parents[1]) >= 0 else None
        if q_is_p is not None:                                    # q == p: nothing left after a rejection; its
            probs[q_is_p, tokens[kids[q_is_p]]] += 0.2             # children's tokens weigh well above rounding, so
            probs[q_is_p] /= probs[q_is_p].sum()                  # that the later residuals are not rounding's
            draft[q_is_p] = probs[q_is_p]
        uniforms = torch.rand(N, generator=gen)
        args = [t.to(device) for t in (tokens, parents, probs, draft, uniforms)]
        hit, residual = accept_kernels.drawn_hits(*args, siblings, **({"block": 1024} if device == "cpu" else {}))
        want_hit, want_residual = ref.drawn_hits_ref(*args, siblings)
        assert torch.equal(hit, want_hit), (V, close, hit, want_hit)
        with_kids = torch.tensor([bool(k) for k in kids], device=device)
        got_rows = residual[with_kids]
        check(got_rows / got_rows.sum(-1, keepdim=True), want_residual[with_kids], 1e-5,
              f"residual rows, V {V}, close {close}")


@pytest.mark.parametrize("device", DEVICES)
def test_expand_frontier_matches_reference(device):
    """The drafter's expansion step: candidates, next frontier and tree slots equal the torch reference exactly, for
    a root (F = 1) and full frontiers, K from 1 to 6, with exact score ties and -inf log-probs, children ranked by
    their log-probs (drafts chosen by them) and by ranks of their own (sampled drafts)."""
    from specla_kernels.draft_expand import expand_frontier
    gen = seeded('expand')
    for F, K, n, base in [(1, 4, 1, 0), (4, 4, 5, 4), (3, 3, 10, 12), (1, 1, 1, 0), (6, 6, 13, 42), (2, 5, 7, 9)]:
        top_logp = -(torch.rand(F, K, generator=gen) * 3).round(decimals=1)            # coarse: ties
        top_logp = torch.sort(top_logp, descending=True).values                       # row_topk's order
        top_logp[0, -1] = float("-inf")
        top_token = torch.randint(0, 1000, (F, K), generator=gen)
        fs = -(torch.rand(F, generator=gen) * 2).round(decimals=1)
        fc = torch.randint(0, 50, (F,), generator=gen)
        own_rank = torch.maximum(top_logp, -(torch.rand(F, K, generator=gen)).cummax(1).values)
        for top_rank in (top_logp, own_rank):
            outs = []
            for fn in (expand_frontier, ref.expand_frontier_ref):
                cand = torch.full((3, 2, F * K + 3), 7.0, dtype=torch.float64)[:, 1]        # a strided depth row
                tokens, parents = torch.full((n + K + 2,), -5), torch.full((n + K + 2,), -5)
                nxt_s, nxt_c = torch.full((K,), 9.0), torch.full((K,), -9)
                args = [t.to(device) for t in (top_logp, top_rank, top_token, fs, fc, cand, tokens, parents, nxt_s,
                                               nxt_c)]
                fn(*args, n, base)
                outs.append(args[5:])
            for got, want in zip(*outs):
                assert torch.equal(got.cpu(), want.cpu()), (F, K)


@triton.jit
def kth_kernel(keys, out, N, TOP_K: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    tl.store(out, _kth_key(tl.load(keys + c, mask=c < N, other=0), c < N, TOP_K, BITS))


@pytest.mark.parametrize("device", DEVICES)
def test_kth_key_is_the_kth_largest(device):
    """``draw._kth_key``'s search: the ``top_k``-th largest of random keys over the whole range of 32-bit and
    16-bit keys (its extremes included), with ties, and the lowest key where fewer are counted."""
    gen = seeded('kth key')
    for bits in (32, 16):
        low = -2 ** (bits - 1)
        for trial in range(12):
            n = int(torch.randint(1, 300, (1,), generator=gen))
            keys = torch.randint(low, -low, (n,), generator=gen, dtype=torch.int64)
            if trial % 3 == 0:
                keys = keys[torch.randint(0, n, (n,), generator=gen)]          # ties
            keys[:min(n, 2)] = [-low - 1, low][trial % 2]                      # the range's ends
            top_k = int(torch.randint(1, 70, (1,), generator=gen))
            out = torch.zeros(1, dtype=torch.int32, device=device)
            kth_kernel[(1,)](keys.to(torch.int32).to(device), out, n, TOP_K=top_k, BITS=bits, BLOCK=512)
            want = keys.sort(descending=True).values[top_k - 1].item() if top_k <= n else low
            assert out.item() == want, (bits, n, top_k)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_children_matches_reference(device):
    """Given the same uniforms, the drawn children (tokens exactly; log-probs, sibling ranks and the written log-prob
    rows to rounding) equal the reference: with and without the top-k and top-p warpers, temperatures below and above
    1, rows drawn by one program (up to ``4 * block`` entries; any row under a warper) and by slices, a strided row
    view, bf16 scores (raw logits: the threshold on their 16-bit keys), exact score ties at the top-k threshold (a
    few: the draws made from the listed survivors; more than the list holds: from the whole row), a row with -inf
    entries and warpers keeping fewer entries than the draws (the rest token 0 at -inf)."""
    from specla_kernels.draw import draw_children
    gen = seeded('draw')
    block = 64 if device == "cpu" else 1024
    f32, bf16 = torch.float32, torch.bfloat16
    for F, V, k, temperature, top_k, top_p, dtype in [
            (1, 37, 3, 0.7, 0, 1.0, f32), (4, 300, 4, 0.7, 50, 1.0, f32), (3, 2100, 4, 1.0, 5, 1.0, f32),
            (2, 150, 2, 1.6, 0, 1.0, f32), (4, 64, 4, 1.3, 2, 1.0, f32), (2, 5000, 16, 0.9, 64, 1.0, f32),
            (3, 200, 4, 0.8, 0, 0.9, f32), (4, 300, 4, 1.2, 30, 0.6, f32), (2, 700, 8, 1.0, 0, 0.05, f32),
            (2, 9000, 4, 0.7, 20, 0.95, f32), (2, 1500, 4, 0.7, 0, 1.0, f32), (2, 9000, 4, 0.7, 0, 1.0, f32),
            (4, 300, 4, 0.7, 50, 1.0, bf16), (3, 1000, 4, 0.6, 20, 1.0, bf16), (2, 64, 4, 1.3, 2, 1.0, bf16),
            (2, 500, 4, 0.8, 20, 0.9, bf16), (4, 8192, 4, 0.7, 50, 1.0, bf16)]:
        if device == "cpu" and V > 2100:
            continue
        x = torch.log_softmax(torch.randn(F + 1, V, generator=gen) * 3, -1) if dtype == f32 else \
            (torch.randn(F + 1, V, generator=gen) * 3).to(dtype)
        x[0, ::7] = x[0].topk(top_k).values[-1] if top_k else x[0, 3]      # ties, at the top-k threshold
        x[-1, :5] = float("-inf")
        rows, u = x[:F].to(device), torch.rand(F, V, generator=gen).to(device)
        got_q, want_q = torch.full(rows.shape, float("nan"), device=device), torch.empty(rows.shape, device=device)
        one_program = max(4 * block, V) if top_k or top_p < 1.0 else 4 * block
        got = draw_children(rows, k, temperature, top_k, got_q, uniforms=u, block=block, one_program=one_program,
                            top_p=top_p)
        want = ref.draw_children_ref(rows, k, temperature, top_k, want_q, u, top_p)
        case = (F, V, k, temperature, top_k, top_p, dtype)
        assert torch.equal(got[2], want[2]), case
        for g, w in [(got[0], want[0]), (got[1], want[1]), (got_q, want_q)]:
            assert torch.equal(g.isinf(), w.isinf()) and not g.isnan().any(), case
            assert torch.allclose(g.nan_to_num(0, 0, 0), w.nan_to_num(0, 0, 0), atol=1e-5, rtol=1e-5), case
        strided = x.to(device)[:, ::2]
        u = torch.rand(strided.shape, generator=gen).to(device)
        got = draw_children(strided, k, temperature, top_k, torch.empty_like(strided), uniforms=u, block=block,
                            one_program=one_program, top_p=top_p)
        want = ref.draw_children_ref(strided, k, temperature, top_k, torch.empty_like(strided), u, top_p)
        assert torch.equal(got[2], want[2]), (case, "strided")
    with pytest.raises(ValueError, match="top-k and top-p warpers to rows of at most"):
        draw_children(rows, 2, 1.0, 0, got_q, uniforms=u, block=16, one_program=32, top_p=0.9)


@pytest.mark.parametrize("device", DEVICES)
def test_warped_probs_equal_transformers_warpers(device):
    """``ops.warped_probs`` (one program a row on the Triton path; over 16K entries torch, the nucleus among the
    top-k survivors) equals transformers' temperature, top-k and top-p warpers then a softmax, on bf16 and fp32
    scores: zero exactly where a warper removes an entry (ties at the top-k threshold kept), the rest to rounding; a
    top-k of the whole row keeps every entry. (Ties at the nucleus's edge: the next test.)"""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    gen = seeded('warp')
    for R, V, temperature, top_k, top_p, dtype in [
            (1, 37, 0.7, 0, 1.0, torch.float32), (5, 300, 0.7, 50, 1.0, torch.bfloat16),
            (3, 2100, 1.3, 5, 1.0, torch.float32), (2, 64, 1.0, 64, 1.0, torch.bfloat16),
            (4, 300, 0.7, 0, 0.9, torch.float32), (3, 500, 1.0, 40, 0.8, torch.float32),
            (2, 20000, 0.6, 20, 0.95, torch.float32), (2, 20000, 1.0, 0, 0.7, torch.float32)]:
        if device == "cpu" and V > 2100 and os.environ.get("TRITON_INTERPRET") == "1":
            continue
        ties = top_p == 1.0
        x = torch.randn(R, V, generator=gen) * 3
        if ties:
            x[0, ::7] = x[0, 3]                               # ties, some at the top-k threshold
        x = x.to(dtype).to(device)
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] +
                                      ([TopKLogitsWarper(top_k)] if top_k else []) +
                                      ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
        want = warpers(torch.empty(R, 0, dtype=torch.long), x.float().cpu()).softmax(-1)
        got = ops.warped_probs(x, temperature, top_k, top_p).cpu()
        case = (R, V, temperature, top_k, top_p, dtype)
        assert got.dtype == torch.float32 and torch.equal(got == 0, want == 0), case
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), case


@pytest.mark.parametrize("device", DEVICES)
def test_nucleus_with_ties_equals_reference(device):
    """The top-p warper where equal scores straddle the nucleus's edge, which a stable sort resolves lower index
    first (``nucleus_mask_ref``): random rows of a few distinct scores, random top-p and top-k, through
    ``ops.warped_probs`` (the row kernel on the Triton path): exactly the reference's entries kept (long rows: the
    sliced form's test). The reference keeps what transformers' warper keeps where the order of ties is not at
    stake."""
    from transformers.generation.logits_process import TopPLogitsWarper
    gen = seeded('nucleus')
    for i in range(40):
        R, V = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(5, 400, (1,), generator=gen))
        top_k = [0, int(torch.randint(1, min(V, 60) + 1, (1,), generator=gen))][i % 2]
        top_p, temperature = float(torch.rand((), generator=gen)), 0.5 + float(torch.rand((), generator=gen))
        x = torch.randint(0, 6, (R, V), generator=gen).float()
        want = ref.warped_scores_ref(x, temperature, top_k, top_p)
        case = (R, V, top_k, top_p)
        got = ops.warped_probs(x.to(device), temperature, top_k, top_p).cpu()
        assert torch.equal(got == 0, want == float("-inf")), case
        assert torch.allclose(got, want.softmax(-1), atol=1e-6), case
    distinct = torch.randn(3, 300, generator=gen)
    for top_p in (0.0, 0.3, 0.9, 0.999):
        hf = TopPLogitsWarper(top_p)(torch.empty(3, 0, dtype=torch.long), distinct.clone())
        assert torch.equal(ref.warped_scores_ref(distinct, 1.0, 0, top_p), hf), top_p


@pytest.mark.parametrize("device", DEVICES)
def test_warped_probs_sliced_equals_reference(device):
    """Long rows under a top-k warper in slices (``warped_probs_sliced``): exactly the reference's entries kept and
    its probabilities to rounding, with the top-p warper and without; rows of a few distinct scores (ties at both
    thresholds, within a slice and across slices, more of them than a slice lists), rows of distinct scores, with a
    few large ones (the slices' value bisection past its first midpoint), bf16,
    a strided view, -inf entries, a slice all -inf, top-p 0 (the last of the largest alone) and a top-k keeping
    every finite entry; the log-probs alike. On CUDA a long draft row's draws through ``ops.draw_children``."""
    from specla_kernels.draw import sliced_warp_fits, warped_probs_sliced
    gen = seeded('sliced warp')
    block = 64 if device == "cpu" else 1024
    cases = [(2, 700, 5, 0.3, 0.8, "ties"), (3, 1000, 20, 0.95, 1.0, "ties"), (2, 513, 1, 0.9, 0.6, "ties"),
             (2, 900, 50, 1.0, 0.95, "normal"), (3, 650, 8, 0.5, 1.3, "normal"), (1, 300, 7, 0.0, 1.0, "ties"),
             (2, 400, 30, 0.7, 0.7, "bf16"), (2, 800, 12, 0.9, 1.0, "strided"), (2, 5 * block + 7, 16, 0.9, 1.0, "inf"),
             (3, 300, 8, 1.0, 1.0, "peaked"), (3, 700, 5, 0.9, 0.8, "peaked"), (2, 4000, 40, 0.95, 0.7, "peaked")]
    cases += [(int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(block + 1, 10 * block, (1,),
                                                                                  generator=gen)),
               int(torch.randint(1, 40, (1,), generator=gen)), [1.0, float(torch.rand((), generator=gen))][i % 2],
               0.5 + float(torch.rand((), generator=gen)), "ties") for i in range(6)]
    for i, (R, V, top_k, top_p, temperature, kind) in enumerate(cases):
        if kind == "ties":
            x = torch.randint(0, 6, (R, V), generator=gen).float()
        else:
            x = torch.randn(R, 2 * V if kind == "strided" else V, generator=gen) * 3
            x = x[:, ::2] if kind == "strided" else x.to(torch.bfloat16 if kind == "bf16" else torch.float32)
        if kind == "peaked":
            x[:, ::61] += 40.                                  # a few large scores, as real logits have
        if kind == "inf":
            x[0, :2 * block] = float("-inf")                   # whole slices of nothing
            x[1, 5:] = float("-inf")                           # fewer finite entries than the top-k keeps
        assert sliced_warp_fits(V, top_k, block)
        want = ref.warped_scores_ref(x.float(), temperature, top_k, top_p)
        got = warped_probs_sliced(x.to(device), temperature, top_k, top_p, block=block).cpu()
        case = (R, V, top_k, top_p, temperature, kind)
        assert got.dtype == torch.float32 and torch.equal(got == 0, want == float("-inf")), case
        assert torch.allclose(got, want.softmax(-1), atol=1e-6, rtol=1e-5), case
        if i % 3 == 0:
            logp = warped_probs_sliced(x.to(device), temperature, top_k, top_p, block=block, log=True).cpu()
            assert torch.equal(logp.isinf(), got == 0), case
            assert torch.allclose(logp.exp(), got, atol=1e-6, rtol=1e-5), case
    if device == "cuda":            # a draft row too long for one program: ops.draw_children warps it in slices
        x = torch.randn(3, 40000, generator=gen).cuda() * 3
        logq = torch.empty_like(x)
        _, _, token = ops.draw_children(x, 4, 0.7, 20, logq, top_p=0.9)
        want = ref.warped_scores_ref(x, 0.7, 20, 0.9).log_softmax(-1)
        assert torch.equal(logq.isinf(), want.isinf()) and torch.allclose(logq.exp(), want.exp(), atol=1e-6)
        assert want.gather(1, token).isfinite().all()
    assert not sliced_warp_fits(248320, 0) and not sliced_warp_fits(248320, 1024)
    with pytest.raises(ValueError, match="warped_probs_sliced takes a top-k warper"):
        warped_probs_sliced(x.to(device), 1.0, 0, block=block)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_children_draws_from_the_warped_distribution(device):
    """Through ``ops.draw_children`` (the kernel's own Philox uniforms on a seed drawn each call): the first child
    follows the warped distribution and the second the distribution without the first (chi-square, p > 1e-4), and
    the written log-prob row is the warped log-softmax."""
    torch.manual_seed(7)
    x = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 1.5, -0.5]]), -1).to(device)
    temperature, top_k, n = 0.8, 5, 600 if device == "cpu" else 20000
    q = torch.log_softmax(torch.where(x / temperature >= (x / temperature).topk(top_k).values[:, -1:],
                                      x / temperature, float("-inf")), -1)[0].exp().double().cpu()
    first, pairs = torch.zeros(7, dtype=torch.float64), torch.zeros(7, 7, dtype=torch.float64)
    rows = torch.empty_like(x)
    for _ in range(n):
        _, _, token = ops.draw_children(x, 2, temperature, top_k, rows)
        a, b = token[0].tolist()
        first[a] += 1
        pairs[a, b] += 1
    assert torch.allclose(rows[0].exp().double().cpu(), q, atol=1e-6)
    from scipy.stats import chisquare
    kept = q > 0
    assert chisquare(first[kept], q[kept] / q[kept].sum() * first.sum()).pvalue > 1e-4
    top = int(first.argmax())                              # the second draw, given the most frequent first one
    rest = q.clone()
    rest[top] = 0
    rest = rest / rest.sum()
    second = pairs[top]
    assert second[top] == 0 and (first[~kept] == 0).all()
    assert chisquare(second[rest > 0], rest[rest > 0] / rest.sum() * second.sum()).pvalue > 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("N", [3, 37])
def test_small_kernels_with_pdl_equal_without(N):
    """A verify pass's layer (a cuBLAS projection, then tree conv, gates, tree verify, gated norm) replayed from CUDA
    graphs gives the same bits with the small kernels launched with PDL (``pdl_small_kernels``) as without: their
    waits cover every input the kernel before them writes."""
    from specla_kernels.gated_norm import rms_norm_gated
    gen = torch.Generator(device="cuda").manual_seed(N)
    H, K, V, W, hid = 6, 256, 512, 4, 1024
    D = 2 * H * K + H * V
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    h, proj = r(1, N, hid).bfloat16(), (r(D + 2 * H + H * V, hid) * hid ** -0.5).bfloat16()
    conv_w, window, state = r(D, W) * 0.5, r(1, D, W).bfloat16(), r(1, H, V, K) * 0.1
    A_log, dt_bias, norm_w = r(H), r(H), r(V)
    parents = random_parents("bushy", 1, N, torch.Generator().manual_seed(N)).cuda()

    def layer():
        p = torch.nn.functional.linear(h, proj)
        x, a, b, gate = p.split([D, H, H, H * V], -1)
        y, g, beta = tree_conv_gates(x, conv_w, None, window, parents, a, b, A_log, dt_bias,
                                     x_out=torch.empty(1, N, D, dtype=x.dtype, device="cuda"))
        q, k, v = y.split([H * K, H * K, H * V], -1)
        o, k_hat, u = tree_gated_delta_rule(q.view(1, N, H, K), k.view(1, N, H, K), v.view(1, N, H, V), g, beta,
                                            parents, state)
        return rms_norm_gated(o, gate.view(1, N, H, V), norm_w, None, 1e-5), k_hat, u

    outs = []
    for on in (False, True):
        with tuning.using(pdl_small_kernels=on):
            layer()                                              # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = layer()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs.append([t.clone() for t in result])
    for got, want in zip(*outs):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_ops_dispatch(device):
    """ops runs the kernels where Triton runs, and routes what the kernels do not take (prefix) to the reference."""
    gen = torch.Generator().manual_seed(5)
    B, H, HV, K, V = SHAPES[device][0]
    N = 9
    q, k, v, g, beta, state = gdn_inputs(B, N, H, HV, K, V, torch.float32, device, gen)
    parents = random_parents("bushy", B, N, gen).to(device)
    assert ops.use_triton(q)
    for got, want in zip(ops.tree_gated_delta_rule(q, k, v, g, beta, parents, state),
                         ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)):
        check(got, want, 1e-3, "ops.tree_gated_delta_rule")
    # a second tree hanging off the first (prefix) goes to the reference
    prefix = ref.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, state)[1:] + (g,)
    parents2 = torch.cat([parents, torch.full((B, 2), N - 1, device=device)], 1)
    o2, _, _ = ops.tree_gated_delta_rule(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], parents2, state,
                                         prefix=prefix)
    assert torch.isfinite(o2).all()
    accepted = torch.tensor([N - 1] * B, device=device)
    _, k_hat, u = ops.tree_gated_delta_rule(q, k, v, g, beta, parents, state)
    s = state.clone()
    assert ops.commit_state_(s, k_hat, u, g, parents, accepted) is s
    check(s, ref.commit_state_ref(state, k_hat, u, g, parents, accepted), 1e-3, "ops.commit_state_")
    # the warpers: in the kernels up to 16K entries, and beyond where the slices hold the top-k's candidates
    row = torch.zeros(1, 248320, device=device)
    assert ops.warps_in_kernels(row[:, :16384], 0) and ops.warps_in_kernels(row, 20)
    assert not ops.warps_in_kernels(row, 0) and not ops.warps_in_kernels(row, 1000)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_mask_matches_reference(device):
    """``attention_mask``'s kernel against ``attention_mask_ref``, exactly: consumed tokens and tree nodes (every
    topology, a second batch of nodes after earlier pending ones: a column slice of the ancestor mask), sequences of
    different committed lengths, buffers of odd capacities (one slot block and several, pending nodes reaching past
    the end), fp32 / bf16 / fp16 masks."""
    from specla_kernels.masked_attention import attention_mask
    gen = seeded("attention_mask")
    capacities = [37, 150] if device == "cpu" else [300, 2049, 4096]
    for capacity, kind, dtype in itertools.product(capacities, ["chain", "bushy", "forest", "single", None],
                                                   [torch.float32, torch.bfloat16, torch.float16]):
        length = torch.randint(0, capacity - 8, (2,), generator=gen).to(device)
        if kind is None:
            T, ancestors = int(torch.randint(1, 9, (1,), generator=gen)), None
        else:
            N = min(SIZES["cpu"][kind], capacity // 4)
            anc = ref.tree_ancestors(random_parents(kind, 2, N, gen)).to(device)
            first = int(torch.randint(0, N, (1,), generator=gen))        # the nodes added last: rows first..N
            T, ancestors = N - first, anc[:, first:]
        got = attention_mask(length, ancestors, T, capacity, dtype)
        want = ref.attention_mask_ref(length, ancestors, T, capacity, dtype)
        case = (capacity, kind, dtype)
        assert got[0].dtype == dtype and torch.equal(got[0], want[0]), case
        assert torch.equal(got[1], want[1]), case
    # a length near the end: pending nodes past the buffer's last slot are simply not there
    anc = ref.tree_ancestors(random_parents("chain", 1, 8, gen)).to(device)
    length = torch.tensor([capacities[0] - 3], device=device)
    for got, want in zip(attention_mask(length, anc, 8, capacities[0], torch.bfloat16),
                         ref.attention_mask_ref(length, anc, 8, capacities[0], torch.bfloat16)):
        assert torch.equal(got, want)


# (B, H, KV heads, D, buffer slots) of the masked attention: tiny and odd on CPU; on CUDA Qwen3.5's attention layers
# (0.8B: 8 / 2 heads of 256; 9B: 16 / 4) at a graphed cache's 2048 slots, and a short unaligned buffer
MASKED_ATTENTION_SHAPES = {"cpu": [(1, 4, 2, 16, 37), (2, 3, 1, 24, 150)],
                           "cuda": [(1, 8, 2, 256, 2048), (1, 16, 4, 256, 2048), (2, 6, 2, 128, 333)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_attention_matches_reference(device, dtype):
    """The split-KV masked attention against ``masked_attention_ref`` under the masks the hybrids build: a committed
    prefix (empty, short, or reaching into the last tile), then tree nodes each seeing its ancestors and itself, the
    rest hidden; one query (the one-token step) up to more query rows than one program holds; the slot ranges one
    or several (merged), some of them wholly hidden."""
    gen = seeded(dtype, "masked_attention")
    for B, H, KV, D, S in MASKED_ATTENTION_SHAPES[device]:
        for T, splits in ((1, None), (7, 1), (16, 3), (33, None)):
            if T > S // 2:
                continue
            q = torch.randn(B, T, H, D, generator=gen).to(device, dtype).transpose(1, 2)  # the module's layout
            k, v = (torch.randn(B, KV, S, D, generator=gen).to(device, dtype) for _ in range(2))
            seen = torch.zeros(B, T, S, dtype=torch.bool)
            for b in range(B):
                prefix = int(torch.randint(0, S - T + 1, (1,), generator=gen)) if b else S // 2 - T
                parents = random_parents("bushy", 1, T, gen)
                seen[b, :, :prefix] = True
                seen[b, :, prefix:prefix + T] = ref.tree_ancestors(parents)[0]
            mask = torch.zeros(B, 1, T, S, dtype=dtype).masked_fill_(~seen[:, None], torch.finfo(dtype).min)
            mask = mask.to(device)
            want = ref.masked_attention_ref(q, k, v, mask, D ** -0.5)
            got = masked_attention_kernel(q, k, v, mask, D ** -0.5, splits)
            tol = TOL[dtype]
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"T={T} S={S}: {m}")
            # Qwen3.5's output gate, a strided column slice of the projection as the runner passes it
            projected = torch.randn(B, T, H, 2, D, generator=gen).to(device, dtype)
            gate = projected[..., 1, :]
            gated = masked_attention_kernel(q, k, v, mask, D ** -0.5, splits, gate=gate)
            # the gate as torch's ops apply it to the kernel's own output (the reference's output differs by the
            # attention's rounding, which the gate's two roundings could push past the tolerance)
            torch.testing.assert_close(gated, got * torch.sigmoid(gate), rtol=tol, atol=tol,
                                       msg=lambda m: f"gated, T={T} S={S}: {m}")
            torch.testing.assert_close(gated, ref.masked_attention_ref(q, k, v, mask, D ** -0.5, gate), rtol=2 * tol,
                                       atol=2 * tol, msg=lambda m: f"gated against the reference, T={T} S={S}: {m}")
            assert not torch.equal(gated, got)
    with pytest.raises(ValueError, match="gate"):
        masked_attention_kernel(q, k, v, mask, D ** -0.5, gate=gate[:, :1])
