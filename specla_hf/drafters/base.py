"""Proposing drafts: token trees (a chain is a tree with one child per node) with confidence pruning.

A ``DraftTree`` always has the *pending* token as node 0: the last emitted token, which the target has not consumed
yet. Verifying the tree therefore yields the target's distribution after the pending token (node 0) and after every
draft node, and the bonus token of a step becomes the next step's root.

``DynamicTreeDrafter`` is the EAGLE-2-style expansion shared by every drafter: at each depth the ``topk`` most
confident frontier nodes (by cumulative draft probability) are expanded by one drafter pass, each gets its ``topk``
best children, and at the end the global top-``budget`` nodes are submitted; nodes whose cumulative probability is
under the (adaptive) confidence threshold are never submitted, and a depth whose best node falls under it ends the
drafting. Subclasses say how one drafter pass scores the tree built so far. Under sampling (``sample_drafts``) a
node's children are draws from the drafter's distribution instead, ranked for the submission by what their earlier
siblings left (``ops.draw_children``), as the acceptance's rejection sampling requires.

On the GPU drafting is host-bound unless the host stays out of the loop, so the tree lives in static device buffers
(``DraftBuffers``) and each depth is one idempotent step on them (score the tree, take each frontier node's top-k,
pick the next frontier, write its inputs) that is captured once as a CUDA graph and replayed; the candidates reach the
host once per proposal.

The root is not a guess: its inputs are final (the pending token, and for a target-aligned drafter the target's
feature of the position before it). So a drafter's ``start`` normally consumes it into the drafter's committed state
together with the positions it catches up on, in the same call, and returns its draft distribution: depth 1 then
needs no drafter pass of its own, and the root's children hang off the committed state (parent ``-1``) in the later
passes, where slot 0 stays an inert node nobody descends from.

What the decoding loop uses of a drafter (``specla_hf.loop.decode``): ``launch`` a proposal after a sequence,
``device_tree`` (the proposal selected on the device, to verify before the host reads it) or ``collect`` (the tree on
the host), ``add_features`` (target hidden states of committed positions, for ``feature_layers``), ``observe`` (how
many drafts were accepted); and for the device loop ``catch_up`` / ``launch_caught_up`` / ``advance``
(``catches_up_on_device``). A subclass provides ``start``, ``score`` and ``add_nodes`` (how one drafter pass scores the
tree built so far) and its ``_new_buffers`` when it keeps per-node inputs. transformers' ``CandidateGenerator``
contract (a flat list of candidate tokens, the target's cache cropped after rejection) cannot express a tree or a
recurrent target, so these drafters do not implement it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from transformers.generation.logits_process import LogitsProcessorList

from specla_hf.drafters.options import DraftOptions, default_threshold
from specla_hf.loop.acceptance import Warpers, kernel_warpers, processor_key
from specla_hf.models.graphed import tree_bucket
from specla_hf.runtime.transfer import HostCopy, copy_in
from specla_kernels import ops


@dataclass
class DraftTree:
    tokens: torch.Tensor          # [N] node 0 = pending token
    parents: torch.Tensor         # [N] parents[0] = -1, parents[i] < i
    log_probs: torch.Tensor       # [N] the selection's score: cumulative draft log-probability (0 at the root); for
                                  # sampled drafts, the parent's and the log of the mass its earlier siblings left
    # sampled drafts: the drafter's log-probs after each node over the target's vocabulary [N, vocab] (device), which
    # its children were drawn from, in order (rows of childless nodes unused); None for drafts chosen by log-prob
    draft_logq: torch.Tensor | None = None

    def __post_init__(self):
        self.children: list[list[int]] = [[] for _ in range(len(self.tokens))]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            self.children[p].append(i)  # nodes were added best-first, so siblings are in draft preference order

    def __len__(self) -> int:
        return self.tokens.shape[0]


class DraftBuffers:
    """A proposal's tree and candidates in static device tensors (see the module docstring).

    Nodes: 0 is the root; depth ``d``'s step expands ``topk`` nodes into slots ``1 + K(d-1) .. 1 + Kd``. Candidates:
    depth ``d``'s ``F x K`` children (``F`` = 1 at depth 1, else ``K``) in row ``d - 1``. Row ``d`` of the frontier
    arrays is written by depth ``d``'s step and read by the next, so a step can be re-run (warm-up, capture) safely.
    Drafters that keep more per node subclass it (``DynamicTreeDrafter._new_buffers``).
    """

    def __init__(self, topk: int, depth: int, device: torch.device):
        K = self.topk = topk
        self.capacity = tree_bucket(1 + K * depth)
        self.tokens = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.parents = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        # scores, tokens and parent indices in one float64 tensor (exact for any id), read back in one transfer
        self.cand = torch.stack([torch.full((depth, K * K), v, dtype=torch.float64, device=device)
                                 for v in (float("-inf"), 0.0, -1.0)])
        self.cand_score, self.cand_token, self.cand_parent = self.cand.unbind(0)
        # sampled drafts: each expanded node's draft log-probs by tree slot (``node_logq``, allocated on first use),
        # the slot each expanded candidate took, and the selected tree's nodes' slots
        self.node_logq: torch.Tensor | None = None
        self.slot_ids = torch.arange(self.capacity, device=device)
        self.cand_slot = torch.zeros(depth * K * K, dtype=torch.long, device=device)
        self.frontier_score = torch.zeros(depth + 1, K, device=device)      # cumulative log-prob per frontier node
        self.frontier_cand = torch.full((depth + 1, K), -1, dtype=torch.long, device=device)  # its candidate index
        # each depth's best candidate score, read back for early stopping
        self.best = [HostCopy((1,), torch.float64, device) for _ in range(depth)]
        # the selected tree (``select_tree``): tokens, parents, cumulative log-probs; long copies feed the verify pass,
        # the float64 rows are read back to the host in one transfer
        most = 1 + candidate_count(K, depth)                # the root and every candidate
        self.cand_depth = candidate_depths(K, depth).to(device)
        self.tree = torch.zeros(3, most, dtype=torch.float64, device=device)
        self.tree_tokens = torch.zeros(most, dtype=torch.long, device=device)
        self.tree_parents = torch.full((most,), -1, dtype=torch.long, device=device)
        self.tree_slots = torch.zeros(most, dtype=torch.long, device=device)
        self.tree_host = HostCopy((3, most), torch.float64, device)
        self.verified = torch.zeros_like(self.tree)  # the device loop's copy of the tree its last step verified
        self.root_logp: torch.Tensor | None = None    # the root's draft log-probs when ``start`` consumed it
        # ``catch_up``'s chain (parents), as long as the longest accepted path (static: step graphs read it)
        self.chain = torch.arange(-1, depth, device=device)[None]
        self.chain_path = self.chain + 1                 # its nodes, root first (the commit reads them)

    def queue_best(self, d: int) -> None:
        """Start reading depth ``d``'s best candidate score back to the host (``read_best``)."""
        self.best[d - 1].queue(self.cand_score[d - 1].max().view(1))

    def read_best(self, d: int) -> float:
        """Depth ``d``'s best candidate score; waits for depth ``d`` only, not for work queued after it."""
        return float(self.best[d - 1].read())

    def reset(self) -> None:
        """Padding slots must stay inert (children of the committed state) whatever an earlier proposal wrote."""
        self.parents.fill_(-1)

    def candidates(self, depths: int) -> torch.Tensor:
        """Every candidate of depths ``1..depths``, numbered depth by depth: rows score, token, parent index."""
        K = self.topk
        return torch.cat([self.cand[:, 0, :K], self.cand[:, 1:depths].flatten(1)], 1)

    def node_logq_rows(self, vocab: int) -> torch.Tensor:
        """The static ``[capacity, vocab]`` log-probs of each expanded node's draws, by tree slot (sampled drafts)."""
        if self.node_logq is None or self.node_logq.shape[1] != vocab:
            self.node_logq = torch.full((self.capacity, vocab), float("-inf"), device=self.tokens.device)
        return self.node_logq

    def select_tree(self, depths: int, budget: int) -> None:
        """``select_tree_rows`` of every candidate of depths ``1..depths`` (no threshold) into ``tree``, on the device,
        in static shapes and without host synchronisation (it is captured as a CUDA graph); root = ``tokens[0]``."""
        K = self.topk
        n = min(budget, candidate_count(K, depths))
        score, token, parent = self.candidates(depths).unbind(0)
        self.tree[0, :1] = self.tokens[:1]
        # fill_, not item assignment: assigning a Python number copies a host scalar tensor, which a capture refuses
        self.tree[1, :1].fill_(-1)
        self.tree[2, :1].fill_(0)
        chosen = select_tree_rows(score, token, parent, self.cand_depth[:score.shape[0]], n, self.tree)
        self.tree_tokens[:n + 1] = self.tree[0, :n + 1]
        self.tree_parents[:n + 1] = self.tree[1, :n + 1]
        self.tree_slots[1:n + 1] = self.cand_slot[chosen]       # read for sampled drafts only

    def queue_tree(self) -> None:
        """Start reading the selected tree back to the host (``read_tree``)."""
        self.tree_host.queue(self.tree)

    def read_tree(self, n: int) -> DraftTree:
        """The selected tree of ``n`` nodes; waits for the selection only, not for work queued after it."""
        return _tree_of_rows(self.tree_host.read()[:, :n])

    def keep_verified(self) -> None:
        """Copy the selected tree aside once it is verified (the next proposal overwrites it): static, capturable."""
        self.verified.copy_(self.tree)

    def verified_tree(self, n: int) -> DraftTree:
        """The tree of ``n`` nodes last kept by ``keep_verified`` (waits for the device)."""
        return _tree_of_rows(self.verified[:, :n].cpu())


def candidate_count(topk: int, depths: int) -> int:
    """Candidates of depths ``1..depths``: the root's ``topk`` children, then ``topk`` x ``topk`` a depth (``topk``
    nodes expanded); no tree of that depth holds more nodes."""
    return topk + (depths - 1) * topk * topk


def candidate_depths(topk: int, depth: int) -> torch.Tensor:
    """The draft depth of each candidate in ``DraftBuffers.candidates`` order (float64, as the candidate rows)."""
    return torch.tensor([1] * topk + [d for d in range(2, depth + 1) for _ in range(topk * topk)], dtype=torch.float64)


def select_tree_rows(score: torch.Tensor, token: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, n: int,
                     out: torch.Tensor) -> torch.Tensor:
    """The draft tree to verify: the ``n`` best candidates by cumulative log-prob (ties: the earlier candidate, i.e.
    the shallower), in topological order (by depth, best first), parents renumbered to tree nodes; written to
    ``out[:, 1:n + 1]`` (rows: tokens, parents, cumulative log-probs; column 0 is the root's). Candidates are numbered
    depth by depth and ``parent`` indexes them (-1: a child of the root). A parent always ranks above its children
    (they score no higher and come later), so the selection is prefix-closed without a check. The one selection rule,
    run on the device (no threshold) and on the host (a threshold, its pruned candidates scored -inf). Returns the
    chosen candidates, in tree order."""
    C = score.shape[0]
    chosen = torch.sort(score, descending=True, stable=True).indices[:n]
    chosen = chosen[torch.sort(depth[chosen], stable=True).indices]
    node = torch.zeros(C, dtype=torch.long, device=score.device)
    node[chosen] = torch.arange(1, n + 1, device=score.device)
    up = parent[chosen].long()
    out[0, 1:n + 1] = token[chosen]
    out[1, 1:n + 1] = torch.where(up >= 0, node[up.clamp(min=0)], 0)
    out[2, 1:n + 1] = score[chosen]
    return chosen


def _tree_of_rows(rows: torch.Tensor) -> DraftTree:
    """A ``DraftTree`` of the host rows ``[3, n]`` (tokens, parents, cumulative log-probs) the selection writes."""
    tokens, parents, log_probs = rows
    return DraftTree(tokens.long(), parents.long(), log_probs.clone())


class Launched(NamedTuple):
    """What ``collect`` and the loop need of the launched proposal."""
    root: torch.Tensor | int          # the root's token (host or device)
    depths: int                       # depths drafted
    budget: int                       # its tree's budget
    log_threshold: float              # the confidence threshold's log (-inf: none)
    selected: int | None              # nodes of the tree selected on the device (None: ``collect`` selects)


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


class DynamicTreeDrafter:
    """EAGLE-2-style dynamic tree drafting with confidence pruning (see module docstring)."""

    # target layers whose hidden states the drafter reads (0 = embeddings, i = after block i); empty for drafters
    # that only see tokens
    feature_layers: tuple[int, ...] = ()
    # whether the drafter implements ``catch_up`` and ``advance``: the device loop then runs whenever its tree is
    # selected on the device (``device_tree``, no confidence threshold)
    catches_up_on_device: bool = False
    # the token ids the drafter's log-probs are over, on the device (``MTPDrafter.restrict_vocabulary``), and the
    # target's vocabulary size they are part of; None: all
    draft_vocab: torch.Tensor | None = None
    vocab_size: int | None = None
    # whether ``_depth_step`` can draw children from the drafter's distribution, and the processors it draws under
    # (``sample_drafts``; None: top-k children)
    samples_drafts: bool = True
    # the drafter's calibrated ratio of its drawing temperature to the target's (a drafter's laws can be sharper or
    # flatter than the target's; ``DraftOptions.temperature_ratio`` overrides it)
    temperature_ratio: float = 1.0
    draft_sampling: LogitsProcessorList | None = None
    _warpers: Warpers | None = None                     # ``kernel_warpers`` of ``draft_sampling``, at ``_ratio``
    _ratio: float = 1.0                                 # the temperature ratio the drafts are drawn at
    _sampling_key: tuple | None = None

    def __init__(self, options: DraftOptions):
        self.options = options
        self.calibration = AcceptanceCalibration()
        # the next proposal's depth and budget (``loop.shapes.ShapePolicy`` sets them when ``options.adaptive``)
        self.depth, self.budget = options.depth, options.budget
        self.last_tree: DraftTree | None = None
        self.last_pruned = 0   # candidate nodes dropped by the threshold in the last proposal
        self.buffers: DraftBuffers | None = None

    # ---- what a subclass provides ----
    runner = None            # the drafter's adapter: its ``graphs`` say whether to use CUDA graphs
    cache = None             # its SpecLACache
    consumed = 0             # sequence positions in its committed state

    def start(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        """Catch the drafter's committed state up on ``input_ids``. Normally the pending token (``input_ids``' last,
        the root) is consumed too and its draft log-probs ``[vocab]`` (fp32) are returned (module docstring), after
        writing into ``self.buffers`` whatever ``add_nodes`` reads of the root for its children (e.g. its output
        hidden state). ``None``: the root stays out of the committed state; its inputs go to slot 0 and depth 1
        scores it (its token is written by ``launch``)."""
        raise NotImplementedError

    def score(self, n: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the drafter over tree slots ``0..n`` from its committed state (inputs in ``self.buffers``); draft
        log-probs ``[len(rows), vocab]`` of the slots ``rows`` (the LM head runs on those only; a drafter may give
        its logits where its drafts are drawn under warpers in the kernels, ``_warpers``, which normalise the rows
        themselves), and the pass's per-slot outputs that ``add_nodes`` hands on to new nodes (``None``: the drafter
        hands on none). Runs inside a CUDA-graph capture: no host synchronisation, no state kept."""
        raise NotImplementedError

    def add_nodes(self, first: int, parents: torch.Tensor, outputs: torch.Tensor | None) -> None:
        """Write the inputs, other than tokens and parents, of the new nodes ``first..first+len(parents)``;
        ``outputs``: what this depth's ``score`` returned beside the log-probs, ``None`` at a depth that scored
        nothing (the root's children, once ``start`` consumed the root)."""

    def add_features(self, features: tuple[torch.Tensor, ...], positions: list[int] | None = None) -> None:
        """Target hidden states (one ``[1, T, hidden]`` per feature layer) of the positions the target just
        committed, in order: all ``T`` (prefill), or the nodes ``positions`` of a verify pass (the accepted path).
        Only target-aligned drafters (``feature_layers`` set) use them."""

    def reserve(self, max_length: int) -> None:
        """Before a generation of up to ``max_length`` positions (the loop calls this before anything else): a drafter
        with a cache takes a fresh one from its runner with room for them (a graphed attention cache has a fixed
        capacity, which the runner can only size once the length is known)."""
        if self.cache is not None:
            self.cache = self.runner.new_cache(1, max_length)

    def _new_buffers(self) -> DraftBuffers:
        """This drafter's static tree buffers (a subclass that keeps more per node returns its own kind)."""
        return DraftBuffers(self.options.topk, self.options.depth, self.runner.device)

    def sample_drafts(self, processors: LogitsProcessorList | None) -> None:
        """Before a generation: with ``processors`` (row-wise logits processors, the target's), each expanded node's
        children are drawn without replacement from the drafter's distribution under them (Gumbel top-k; its scores
        divided by the temperature ratio first, ``DraftOptions.temperature_ratio``), and the
        tree carries those distributions (``DraftTree.draft_logq``), so that the acceptance takes a child with
        probability ``min(1, p / q)`` and rejects into the residual (recursive rejection sampling,
        ``loop.acceptance``): a drafter close to the target is then accepted nearly always, where the children of
        highest draft log-prob are accepted with the target's probability of each. ``None`` (greedy decoding, or a
        drafter that cannot, ``samples_drafts``): the ``topk`` children of highest draft log-prob."""
        self.draft_sampling = processors if self.samples_drafts else None
        ratio = self.options.temperature_ratio
        self._ratio = self.temperature_ratio if ratio is None else float(ratio)
        # temperature, top-k and top-p alone: warped inside ``ops.draw_children`` (others run in torch first)
        warpers = None if self.draft_sampling is None else kernel_warpers(self.draft_sampling, self.options.topk)
        self._warpers = None if warpers is None else warpers._replace(temperature=warpers.temperature * self._ratio)
        self._sampling_key = (None if self.draft_sampling is None
                              else (processor_key(self.draft_sampling), self._warpers is not None, self._ratio))

    # ---- the expansion ----
    @property
    def threshold(self) -> float:
        base = self.options.threshold
        if base is None:
            base = default_threshold(self.runner.device.type)
        return min(base / self.calibration.ratio, 0.99) if self.options.adaptive else base

    def _buffers(self) -> DraftBuffers:
        """This drafter's buffers; with CUDA graphs, the runner's (the step graphs are bound to them), shared by every
        generate() call of the same tree shape."""
        if self.buffers is None:
            graphs = self.runner.graphs
            key = ("draft buffers", type(self).__name__, self.options.topk, self.options.depth)
            self.buffers = self._new_buffers() if graphs is None else graphs.static(key, self._new_buffers)
        return self.buffers

    def _depth_step(self, d: int, root_consumed: bool) -> None:
        """Depth ``d`` of a proposal on ``self.buffers`` (idempotent, static shapes; see ``DraftBuffers``)."""
        b, K = self.buffers, self.options.topk
        n, F = 1 + K * (d - 1), (1 if d == 1 else K)             # nodes so far; the newest F are the frontier
        graphs = self.runner.graphs is not None
        if d == 1 and root_consumed:
            logp, outputs = b.root_logp[None], None               # from ``start``
        else:
            logp, outputs = self.score(tree_bucket(n) if graphs else n, slice(n - F, n))  # the frontier's log-probs
        top_logp, top_rank, top_token = self._children(logp, n - F, K)
        if self.draft_vocab is not None:                          # indices into the draft vocabulary: token ids
            top_token = self.draft_vocab[top_token]
        # record the F x K candidates, expand the K most confident (EAGLE-2): the next depth's frontier
        ops.expand_frontier(top_logp, top_rank, top_token, b.frontier_score[d - 1, :F], b.frontier_cand[d - 1, :F],
                            b.cand[:, d - 1], b.tokens, b.parents, b.frontier_score[d], b.frontier_cand[d], n,
                            0 if d == 1 else candidate_count(K, d - 1))
        if self.draft_sampling is not None:       # where the next frontier's draws will be kept
            b.cand_slot.index_copy_(0, b.frontier_cand[d], b.slot_ids[n:n + K])
        self.add_nodes(n, b.parents[n:n + K], outputs)
        if d == 1 and root_consumed:
            b.parents[1:1 + K].fill_(-1)      # the root is in the committed state: its children hang off that

    def _children(self, logp: torch.Tensor, first: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Children of the frontier nodes in slots ``first..`` from their draft log-probs ``logp [F, vocab]`` (or
        logits, under ``_warpers``: ``score``):
        log-probs, selection ranks and tokens ``[F, k]``: the ``k`` of highest log-prob, or ``k`` draws without
        replacement under ``draft_sampling`` (``sample_drafts``), their distributions kept by slot."""
        if self.draft_sampling is None:
            top_logp, top_token = ops.row_topk(logp, k)
            return top_logp, top_logp, top_token
        rows = self.buffers.node_logq_rows(logp.shape[-1])[first:first + logp.shape[0]]
        if self._warpers is not None:
            temperature, top_k, top_p = self._warpers
            return ops.draw_children(logp, k, temperature, top_k, rows, top_p)
        no_context = torch.empty(logp.shape[0], 0, dtype=torch.long, device=logp.device)
        return ops.draw_children(self.draft_sampling(no_context, logp.float() / self._ratio), k, 1.0, 0, rows)

    def tree_draft_logq(self, slots: torch.Tensor) -> torch.Tensor:
        """The draft log-probs after the tree nodes in ``slots`` (their expanded slots) over the target's vocabulary
        (static shapes: the device loop captures it)."""
        rows = self.buffers.node_logq.index_select(0, slots)
        if self.draft_vocab is None:
            return rows
        full = rows.new_full((rows.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_vocab] = rows
        return full

    def _run(self, key: tuple, step, what: str) -> None:
        """``step()`` (idempotent, static shapes) as a CUDA-graph replay where the drafter runs graphs (captured on
        first use, per buffers and ``key``), else eagerly."""
        if self.runner.graphs is None:
            step()
        else:          # an interrupted capture may leave nodes pending: ``discard`` is its undo
            self.runner.graphs.call((id(self.buffers), *key, self._sampling_key), step, what,
                                    between=self.cache.discard)

    def propose(self, input_ids: torch.LongTensor, max_depth: int | None = None) -> DraftTree:
        """Draft a tree after ``input_ids`` (``launch`` then ``collect``)."""
        self.launch(input_ids, max_depth)
        return self.collect()

    @torch.no_grad()
    def launch(self, input_ids: torch.LongTensor, max_depth: int | None = None) -> None:
        """Start a proposal: ``start``, then one ``_depth_step`` per depth, queued on the device without host round
        trips, so the host is free until ``collect``. Without a confidence threshold the tree is selected on the
        device as well (``DraftBuffers.select_tree``): ``device_tree`` can then feed the verify pass before the host
        has read the draft. With a threshold drafting stops once no candidate of a depth clears it: each depth's best
        score is read back one depth late (the host waits for depth ``d - 1`` while depth ``d`` runs), and the extra
        depth costs nothing in the tree: its candidates score no higher than their parents, so ``collect`` prunes
        them all."""
        b = self._buffers()
        b.reset()
        copy_in(b.tokens[:1], input_ids[0, -1:])
        root_logp = self.start(input_ids)
        if root_logp is not None:
            self._root_logp(root_logp.shape[-1]).copy_(root_logp)
        self._expand(root_logp is not None, max_depth, input_ids[0, -1:])

    # ---- proposals the host does not wait for (the device loop) ----
    def catch_up(self, features: tuple[torch.Tensor, ...], accepted) -> None:
        """``add_features`` and ``start`` after a step whose accepted path (``loop.acceptance.DeviceAcceptance``) is
        known only on the device, in static shapes and without host synchronisation (the device loop captures it in
        a CUDA graph with the step's acceptance); ``launch_caught_up`` then drafts from the new root."""
        raise NotImplementedError

    def launch_caught_up(self, max_depth: int | None = None) -> None:
        """``launch``'s depths and selection after ``catch_up``, no deeper than ``max_depth``."""
        self._expand(True, max_depth, self.buffers.tokens[:1])

    def advance(self, n: int) -> None:
        """The host learns that the step of the last ``catch_up`` emitted ``n`` tokens: that many positions more are
        in the drafter's committed state."""
        self.consumed += n

    def _root_from(self, accepted, last: torch.Tensor, logp: torch.Tensor) -> None:
        """``catch_up``'s end: commit the accepted path's ``last`` node of the chain just verified (``advance`` counts
        the positions), whose draft log-probs ``logp`` are the next root's, and make its token (the bonus) the root."""
        self.cache.commit(last, path=(self.buffers.chain_path, accepted.length))
        self._root_logp(logp.shape[-1]).copy_(logp)
        self.buffers.tokens[:1].copy_(accepted.emitted.index_select(0, last))

    def _root_logp(self, vocab: int) -> torch.Tensor:
        """The static tensor the depth-1 graph reads the root's draft log-probs from."""
        b = self.buffers
        if b.root_logp is None:
            b.root_logp = torch.empty(vocab, dtype=torch.float32, device=b.tokens.device)
        return b.root_logp

    def _expand(self, root_consumed: bool, max_depth: int | None, root: torch.Tensor) -> None:
        """The depths of the launched proposal (see ``launch``), then its selection on the device when there is no
        threshold; ``root``: the root's token (host or device), which ``collect`` reads for the host selection."""
        b = self.buffers
        threshold = self.threshold
        log_threshold = _log(threshold)
        depth_limit = self.depth if max_depth is None else max(0, min(self.depth, max_depth))
        depths = 0
        for d in range(1, depth_limit + 1):
            self._run(("depth", d, root_consumed), lambda d=d: self._depth_step(d, root_consumed),
                      f"draft depth {d}")
            depths = d
            if threshold > 0:
                if d > 1 and b.read_best(d - 1) < log_threshold:
                    break
                b.queue_best(d)
        selected, budget = None, self.budget
        if threshold <= 0 and depths:
            K = self.options.topk
            self._run(("select", depths, budget), lambda: b.select_tree(depths, budget), "the tree selection")
            b.queue_tree()
            selected = 1 + min(budget, candidate_count(K, depths))
        self._launched = Launched(root, depths, budget, log_threshold, selected)

    @property
    def launched_depths(self) -> int:
        """Depths the launched proposal drafted."""
        return self._launched.depths

    def device_tree(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The launched proposal's tree as device tensors ``(tokens [1, N], parents [1, N])`` when it was selected on
        the device (no threshold), else ``None``: the verify pass can be queued before ``collect`` reads it back."""
        selected = self._launched.selected
        if selected is None:
            return None
        return self.buffers.tree_tokens[None, :selected], self.buffers.tree_parents[None, :selected]

    def collect(self) -> DraftTree:
        """The launched proposal's tree: read back as selected on the device, or one host transfer of every depth's
        candidates, then the same selection on the host with the candidates under the threshold pruned (their
        descendants score no higher, so they go too)."""
        root, depths, budget, log_threshold, selected = self._launched
        sampled = self.draft_sampling is not None and depths > 0
        if selected is not None:
            tree = self.buffers.read_tree(selected)
            if sampled:
                tree.draft_logq = self.tree_draft_logq(self.buffers.tree_slots[:selected])
            self.last_tree, self.last_pruned = tree, 0
            return tree
        rows = torch.tensor([[float(int(root))], [-1.0], [0.0]], dtype=torch.float64)
        pruned = 0
        if depths:               # no depth at all when the sequence is one token short of its length limit
            score, token, parent = self.buffers.candidates(depths).cpu()
            keep = score >= log_threshold
            n, pruned = min(budget, int(keep.sum())), int((~keep).sum())
            rows = torch.cat([rows, rows.new_empty(3, n)], 1)
            chosen = select_tree_rows(score.masked_fill(~keep, float("-inf")), token, parent,
                                      candidate_depths(self.options.topk, depths), n, rows)
        tree = _tree_of_rows(rows)
        if sampled:
            slots = self.buffers.cand_slot[chosen.to(self.buffers.cand_slot.device)]
            tree.draft_logq = self.tree_draft_logq(torch.cat([slots.new_zeros(1), slots]))    # the root: slot 0
        self.last_tree, self.last_pruned = tree, pruned
        return tree

    def observe(self, accepted_tokens: list[int]) -> None:
        """After verification: recalibrate the confidence threshold to how many drafts were accepted. (Drafters keep
        nothing pending between steps: the next ``start`` consumes the accepted tokens.)"""
        tree = self.last_tree
        if self.options.adaptive and tree is not None and len(tree) > 1:
            self.calibration.update(tree.log_probs[1:].exp().sum().item(), len(accepted_tokens))


def _log(p: float) -> float:
    return float("-inf") if p <= 0 else math.log(p)
