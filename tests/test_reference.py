"""The torch reference of tree verification, commit and tree conv against token-by-token recurrence."""
import pytest
import torch

from specla_kernels.reference import (chain_parents, commit_state_ref, commit_window_ref, conv_sequence_ref,
                                      recurrent_gated_delta_rule_ref, tree_ancestors, tree_conv_ref,
                                      tree_gated_delta_rule_ref)


def random_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "forest":
        return [-1 if torch.rand((), generator=gen) < 0.3 or i == 0 else int(torch.randint(0, i, (), generator=gen))
                for i in range(n)]
    if kind == "deep":   # mostly extends the latest node
        return [-1] + [i - 1 if torch.rand((), generator=gen) < 0.8 else int(torch.randint(0, i, (), generator=gen))
                       for i in range(1, n)]
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]   # bushy / random


def inputs(B, N, H, HV, K, V, gen, dtype=torch.float64):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return (r(B, N, H, K), r(B, N, H, K), r(B, N, HV, V), -torch.rand(B, N, HV, generator=gen, dtype=dtype) * 2,
            torch.rand(B, N, HV, generator=gen, dtype=dtype), r(B, HV, V, K))


def path_of(parents: torch.Tensor, i: int) -> torch.Tensor:
    return tree_ancestors(parents[None])[0, i].nonzero().flatten()


@pytest.mark.parametrize("kind", ["chain", "star", "forest", "deep", "bushy"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4, 8), (2, 7, 2, 4, 8, 16), (1, 13, 3, 3, 5, 7)])
def test_tree_equals_each_path_run_alone(kind, shape):
    B, N, H, HV, K, V = shape
    gen = torch.Generator().manual_seed(hash((kind, shape)) % 2**31)
    q, k, v, g, beta, S0 = inputs(B, N, H, HV, K, V, gen)
    parents = torch.tensor([random_parents(N, kind, gen) for _ in range(B)])
    o, k_hat, u = tree_gated_delta_rule_ref(q, k, v, g, beta, parents, S0)
    assert torch.isfinite(o).all()
    for b in range(B):
        for i in range(N):
            p = path_of(parents[b], i)
            o_seq, S_seq = recurrent_gated_delta_rule_ref(q[b:b + 1, p], k[b:b + 1, p], v[b:b + 1, p],
                                                          g[b:b + 1, p], beta[b:b + 1, p], S0[b:b + 1])
            torch.testing.assert_close(o[b, i], o_seq[0, -1], rtol=1e-5, atol=1e-5)
            accepted = torch.full((B,), -1)
            accepted[b] = i
            S = commit_state_ref(S0, k_hat, u, g, parents, accepted)
            torch.testing.assert_close(S[b].double(), S_seq[0].double(), rtol=1e-5, atol=1e-5)
            others = torch.arange(B) != b
            torch.testing.assert_close(S[others].double(), S0[others].double())


def test_prefix_extension_equals_one_pass():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, S0 = inputs(2, 9, 2, 4, 8, 16, gen)
    parents = torch.tensor([random_parents(9, "bushy", gen) for _ in range(2)])
    o, k_hat, u = tree_gated_delta_rule_ref(q, k, v, g, beta, parents, S0)
    o1, kh1, u1 = tree_gated_delta_rule_ref(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], parents[:, :4], S0)
    o2, kh2, u2 = tree_gated_delta_rule_ref(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:], parents, S0,
                                            prefix=(kh1, u1, g[:, :4]))
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([u1, u2], 1), u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["chain", "star", "forest", "bushy"])
@pytest.mark.parametrize("W", [2, 4])
def test_tree_conv_and_window_commit(kind, W):
    gen = torch.Generator().manual_seed(W)
    B, N, D = 2, 11, 5
    x = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(D, generator=gen, dtype=torch.float64)
    window = torch.randn(B, D, W, generator=gen, dtype=torch.float64)
    parents = torch.tensor([random_parents(N, kind, gen) for _ in range(B)])
    y = tree_conv_ref(x, w, bias, window, parents)
    for b in range(B):
        for i in range(N):
            p = path_of(parents[b], i)
            y_seq, new_window = conv_sequence_ref(x[b:b + 1, p], w, bias, window[b:b + 1])
            torch.testing.assert_close(y[b, i], y_seq[0, -1], rtol=1e-5, atol=1e-6)
            accepted = torch.full((B,), -1)
            accepted[b] = i
            committed = commit_window_ref(x, window, parents, accepted)
            torch.testing.assert_close(committed[b], new_window[0])
            torch.testing.assert_close(committed[1 - b], window[1 - b])


def test_chain_parents():
    assert chain_parents(4).tolist() == [[-1, 0, 1, 2]]
