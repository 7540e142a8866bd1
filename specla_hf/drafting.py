"""Proposing drafts: token trees (a chain is a tree with one child per node) with confidence pruning.

A ``DraftTree`` always has the *pending* token as node 0: the last emitted token, which the target has not consumed
yet. Verifying the tree therefore yields the target's distribution after the pending token (node 0) and after every
draft node, and the bonus token of a step becomes the next step's root.

``DynamicTreeDrafter`` is the EAGLE-2-style expansion shared by every drafter: at each depth the ``topk`` most
confident frontier nodes (by cumulative draft probability) are expanded by one drafter pass, each gets its ``topk``
best children, and at the end the global top-``budget`` nodes are submitted; nodes whose cumulative probability is
under the (adaptive) confidence threshold are never submitted, and a depth whose best node falls under it ends the
drafting. Subclasses say how one drafter pass scores a set of frontier nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import CandidateGenerator


@dataclass
class DraftTree:
    tokens: torch.Tensor          # [N] node 0 = pending token
    parents: torch.Tensor         # [N] parents[0] = -1, parents[i] < i
    log_probs: torch.Tensor       # [N] cumulative draft log-probability (0 at the root)

    def __post_init__(self):
        self.children: list[list[int]] = [[] for _ in range(len(self.tokens))]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            self.children[p].append(i)  # nodes were added best-first, so siblings are in draft preference order

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class DraftOptions:
    """How drafts are shaped. ``topk == 1`` gives a chain of up to ``depth`` tokens."""
    depth: int = 8                        # max draft depth
    topk: int = 1                         # children per expanded node, and nodes expanded per depth
    budget: int = 8                       # max draft nodes submitted (root excluded)
    threshold: float = 0.0                # cumulative-confidence floor for submitted nodes (0 = no pruning)
    adaptive: bool = True                 # recalibrate the threshold and depth from observed acceptance

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.budget < 1:
            raise ValueError(f"draft depth, topk and budget must be >= 1, got {self}")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1), got {self.threshold}")


@dataclass
class _Candidate:
    token: int
    parent: int        # index into the candidate list, -1 for children of the root
    log_prob: float    # cumulative
    depth: int


@dataclass
class AcceptanceCalibration:
    """Running ratio of accepted drafts to the drafter's predicted acceptance (sum of submitted path probabilities).

    A calibrated drafter has ratio 1; an over-confident one < 1. The effective threshold is ``threshold / ratio``:
    when drafts are accepted less often than their confidence says, fewer low-confidence nodes are verified.
    """
    ratio: float = 1.0
    momentum: float = 0.8
    history: list[float] = field(default_factory=list)

    def update(self, predicted: float, accepted: int) -> None:
        if predicted > 0:
            observed = min(max(accepted / predicted, 0.25), 4.0)
            self.ratio = self.momentum * self.ratio + (1 - self.momentum) * observed
            self.history.append(self.ratio)


class DynamicTreeDrafter(CandidateGenerator):
    """EAGLE-2-style dynamic tree drafting with confidence pruning (see module docstring)."""

    # target layers whose hidden states the drafter reads (0 = embeddings, i = after block i); empty for drafters
    # that only see tokens
    feature_layers: tuple[int, ...] = ()

    def __init__(self, options: DraftOptions):
        self.options = options
        self.calibration = AcceptanceCalibration()
        self.depth = options.depth
        self.last_tree: DraftTree | None = None
        self.last_pruned = 0   # candidate nodes dropped by the threshold in the last proposal

    # ---- what a subclass provides ----
    def start(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Catch up on ``input_ids`` (pending token last); return the draft log-probs after it, ``[1, vocab]``."""
        raise NotImplementedError

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Run the drafter on new nodes (``tokens [n]``, ``parents [n]``, on the drafter's device); log-probs
        ``[n, vocab]``. Drafter nodes are numbered root 0, then in the order they are expanded; ``parents`` are such
        numbers. Called without any host synchronisation in between: keep it free of ``.item()``/``.tolist()``."""
        raise NotImplementedError

    def finish(self, accepted_tokens: list[int]) -> None:
        """The target accepted ``accepted_tokens`` after the pending token: roll the drafter's state forward."""
        raise NotImplementedError

    def add_features(self, features: tuple[torch.Tensor, ...]) -> None:
        """Target hidden states (one ``[1, n, hidden]`` per feature layer) of the ``n`` positions the target just
        committed, in order. Only target-aligned drafters (``feature_layers`` set) use them."""

    # ---- the expansion ----
    @property
    def threshold(self) -> float:
        base = self.options.threshold
        return min(base / self.calibration.ratio, 0.99) if self.options.adaptive else base

    def propose(self, input_ids: torch.LongTensor, max_depth: int | None = None) -> DraftTree:
        """Draft a tree. Every depth's scoring and expansion stays on the device (one drafter pass each, no host
        round trip); the candidates come to the host once, at the end, for the global selection. With a confidence
        threshold one scalar per depth is read back, to stop once no candidate of a depth clears it."""
        opts, threshold = self.options, self.threshold
        log_threshold = _log(threshold)
        depth_limit = self.depth if max_depth is None else max(0, min(self.depth, max_depth))
        K = opts.topk
        logps = self.start(input_ids)                              # [frontier, vocab]
        dev = logps.device
        frontier_score = logps.new_zeros(1)                         # cumulative log-prob of each frontier node
        frontier_cand = torch.full((1,), -1, dtype=torch.long, device=dev)   # its candidate index (root: -1)
        frontier_node = torch.zeros(1, dtype=torch.long, device=dev)         # its drafter node id
        scores, tokens, parents, depths = [], [], [], []           # candidates of every depth, in order
        num_cands, num_nodes = 0, 1
        for depth in range(1, depth_limit + 1):
            top = torch.topk(logps, K, dim=-1)
            score = (frontier_score[:, None] + top.values).flatten()             # [frontier * K]
            scores.append(score)
            tokens.append(top.indices.flatten())
            parents.append(frontier_cand.repeat_interleave(K))
            depths.append(score.shape[0])
            if depth == depth_limit or (threshold > 0 and float(score.max()) < log_threshold):
                break
            # expand the most confident candidates of this depth (EAGLE-2), in one drafter pass
            frontier_score, best = torch.topk(score, min(K, score.shape[0]))
            logps = self.expand(tokens[-1][best], frontier_node[best // K])
            frontier_cand = num_cands + best
            frontier_node = torch.arange(num_nodes, num_nodes + best.shape[0], device=dev)
            num_cands += score.shape[0]
            num_nodes += best.shape[0]
        # the one host transfer of the proposal (float64 holds any token id and index exactly)
        score_l = token_l = parent_l = []
        if scores:               # no depth at all when the sequence is one token short of its length limit
            rows = torch.stack([torch.cat(scores).double(), torch.cat(tokens).double(), torch.cat(parents).double()])
            score_l, token_l, parent_l = rows.tolist()
        depth_l = [d + 1 for d, n in enumerate(depths) for _ in range(n)]
        # candidates under the threshold are never submitted; their descendants score no higher, so they go too
        keep = [i for i, lp in enumerate(score_l) if lp >= log_threshold]
        index = {i: j for j, i in enumerate(keep)}
        cands = [_Candidate(int(token_l[i]), index[int(parent_l[i])] if parent_l[i] >= 0 else -1, score_l[i],
                            depth_l[i]) for i in keep]
        tree = self._select(input_ids[0, -1].item(), cands, opts.budget)
        self.last_tree, self.last_pruned = tree, len(score_l) - len(keep)
        return tree

    @staticmethod
    def _select(root_token: int, cands: list[_Candidate], budget: int) -> DraftTree:
        """Global top-``budget`` by cumulative log-prob, kept prefix-closed; topological order (depth, best first)."""
        order = sorted(range(len(cands)), key=lambda i: (-cands[i].log_prob, cands[i].depth))
        keep: set[int] = set()
        for i in order:
            if len(keep) == budget:
                break
            if cands[i].parent < 0 or cands[i].parent in keep:
                keep.add(i)
        kept = sorted(keep, key=lambda i: (cands[i].depth, -cands[i].log_prob))
        index = {c: n + 1 for n, c in enumerate(kept)}
        tokens = [root_token] + [cands[i].token for i in kept]
        parents = [-1] + [index[cands[i].parent] if cands[i].parent >= 0 else 0 for i in kept]
        logps = [0.0] + [cands[i].log_prob for i in kept]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(logps))

    def observe(self, accepted_tokens: list[int]) -> None:
        """After verification: roll the drafter forward and adapt threshold and depth."""
        tree = self.last_tree
        self.finish(accepted_tokens)
        if self.options.adaptive and tree is not None and len(tree) > 1:
            self.calibration.update(tree.log_probs[1:].exp().sum().item(), len(accepted_tokens))
            full = len(accepted_tokens) >= max(self.depth - 1, 1)
            # HF's "heuristic" schedule, bounded by the configured depth
            self.depth = min(self.depth + 2, self.options.depth) if full else max(self.depth - 1, 2)

    # ---- transformers' CandidateGenerator interface (a chain of the best path) ----
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        tree = self.propose(input_ids)
        node, path = 0, []
        while tree.children[node]:
            node = tree.children[node][0]
            path.append(tree.tokens[node].item())
        return torch.cat([input_ids, torch.tensor([path], dtype=input_ids.dtype, device=input_ids.device)], 1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.observe(input_ids[0, input_ids.shape[1] - num_matches - 1: input_ids.shape[1] - 1].tolist())


def _log(p: float) -> float:
    return float("-inf") if p <= 0 else math.log(p)


class GDNDrafter(DynamicTreeDrafter):
    """A small GDN language model as drafter: its own SpecLACache, the draft tree verified afresh at every depth
    (``_score``), the deepest accepted node committed to roll forward."""

    def __init__(self, drafter_model, options: DraftOptions):
        from specla_hf.gdn import GDNRunner
        super().__init__(options)
        self.runner = GDNRunner.for_model(drafter_model, role="drafter")
        self.cache = self.runner.new_cache(1)
        self.consumed = 0                    # tokens of input_ids in the drafter's committed state
        # the drafter's tree: token and parent of each node, root first (on the drafter's device)
        self.tokens = self.parents = torch.empty(0, dtype=torch.long, device=self.runner.device)

    def start(self, input_ids: torch.LongTensor) -> torch.Tensor:
        dev = self.runner.device
        if self.consumed > input_ids.shape[1] - 1:
            raise RuntimeError("the drafter is ahead of the sequence: was one drafter shared by two generations?")
        if self.consumed < input_ids.shape[1] - 1:
            self.runner.forward(input_ids[:, self.consumed:-1].to(dev), self.cache)
            self.consumed = input_ids.shape[1] - 1
        self.tokens = input_ids[0, -1:].to(dev)
        self.parents = torch.full((1,), -1, dtype=torch.long, device=dev)
        return self._score(0)

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        first = self.tokens.shape[0]
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        return self._score(first)

    def _score(self, first: int) -> torch.Tensor:
        """Verify the whole tree from the committed state; log-probs of nodes ``first..``. A drafter's tree is small
        and one pass over it costs what a pass over its newest nodes does (the weights are read once either way),
        while extending the previous pass would need the pending nodes' factors as a prefix (a slow path)."""
        self.cache.discard()
        out = self.runner.forward(self.tokens[None], self.cache, parents=self.parents[None])
        return torch.log_softmax(out.logits[0, first:].float(), -1)

    def finish(self, accepted_tokens: list[int]) -> None:
        # commit the deepest drafter node on the accepted path; the rest is consumed at the next start()
        tokens, parents = torch.stack([self.tokens, self.parents]).tolist()
        path_of = {0: ()}
        node_of = {(): 0}
        for n in range(1, len(parents)):
            path_of[n] = path_of[parents[n]] + (tokens[n],)
            node_of[path_of[n]] = n
        node, depth = 0, 0
        for depth_ in range(1, len(accepted_tokens) + 1):
            key = tuple(accepted_tokens[:depth_])
            if key not in node_of:
                break
            node, depth = node_of[key], depth_
        self.cache.commit(node, path_length=1 + depth)
        self.consumed += 1 + depth
