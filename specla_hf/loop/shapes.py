"""Each proposal's shape (draft depth and tree budget), chosen for the most tokens per second on this device
(``ShapePolicy``), from step costs and acceptance remembered across calls (``ShapeMemory``).

A step costs its drafting (one drafter pass per depth) and the verify pass of its tree's bucket (with the acceptance
and the commit after it), and keeps one token more than it accepts. A deeper, wider tree keeps more and costs more;
which shape pays best depends on the acceptance and on the device, so the loop measures both as it runs:

- **costs**: each step's phases are timed on the device's timeline (``PhaseClock``: CUDA events, read once they have
  passed; the wall clock on a CPU, which runs synchronously): the verify pass and the step's tail by verify bucket,
  the drafting by depths drafted. A verify bucket of the menu not
  timed yet is tried with its largest shape (a few proposals at most: a confidence threshold may prune every tree
  below it, and it is then charged as the nearest timed larger bucket); drafting costs of depths not timed yet are
  interpolated. A step runs from its start to the next step's start, so time the GPU waits for the host is charged
  to the drafting before the wait, except where the loop holds a verify pass back on purpose (near the length
  limit). A phase during which CUDA graphs were captured is not timed (each mark holds the
  adapters' capture count: the device loop queues a verify pass, which may capture, before the host reads the step
  before it).
- **acceptance**: one verified tree says what every smaller shape would have accepted (``accepted_within``). A tree
  is the best-scored candidates, so a tree of depth ``d`` and budget ``B`` holds a node of the accepted path iff fewer
  than ``B`` candidates of depth ``<= d`` outscore it, and those all sit in the verified tree. Decayed means per
  shape, over the steps whose tree held it; every ``probe`` proposals the configured shape is drafted whole, so the
  larger shapes stay observed.

The next proposal takes the shape of the most tokens per second, ``(1 + mean accepted + its standard error) / cost``:
optimistic, because a larger shape is observed on fewer steps (the probes, and the steps that chose it), and an
estimate low by chance would otherwise stand uncorrected while an estimate high by chance is soon revised. Under greedy
acceptance the smaller shapes' counts are exact; under sampling they follow the same rule as an estimate (a smaller
tree's rejection would have tried other siblings). Output is lossless whatever the shape: it only decides what is
verified.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specla_hf.drafters.base import candidate_count
from specla_hf.drafters.options import DraftOptions
from specla_hf.models.graphed import tree_bucket

SMALLEST_BUDGET_BUCKET = 16   # smaller trees save no verify time on the GPU (a pass costs about the same from 4 to 16
                              # nodes, docs/results.md), only more tail graphs
DECAY = 0.95                  # weight of a shape's older steps per new one: the acceptance of ~20 recent steps
COST_EMA = 0.25               # weight of a new timing in a phase's running cost
EXPLORE_TRIES = 3             # proposals launched to time a verify bucket before its cost is taken from its neighbours
                              # (a confidence threshold may prune every tree below it)


def budgets(options: DraftOptions) -> list[int]:
    """The tree budgets the policy chooses from: the configured one and each smaller bucket's full tree."""
    smaller, b = [], SMALLEST_BUDGET_BUCKET
    while b - 1 < options.budget:
        smaller.append(b - 1)
        b *= 2
    return smaller + [options.budget]


@dataclass
class ShapeMemory:
    """What the policy learnt under one drafter, its options and sampling rule (kept by the target's adapter,
    ``loop.policy.speculation_memory``): acceptance per shape, cost per verify bucket and per depths drafted."""
    count: torch.Tensor | None = None       # [depth, budgets] decayed steps whose tree held the shape
    accepted: torch.Tensor | None = None    # [depth, budgets] decayed drafts it would have accepted
    squares: torch.Tensor | None = None     # [depth, budgets] decayed squares of those
    verify_seconds: dict[int, float] = field(default_factory=dict)    # bucket -> verify pass + step tail
    draft_seconds: dict[int, float] = field(default_factory=dict)     # depths drafted -> drafting
    since_probe: int = 0                    # proposals since the configured shape was last drafted
    explored: dict[int, int] = field(default_factory=dict)    # untimed bucket -> proposals launched to time it


def accepted_within(parents: torch.Tensor, scores: torch.Tensor, path: list[int],
                    nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each smaller shape would have accepted of a verified tree: ``(accepted, observed)``, both shaped as
    ``nodes [depths, budgets]``, the tree size of each shape (row ``d - 1`` for depth ``d``) for the depths drafted.

    ``parents``/``scores [n]``: the verified tree (node 0 the root, cumulative draft log-probs); ``path``: its accepted
    nodes, root first. The candidates that outscore a node of the path are all in the tree, so its rank is exact; a
    shape is observed when the tree holds at least its size in nodes of its depths, so that no candidate the tree
    lacks (outscored by all of those) is in the shape either. Ties rank the earlier node first, as the selection
    does."""
    n, depths = parents.shape[0], nodes.shape[0]
    up = parents.tolist()
    node_depth = [0] * n
    for i in range(1, n):
        node_depth[i] = node_depth[up[i]] + 1
    within = torch.tensor(node_depth[1:])[None, :] <= torch.arange(1, depths + 1)[:, None]           # [depths, n - 1]
    on_path = torch.tensor(path[1:], dtype=torch.long)            # node of depth j + 1 at row j
    idx = torch.arange(1, n)
    mine, theirs = scores[on_path, None], scores[None, 1:]
    better = (theirs > mine) | ((theirs == mine) & (idx[None, :] < on_path[:, None]))                # [L, n - 1]
    rank = better.to(torch.float64) @ within.to(torch.float64).T                                     # [L, depths]
    held = rank[:, :, None] < nodes[None].to(torch.float64)                                          # [L, depths, B]
    held &= (torch.arange(len(path) - 1)[:, None] < torch.arange(1, depths + 1)[None, :])[:, :, None]
    accepted = held.to(torch.float64).cumprod(0).sum(0)
    observed = within.sum(1, keepdim=True) >= nodes
    return accepted, observed


class PhaseClock:
    """Marks on the device's timeline: CUDA events (read once passed, so the host never waits), or the wall clock on
    a CPU, where every call has run when it returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def passed(self, mark) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class _Phase:
    marks: tuple                # its start and end: (mark on the device's timeline, graph captures so far) each
    costs: dict                 # the ShapeMemory table it is timed into
    key: int                    # its entry there: the verify bucket, or the depths drafted


class ShapePolicy:
    """Sets the drafter's ``depth`` and ``budget`` before each proposal (see module docstring).

    A step is timed from its start to the next step's start, in two phases: the verify pass and the step's tail
    (by verify bucket), then the next proposal's drafting up to the next verify pass (by depths drafted), so that
    time the GPU waits for the host is charged to the proposal it waited after. The verified trees are digested
    when the next proposal is launched, while the GPU verifies, not while the host holds the next step back."""

    def __init__(self, options: DraftOptions, memory: ShapeMemory, device: torch.device,
                 captures: Callable[[], int] = lambda: 0, probe: int = 16):
        self.options, self.memory, self.probe = options, memory, probe
        self.active = options.adaptive
        self.clock = PhaseClock(device)
        self.captures = captures             # graph captures so far, by the adapters of this call
        self.budgets = budgets(options)
        D, B = options.depth, len(self.budgets)
        if memory.count is None or memory.count.shape != (D, B):
            memory.count, memory.accepted, memory.squares = (torch.zeros(D, B, dtype=torch.float64)
                                                             for _ in range(3))
        # the nodes and verify bucket of each shape
        self.nodes = torch.tensor([[min(b, candidate_count(options.topk, d)) for b in self.budgets]
                                   for d in range(1, D + 1)])
        self.buckets = self.nodes.add(1).apply_(tree_bucket)
        self.phases: list[_Phase] = []          # timed, not yet read
        self.drafting: _Phase | None = None     # the launched proposal's drafting, until the next step starts
        self.verified: list[tuple] = []         # verified trees not yet digested

    # ---- what the drivers call ----
    def apply(self, drafter) -> None:
        """Give the drafter the next proposal's shape (the configured one when the policy is off)."""
        m, whole = self.memory, (self.options.depth, self.options.budget)
        drafter.depth, drafter.budget = shape = self.choose() if self.active else whole
        m.since_probe = 0 if shape == whole else m.since_probe + 1
        bucket = int(self.buckets[shape[0] - 1, self.budgets.index(shape[1])])
        if bucket not in m.verify_seconds:
            m.explored[bucket] = m.explored.get(bucket, 0) + 1

    def start(self):
        """Mark a step's start (its verify pass is queued next): the end of the drafting before it."""
        if not self.active:
            return None
        mark = self._mark()
        if self.drafting is not None:
            self.drafting.marks += (mark,)
            self.phases.append(self.drafting)
            self.drafting = None
        return mark

    def launch(self, drafter, start, verified_nodes: int, launch) -> None:
        """Queue the next proposal (``launch()``) in the shape chosen for it; ``start``: this step's mark, whose
        verify pass held ``verified_nodes`` nodes."""
        if not self.active:
            launch()
            return
        tail_end = self._mark()
        self._digest()
        self.phases.append(_Phase((start, tail_end), self.memory.verify_seconds, tree_bucket(verified_nodes)))
        self.apply(drafter)
        launch()
        depths = drafter.launched_depths        # none one token short of the length limit: nothing to time
        self.drafting = _Phase((tail_end,), self.memory.draft_seconds, depths) if depths else None

    def untime_drafting(self) -> None:
        """The launched proposal's verify pass waits for the host (the device loop queues none ahead of a step that
        may reach the length limit): the time to it is not the drafting's."""
        self.drafting = None

    def _mark(self) -> tuple:
        return self.clock.mark(), self.captures()

    # ---- what the loop calls ----
    def observe(self, parents: torch.Tensor, scores: torch.Tensor, path: list[int], depths: int) -> None:
        """A verified tree (host tensors), its accepted path and drafted depths."""
        if self.active:
            self.verified.append((parents, scores, path, depths))

    def finish(self) -> None:
        """At the end of a call: keep what its last steps measured (a drafting still open has no end)."""
        if self.active:
            self._digest()

    def _digest(self) -> None:
        """Fold the verified trees into the acceptance, and the phases that have passed into the costs."""
        m, D = self.memory, self.options.depth
        for parents, scores, path, depths in self.verified:
            if not depths:           # none when the sequence was one token short of its length limit
                continue
            within, observed = accepted_within(parents, scores, path, self.nodes[:depths])
            seen = torch.zeros(D, len(self.budgets), dtype=torch.bool)
            accepted = torch.zeros(D, len(self.budgets), dtype=torch.float64)
            seen[:depths], accepted[:depths] = observed, within
            m.count[seen] = m.count[seen] * DECAY + 1
            m.accepted[seen] = m.accepted[seen] * DECAY + accepted[seen]
            m.squares[seen] = m.squares[seen] * DECAY + accepted[seen] ** 2
        self.verified.clear()
        while self.phases and self.clock.passed(self.phases[0].marks[-1][0]):
            phase = self.phases.pop(0)
            (start, captures_before), (end, captures_after) = phase.marks
            if captures_before == captures_after:
                seconds, costs, key = self.clock.seconds(start, end), phase.costs, phase.key
                costs[key] = seconds if key not in costs else (1 - COST_EMA) * costs[key] + COST_EMA * seconds


    # ---- the choice ----
    def choose(self) -> tuple[int, int]:
        """(depth, budget) of the next proposal: the configured shape to probe; a verify bucket not timed yet with
        its largest shape (up to ``EXPLORE_TRIES`` proposals); else the most tokens per second among the shapes
        observed."""
        m, D = self.memory, self.options.depth
        whole = (D, self.options.budget)
        if not m.verify_seconds or m.since_probe >= self.probe:
            return whole
        for bucket in sorted(set(self.buckets.flatten().tolist()), reverse=True):
            if bucket not in m.verify_seconds and m.explored.get(bucket, 0) < EXPLORE_TRIES:
                d, b = max(zip(*torch.nonzero(self.buckets == bucket, as_tuple=True)),
                           key=lambda db: (self.nodes[db].item(), db[0].item()))
                return int(d) + 1, self.budgets[int(b)]
        # optimistic by one standard error: a shape observed on few steps (a larger one, seen on probes only) is
        # tried again until its count is firm, where a pessimistic chance estimate would never be revised
        mean = m.accepted / m.count
        tokens = 1 + mean + ((m.squares / m.count - mean ** 2).clamp(min=0) / m.count).sqrt()
        cost = (torch.tensor([self.draft_cost(d) for d in range(1, D + 1)], dtype=torch.float64)[:, None]
                + self.buckets.to(torch.float64).apply_(lambda b: self.verify_cost(int(b))))
        rate = torch.where(m.count > 0, tokens / cost, -1.0)
        d, b = divmod(int(rate.argmax()), len(self.budgets))
        return (d + 1, self.budgets[b]) if rate.max() > 0 else whole

    def verify_cost(self, bucket: int) -> float:
        """Seconds a step's verify pass and tail cost in ``bucket``: timed, else those of the nearest timed larger
        bucket (else smaller): a bucket its trees never reach (pruned below it) is charged as its neighbour."""
        known = self.memory.verify_seconds
        if bucket in known:
            return known[bucket]
        larger = [b for b in known if b > bucket]
        return known[min(larger)] if larger else known[max(known)]

    def draft_cost(self, depths: int) -> float:
        """Seconds drafting ``depths`` depths costs: timed, or interpolated between the nearest timed depths
        (proportional beyond them). Drafting fewer depths is the start of drafting more, so no depth costs more than
        a deeper timed one: a chance-slow timing of a depth, which the policy would then avoid and never time again,
        does not stand as its cost."""
        timed = self.memory.draft_seconds
        known = {d: min(c for e, c in timed.items() if e >= d) for d in timed}
        if depths in known:
            return known[depths]
        if not known:
            return 0.0
        below = [d for d in known if d < depths]
        above = [d for d in known if d > depths]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (depths - lo) / (hi - lo)
        nearest = max(below) if below else min(above)
        return known[nearest] * depths / nearest
