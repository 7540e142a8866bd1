"""Drafting: the tree selection (``select_tree_rows``, on the device without a threshold and on the host with one)
against a plain Python statement of the rule (same nodes, order and parents, on random candidate sets with exact
score ties and certain (log-prob 0) drafts), and proposed trees against what the drafter model predicts."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_gdn
from specla_hf.drafters.base import DraftBuffers, DraftTree, Launched
from specla_hf.drafters.options import DraftOptions
from specla_hf.drafters.small_model import GDNDrafter
from test_cuda_graphs import emulate_graphs


def random_candidates(b: DraftBuffers, depth: int, gen: torch.Generator) -> None:
    """Fill ``b.cand`` like ``_depth_step`` would: K root children, then K * K per depth below K nodes of the previous
    depth, each scoring its parent's cumulative log-prob plus a log-prob <= 0 (some exactly 0, some tied)."""
    K = b.topk
    b.cand.copy_(torch.stack([torch.full(b.cand.shape[1:], v, dtype=torch.float64)
                              for v in (float("-inf"), 0.0, -1.0)]))
    flat_scores = []

    def step_logp(n: int) -> torch.Tensor:
        lp = -torch.rand(n, generator=gen, dtype=torch.float64).mul(3).round(decimals=1)   # coarse: many ties
        lp[torch.rand(n, generator=gen) < 0.2] = 0.0                                      # certain drafts
        return lp
    root = step_logp(K)
    b.cand[0, 0, :K], b.cand[1, 0, :K], b.cand[2, 0, :K] = root, torch.randint(0, 50, (K,), generator=gen), -1
    flat_scores += root.tolist()
    prev = list(range(K))                                   # flat indices of the previous depth's candidates
    for d in range(2, depth + 1):
        frontier = [prev[i] for i in torch.randperm(len(prev), generator=gen)[:K].tolist()]
        parents = torch.tensor(frontier).repeat_interleave(K)
        scores = torch.tensor([flat_scores[p] for p in parents.tolist()], dtype=torch.float64) + step_logp(K * K)
        b.cand[0, d - 1], b.cand[2, d - 1] = scores, parents.double()
        b.cand[1, d - 1] = torch.randint(0, 50, (K * K,), generator=gen).double()
        base = len(flat_scores)
        flat_scores += scores.tolist()
        prev = list(range(base, base + K * K))


def rule_select(b: DraftBuffers, depths: int, budget: int, log_threshold: float = float("-inf")) -> DraftTree:
    """The selection rule written out: drop candidates under the threshold, then take the best by cumulative
    log-prob (ties: shallower, then earlier), skipping any whose parent is not taken; order them by depth, best
    first."""
    K = b.topk
    score, token, parent = torch.cat([b.cand[:, 0, :K], b.cand[:, 1:depths].flatten(1)], 1).tolist()
    depth = [1] * K + [d for d in range(2, depths + 1) for _ in range(K * K)]
    kept = [i for i in range(len(score)) if score[i] >= log_threshold]
    keep: list[int] = []
    for i in sorted(kept, key=lambda i: (-score[i], depth[i], i)):
        if len(keep) == budget:
            break
        if parent[i] < 0 or int(parent[i]) in keep:
            keep.append(i)
    order = sorted(keep, key=lambda i: (depth[i], -score[i], i))
    node = {c: n + 1 for n, c in enumerate(order)}
    tokens = [int(b.tokens[0])] + [int(token[i]) for i in order]
    parents = [-1] + [node[int(parent[i])] if parent[i] >= 0 else 0 for i in order]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor([0.0] + [score[i] for i in order]))


@pytest.mark.parametrize("topk,depth,budget", [(1, 6, 6), (3, 4, 10), (4, 6, 31), (4, 6, 127), (2, 5, 1)])
def test_tree_selection_follows_the_rule(topk, depth, budget):
    gen = torch.Generator().manual_seed(topk * 100 + depth * 10 + budget)
    b = DraftBuffers(topk, depth, torch.device("cpu"))
    drafter = GDNDrafter.__new__(GDNDrafter)          # only its host selection (``collect`` after a threshold)
    drafter.options, drafter.buffers = DraftOptions(depth=depth, topk=topk, budget=budget), b
    for trial in range(20):
        random_candidates(b, depth, gen)
        b.tokens[0] = 7 + trial
        for depths in range(1, depth + 1):
            want = rule_select(b, depths, budget)
            b.select_tree(depths, budget)                       # the device selection (no threshold)
            b.queue_tree()
            got = b.read_tree(len(want))
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents), (trial, depths)
            assert torch.allclose(got.log_probs, want.log_probs.double())
            assert len(want) == 1 + min(budget, topk + (depths - 1) * topk * topk)
            log_threshold = -1.0 - 0.5 * (trial % 3)            # the host selection, some candidates pruned
            want = rule_select(b, depths, budget, log_threshold)
            drafter._launched = Launched(b.tokens[:1], depths, budget, log_threshold, None)
            got = drafter.collect()
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents), (trial, depths)
            assert torch.allclose(got.log_probs, want.log_probs.double())


@pytest.mark.parametrize("graphs", [False, True])
def test_proposed_trees_score_what_the_drafter_model_predicts(graphs):
    """Every draft node's cumulative log-prob is its parent's plus the drafter model's log-prob of the node's token
    after the sequence and the path to it (a plain forward). Covers the root consumed by ``start`` (depth 1 reads its
    distribution; deeper passes see its children as children of the drafter's committed state) and the catch-up of
    a second proposal after the sequence grew, eager and with (emulated) CUDA graphs."""
    model = tiny_gdn(seed=61)
    if graphs:
        emulate_graphs(model, "drafter")
    drafter = GDNDrafter(model, DraftOptions(depth=3, topk=2, budget=20))
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 97, (1, 6), generator=gen)
    for grow in (0, 3):
        ids = torch.cat([ids, torch.randint(0, 97, (1, grow), generator=gen)], 1)
        tree = drafter.propose(ids)
        assert len(tree) == 1 + 2 + 2 * 2 * 2 and drafter.consumed == ids.shape[1]
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        for i in range(1, len(tree)):
            path, node = [], parents[i]
            while node > 0:
                path.insert(0, tokens[node])
                node = parents[node]
            with torch.no_grad():
                logits = model(torch.cat([ids, torch.tensor([path], dtype=ids.dtype)], 1)).logits[0, -1]
            expected = tree.log_probs[parents[i]] + torch.log_softmax(logits.float(), -1)[tokens[i]]
            torch.testing.assert_close(tree.log_probs[i].float(), expected.float(), rtol=1e-4, atol=1e-4)
