"""The proposal shape policy: what a smaller tree would have accepted, and which shape it picks from costs."""
import time

import pytest
import torch

from conftest import tiny_gdn
from specla_hf.drafters.base import candidate_count, candidate_depths, select_tree_rows
from specla_hf.drafters.options import DraftOptions
from specla_hf.loop.shapes import ShapeMemory, ShapePolicy, accepted_within, budgets


def drafted_candidates(K: int, D: int, gen: torch.Generator):
    """Candidates as ``DraftBuffers`` records them: depth 1 the root's K children, then the K best (by cumulative
    log-prob) of each depth expanded into K children each; siblings hold distinct tokens."""
    score, token, parent = [], [], []
    frontier = [(-1, 0.0)]                                   # (candidate index, its score); -1: the root
    for d in range(1, D + 1):
        first = len(score)
        for up, up_score in frontier:
            logp = torch.log(torch.rand(K, generator=gen).clamp(min=1e-3))
            for tok, lp in zip(torch.randperm(6, generator=gen)[:K].tolist(), logp.tolist()):
                score.append(up_score + lp)
                token.append(tok)
                parent.append(up)
        mine = range(first, len(score))
        frontier = sorted(((i, score[i]) for i in mine), key=lambda x: -x[1])[:K]
    return (torch.tensor(score, dtype=torch.float64), torch.tensor(token, dtype=torch.float64),
            torch.tensor(parent, dtype=torch.float64))


def tree_of(score, token, parent, K: int, depths: int, n: int):
    """The tree of the ``n`` best candidates of depths ``1..depths`` (the drafter's selection): rows tokens,
    parents, scores with the root in column 0."""
    C = candidate_count(K, depths)
    rows = torch.zeros(3, n + 1, dtype=torch.float64)
    rows[1, 0] = -1
    select_tree_rows(score[:C], token[:C], parent[:C], candidate_depths(K, depths), n, rows)
    return rows


def accepted_path(rows, secret: list[int]) -> list[int]:
    """The greedy walk: from the root, the child holding the target's next token, while there is one."""
    tokens, parents = rows[0].long().tolist(), rows[1].long().tolist()
    path = [0]
    for want in secret:
        child = [i for i in range(1, len(tokens)) if parents[i] == path[-1] and tokens[i] == want]
        if not child:
            break
        path.append(child[0])
    return path


@pytest.mark.parametrize("seed", range(12))
def test_a_verified_tree_says_what_each_smaller_shape_accepts(seed):
    """Against building each smaller tree and walking it: every shape the tree holds gets its exact count."""
    gen = torch.Generator().manual_seed(seed)
    K, D = int(torch.randint(2, 5, (), generator=gen)), int(torch.randint(2, 7, (), generator=gen))
    score, token, parent = drafted_candidates(K, D, gen)
    n = int(torch.randint(K, len(score) + 1, (), generator=gen))
    rows = tree_of(score, token, parent, K, D, n)
    # the target follows one drafted branch (in the tree or not) for a random length, then wants a token no child holds
    leaf = int(torch.randint(0, len(score), (), generator=gen))
    branch = []
    while leaf >= 0:
        branch.append(int(token[leaf]))
        leaf = int(parent[leaf])
    secret = branch[::-1][:int(torch.randint(0, D + 1, (), generator=gen))] + [99]
    path = accepted_path(rows, secret)
    sizes = sorted({3, 7, 15, n - 1, n, n + 4} - {0})
    nodes = torch.tensor([[min(b, candidate_count(K, d)) for b in sizes] for d in range(1, D + 1)])
    got, observed = accepted_within(rows[1].long(), rows[2], path, nodes)
    tree_depths = [0] * (n + 1)
    for i in range(1, n + 1):
        tree_depths[i] = tree_depths[int(rows[1, i])] + 1
    checked = 0
    for d in range(1, D + 1):
        for j, b in enumerate(sizes):
            small = int(nodes[d - 1, j])
            expect = len(accepted_path(tree_of(score, token, parent, K, d, small), secret)) - 1
            if observed[d - 1, j]:
                assert got[d - 1, j] == expect, (d, b)
                checked += 1
            else:                       # the tree holds fewer nodes of these depths than the shape
                assert sum(1 <= t <= d for t in tree_depths[1:]) < small
    assert checked and got.max() == len(path) - 1


def policy_with(memory: ShapeMemory, depth=8, topk=4, budget=63) -> ShapePolicy:
    return ShapePolicy(DraftOptions(depth=depth, topk=topk, budget=budget), memory, torch.device("cpu"))


def test_budgets_are_the_configured_one_and_smaller_buckets():
    assert budgets(DraftOptions(depth=8, topk=4, budget=63)) == [15, 31, 63]
    assert budgets(DraftOptions(depth=8, topk=4, budget=40)) == [15, 31, 40]
    assert budgets(DraftOptions(depth=6, topk=1, budget=6)) == [6]


def test_the_policy_probes_untimed_buckets_then_picks_the_best_rate():
    memory = ShapeMemory()
    policy = policy_with(memory)
    assert policy.choose() == (8, 63)                      # nothing timed: the configured shape
    memory.verify_seconds[64] = 2.0
    memory.draft_seconds[8] = 1.6
    assert policy.choose() == (8, 31)                      # the 32-node bucket is not timed: its largest shape
    memory.verify_seconds[32] = 1.8
    assert policy.choose() == (8, 15)
    memory.verify_seconds.update({16: 1.6, 8: 1.5})
    # low acceptance that a small tree keeps almost all of: the small, shallow tree
    memory.count.fill_(5.0)
    memory.accepted.copy_(torch.tensor([[min(d, 2.0) * 5 * (0.9 + 0.05 * b) for b in range(3)]
                                        for d in range(1, 9)], dtype=torch.float64))
    depth, budget = policy.choose()
    assert budget == 15 and depth == 2
    # high acceptance that grows with depth and width: the whole tree
    memory.accepted.copy_(torch.tensor([[d * 5 * (0.5 + 0.25 * b) for b in range(3)] for d in range(1, 9)],
                                       dtype=torch.float64))
    assert policy.choose() == (8, 63)
    memory.since_probe = 16
    memory.accepted.zero_()
    assert policy.choose() == (8, 63)                      # the periodic probe of the configured shape


def test_a_bucket_the_trees_never_reach_is_tried_then_charged_as_its_neighbour():
    """A confidence threshold may prune every tree below a bucket: after a few proposals launched to time it, its
    cost is the nearest timed larger bucket's, and the policy chooses among the shapes again."""
    memory = ShapeMemory(verify_seconds={64: 2.0, 16: 1.5, 8: 1.5}, draft_seconds={8: 0.8})
    policy = policy_with(memory)
    memory.count.fill_(5.0)
    memory.accepted.fill_(5.0)                              # one draft accepted in every shape: the cheapest wins

    class Drafter:
        depth = budget = None
    for _ in range(3):
        policy.apply(Drafter)
        assert (Drafter.depth, Drafter.budget) == (8, 31)    # the 32-node bucket, never timed
    assert policy.verify_cost(32) == 2.0 and policy.verify_cost(8) == 1.5
    policy.apply(Drafter)
    assert (Drafter.depth, Drafter.budget) == (1, 15)       # depth 1: 4 nodes, the 8-node bucket at 16's cost


def test_a_proposal_of_no_depth_is_not_timed():
    """One token short of the length limit nothing is drafted: no drafting cost of 0 depths to scale others by."""
    policy = policy_with(ShapeMemory())

    class Drafter:
        depth = budget = None
        launched_depths = 0
    policy.launch(Drafter, policy.start(), 1, lambda: None)
    policy.start()
    policy.finish()
    assert policy.memory.verify_seconds and not policy.memory.draft_seconds


def test_a_phase_that_captured_graphs_is_not_timed():
    """Each mark holds the capture count: a verify pass (with its tail) or a drafting during which a CUDA graph was
    captured keeps no cost, whichever call of the loop the capture fell in; the phases around it keep theirs."""
    captures = [0]
    policy = ShapePolicy(DraftOptions(depth=2, topk=2, budget=3), ShapeMemory(), torch.device("cpu"),
                         lambda: captures[0])

    class Drafter:
        depth = budget = None
        launched_depths = 2
    start = policy.start()
    captures[0] += 1                                  # the verify pass or its tail captured
    policy.launch(Drafter, start, 4, lambda: None)
    start = policy.start()                            # the drafting captured nothing
    policy.finish()
    assert not policy.memory.verify_seconds and list(policy.memory.draft_seconds) == [2]
    drafted = policy.memory.draft_seconds[2]
    policy.launch(Drafter, start, 4, lambda: None)    # a verify pass that captured nothing
    captures[0] += 1                                  # the next drafting captured
    time.sleep(0.01)
    policy.start()
    policy.finish()
    assert list(policy.memory.verify_seconds) == [4] and policy.memory.draft_seconds == {2: drafted}


def test_a_drafting_whose_verify_pass_waits_for_the_host_is_not_timed():
    """Near the length limit the device loop queues the next verify pass only after reading the step: the time to it
    is the host's, not the drafting's (the verify phase is still timed)."""
    policy = ShapePolicy(DraftOptions(depth=2, topk=2, budget=3), ShapeMemory(), torch.device("cpu"))

    class Drafter:
        depth = budget = None
        launched_depths = 2
    policy.launch(Drafter, policy.start(), 4, lambda: None)
    policy.untime_drafting()
    time.sleep(0.01)
    policy.start()
    policy.finish()
    assert list(policy.memory.verify_seconds) == [4] and not policy.memory.draft_seconds


def test_draft_costs_interpolate_between_timed_depths():
    memory = ShapeMemory(draft_seconds={2: 0.2, 8: 0.8})
    policy = policy_with(memory)
    assert policy.draft_cost(5) == pytest.approx(0.5)
    assert policy.draft_cost(1) == pytest.approx(0.1)
    assert policy.draft_cost(8) == 0.8
    # a chance-slow timing of a shallower depth is capped by a deeper one (its drafting includes the shallower's)
    policy = policy_with(ShapeMemory(draft_seconds={1: 0.1, 3: 10.0, 6: 0.6}))
    assert policy.draft_cost(3) == 0.6 and policy.draft_cost(2) == pytest.approx(0.35)


def test_generate_moves_the_shape_and_measures_each_bucket(bad_drafter):
    """A drafter that is never right, on a target where verifying more nodes costs more: the policy times each
    verify bucket and settles on a small shape; output stays the target's own."""
    model = tiny_gdn(seed=81)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(81))
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=bad_drafter, tree=True,
                         tree_budget=63, autoregressive_fallback=False)
    assert torch.equal(out, plain)
    nodes = model.specla_stats.draft_nodes
    assert nodes[0] == 63 and {4, 15, 31} <= set(nodes)                 # each bucket tried
    settled = nodes[8:]                                                  # past the buckets' capture and timing
    assert sum(n < 63 for n in settled) >= len(settled) - 3             # the whole tree only on probes
