"""How drafts are shaped (``DraftOptions``) and generate()'s defaults: plain data, importable without torch (the
CLI's ``--help`` reads them)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_TREE_BUCKET = 128      # nodes one verify pass takes, the root included (CUDA-graph buckets and kernels)
MAX_TREE_BUDGET = MAX_TREE_BUCKET - 1      # draft nodes one verify pass takes besides the root


@dataclass
class DraftOptions:
    """How drafts are shaped. ``topk == 1`` gives a chain of up to ``depth`` tokens."""
    depth: int = 8                        # max draft depth
    topk: int = 1                         # children per expanded node, and nodes expanded per depth
    budget: int = 8                       # max draft nodes submitted (root excluded)
    threshold: float | None = 0.0         # cumulative-confidence floor for submitted nodes (0 = no pruning; None =
                                          # the device's default, ``default_threshold``)
    adaptive: bool = True                 # recalibrate the threshold from observed acceptance, and choose each
                                          # proposal's depth and budget up to these (``loop.shapes``)
    sampled: bool = True                  # under sampling, draw each node's children from the drafter's
                                          # distribution (``DynamicTreeDrafter.sample_drafts``), not its top-k
    temperature_ratio: float | None = None  # drawn children come at the target's temperature times this (None: the
                                          # drafter's calibrated ratio, ``DynamicTreeDrafter.temperature_ratio``)

    def __post_init__(self):
        for name, value in (("draft_depth", self.depth), ("tree_topk", self.topk), ("tree_budget", self.budget)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.budget > MAX_TREE_BUDGET:
            raise ValueError(f"tree_budget={self.budget}: a verify pass takes at most {MAX_TREE_BUCKET} nodes, the "
                             f"root included; pass at most {MAX_TREE_BUDGET}")
        if self.temperature_ratio is not None and not (isinstance(self.temperature_ratio, (int, float))
                                                       and 0.0 < self.temperature_ratio < float("inf")):
            raise ValueError(f"draft_temperature_ratio must be a positive number, got {self.temperature_ratio!r}")
        if self.threshold is not None and not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {self.threshold}")
        if 1 + self.topk * self.depth > MAX_TREE_BUCKET:
            raise ValueError(f"a draft tree of depth {self.depth} expanding {self.topk} nodes per depth holds "
                             f"{1 + self.topk * self.depth} nodes; the drafter verifies at most {MAX_TREE_BUCKET} "
                             "in one pass: lower draft_depth or tree_topk")


CHAIN_DEFAULTS = DraftOptions(depth=6, topk=1, budget=6, threshold=None)
CPU_CHAIN_THRESHOLD = 0.02


def default_threshold(device_type: str) -> float:
    """A chain's confidence threshold by default on ``device_type``. On a CPU drafting stops at the first depth
    whose draft falls below it, which saves drafter passes that each cost real time; on a GPU a threshold selects
    each proposal on the host (a read-back each depth, no verify pass queued ahead), and the shape policy already
    sizes each proposal from the measured costs and acceptance."""
    return CPU_CHAIN_THRESHOLD if device_type == "cpu" else 0.0


# a tree of budget + 1 nodes is verified in a power-of-two bucket: 63 drafts + the root fill the 64-node bucket. No
# pruning by default: on the H200 at the 1.3B shape a verify pass costs about the same from 4 to 32 nodes, so pruning
# loses more tau than it saves time (docs/results.md)
TREE_DEFAULTS = DraftOptions(depth=8, topk=4, budget=63, threshold=0.0)
