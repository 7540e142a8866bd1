"""The acceptance rule, lossless for greedy decoding and for sampling: which path of a verified tree is kept.

``accept_path`` walks a tree on the host with the target's processed distributions (any logits processor, sampling);
``greedy_accept`` (plain greedy decoding) and ``sample_accept`` (sampling under logits processors that treat each
row alone, ``row_wise``) are the same rule as device tensor ops (static shapes, no host synchronisation: the device
loop captures them in a CUDA graph). Under sampling, drafts drawn from the drafter (the default,
``DynamicTreeDrafter.sample_drafts``) go through recursive rejection sampling, drafts of highest log-prob through its
case of a drafter certain of each. Tests check that greedy walks agree on random trees and that sampled outputs
follow the target's law.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

# processors whose output row depends on that row of scores alone, not on the sequence: a tree's rows (each node with
# its own context) are processed together, on the device. Exact classes: a subclass may read the sequence.
ROW_WISE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def row_wise(logits_processor: LogitsProcessorList) -> bool:
    """Whether every processor of ``logits_processor`` treats each row of scores alone (``ROW_WISE_PROCESSORS``)."""
    return all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor)


def row_wise_probs(logits_processor: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """Each row of ``logits [R, V]`` processed alone by row-wise processors (``row_wise``: they read no sequence, so an
    empty one stands for every row's), in fp32, as a distribution: what plain sampling draws from."""
    empty = torch.empty(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    return logits_processor(empty, logits.float()).softmax(-1)


def processor_key(logits_processor: LogitsProcessorList) -> tuple:
    """What the processors compute: each one's class and scalar settings (temperature, top-k, top-p, penalties)."""
    return tuple((type(p).__name__, *sorted((k, v) for k, v in vars(p).items()
                                            if isinstance(v, (bool, int, float, str))))
                 for p in logits_processor)


@dataclass
class Acceptance:
    """A host walk's result."""
    path: list[int]                 # the accepted root-to-node path, root first (the nodes whose outputs are kept)
    emitted: list[int]              # the accepted draft tokens, then the target's own (bonus) token
    scores: list[torch.Tensor]      # the processed scores that chose each emitted token (empty: not asked for)

    @property
    def node(self) -> int:
        return self.path[-1]


def accept_path(tree, logits: torch.Tensor | None, context: torch.LongTensor | None,
                logits_processor: LogitsProcessorList, do_sample: bool, argmax: list[int] | None = None) -> Acceptance:
    """Walk ``tree`` (a ``DraftTree``) from the root with the target's distributions after each node.

    Greedy: follow the child equal to the target's argmax. Sampling: a node's children are tried in order. Drafts
    chosen by the drafter's ranking (``tree.draft_logq`` None): accept ``x`` with probability ``p(x)``, otherwise set
    ``p(x) = 0`` and renormalise. Sampled drafts (drawn without replacement from ``q``, the drafter's distribution
    after the node, ``tree.draft_logq``): accept ``x`` with probability ``min(1, p(x) / q(x))``, otherwise continue
    with the residual ``p = norm(max(p - q, 0))`` and ``q`` without ``x``, renormalised (recursive rejection
    sampling; drafts chosen by rank are its case of a ``q`` that is certain of each). If all fail, the bonus token is
    sampled from what is left of ``p``. Each is an exact rejection step, so this reproduces plain sampling from
    ``p``. ``p`` is the target's distribution after the same logits processors plain decoding applies, evaluated on
    the node's own ``context``.
    ``argmax``: every node's argmax, given for plain greedy decoding (no logits processors), which then reads
    ``logits`` only to return them as scores (``None``: no scores).
    """
    node, path, emitted, scores = 0, [0], [], []
    tokens = tree.tokens.tolist()
    ctx = context
    processed = len(logits_processor) > 0
    while True:
        kids = tree.children[node]
        if argmax is not None:
            choice = argmax[node]
            if logits is not None:
                scores.append(logits[node:node + 1])
            nxt = next((c for c in kids if tokens[c] == choice), None)
        else:
            score = logits[node:node + 1]
            if processed:
                score = logits_processor(ctx, score.clone())
            scores.append(score)
            if not do_sample:
                choice = int(score.argmax(-1))
                nxt = next((c for c in kids if tokens[c] == choice), None)
            else:
                p = torch.softmax(score[0], -1)
                q = None if tree.draft_logq is None or not kids else tree.draft_logq[node].to(p.device).exp()
                nxt = None
                for c in kids:
                    x = tokens[c]
                    qx = 1.0 if q is None else q[x]          # a top-k draft: a q certain of it
                    if qx > 0 and torch.rand(()) * qx < p[x]:
                        nxt = c
                        break
                    if q is None:
                        p[x] = 0
                        p = p / p.sum()
                    else:
                        p, q = _residual(p, q), _without(q, x)
                choice = tokens[nxt] if nxt is not None else int(torch.multinomial(p, 1))
        emitted.append(choice)
        if nxt is None:
            return Acceptance(path, emitted, scores)
        node = nxt
        path.append(node)
        if processed:
            ctx = torch.cat([ctx, ctx.new_tensor([[choice]])], 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draw from ``q`` leaves of ``p`` (last dim): ``norm(max(p - q, 0))``; ``p`` itself where
    nothing is left (``p == q`` up to rounding, where a rejection has no chance but rounding's)."""
    rest = (p - q).clamp(min=0)
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def _without(q: torch.Tensor, x: torch.Tensor | int) -> torch.Tensor:
    """``q`` (last dim) with the drawn token ``x`` removed, renormalised: the law of the next draw without
    replacement (all zero once nothing is left: no further child can be accepted)."""
    q = q.clone()
    if isinstance(x, int):
        q[x] = 0
    else:
        q.scatter_(-1, x[:, None], 0)
    return q / q.sum(-1, keepdim=True).clamp(min=torch.finfo(q.dtype).tiny)


@dataclass
class DeviceAcceptance:
    """``greedy_accept``'s result, on the device: what the commit, the drafter's catch-up and the host need."""
    node: torch.Tensor        # [1] the last accepted node
    length: torch.Tensor      # [1] nodes on its root path (the root included) = tokens emitted
    path: torch.Tensor        # [cap] those nodes, root first (padded with ``node``)
    emitted: torch.Tensor     # [cap] the accepted drafts, then the target's bonus token (padded with it)
    packed: torch.Tensor      # [1 + 2 cap] length, emitted, path: what the host reads back


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, argmax: torch.Tensor,
                  cap: int) -> DeviceAcceptance:
    """``accept_path`` for plain greedy decoding as device tensor ops.

    ``tokens``/``parents`` ``[N]`` (node 0 the root; parents -1 for it and for padding nodes, which are never
    accepted), ``ancestors [N, N]`` (row ``i``: ``i`` and its ancestors), ``argmax [N]`` the target's choice after
    each node; ``cap`` bounds the path length. A node matches when its token is its parent's argmax and no earlier
    sibling has that token (the host walk takes the first such child); it is accepted when every node on its root
    path matches; the deepest accepted node ends the path (one per depth: at most one child of a node matches).
    """
    idx = torch.arange(tokens.shape[0], device=tokens.device)
    up = parents.clamp(min=0)
    match = torch.where(parents >= 0, (tokens == argmax[up]) & ~_earlier_twin(tokens, parents), idx == 0)
    return _walk(tokens, ancestors, match, lambda node: argmax.index_select(0, node), cap)


def sample_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, probs: torch.Tensor,
                  cap: int, draft_probs: torch.Tensor | None = None, siblings: int = 1) -> DeviceAcceptance:
    """``accept_path``'s sampling rule as device tensor ops: ``probs [N, vocab]`` is the target's processed
    distribution after each node (the rest as ``greedy_accept``); ``draft_probs [N, vocab]``, for sampled drafts,
    the drafter's distribution after each node, which its children (at most ``siblings``) were drawn from.

    The host tries a node's children in order, accepting child ``c`` with probability ``p(c)`` renormalised over what
    its earlier siblings' rejections left, and samples the bonus from what all of them left. Here every node draws
    its uniform up front (the host draws one per child it reaches: the same law), hits with that chance (zero for a
    token an earlier sibling already tried), and matches when it hits and no earlier sibling hit; the bonus is an
    exponential race over the last node's distribution with its children's tokens removed. Sampled drafts go
    through ``_sample_accept_drawn``."""
    if draft_probs is not None:
        return _sample_accept_drawn(tokens, parents, ancestors, probs, draft_probs, cap, siblings)
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    p = probs[parents.clamp(min=0), tokens]                      # each node's chance under its parent's law
    earlier = (parents[None, :] == parents[:, None]) & (idx[None, :] < idx[:, None])   # [i, s]: s tried before i
    twin = _earlier_twin(tokens, parents)
    tried = (earlier & ~twin[None, :]).to(p.dtype) @ p            # mass the earlier siblings' rejections removed
    chance = torch.where(twin, 0.0, p / (1 - tried).clamp(min=torch.finfo(p.dtype).tiny))
    hit = torch.rand(N, device=tokens.device) < chance
    match = torch.where(parents >= 0, hit & ~(earlier & hit[None, :]).any(1), idx == 0)

    def bonus(node: torch.Tensor) -> torch.Tensor:
        rest = probs.index_select(0, node)[0]
        children = (parents == node).to(rest.dtype)
        rest = rest * (torch.zeros_like(rest).scatter_add(0, tokens, children) == 0)
        return (rest / torch.empty_like(rest).exponential_()).argmax().view(1)
    return _walk(tokens, ancestors, match, bonus, cap)


def _sample_accept_drawn(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, probs: torch.Tensor,
                         draft_probs: torch.Tensor, cap: int, siblings: int) -> DeviceAcceptance:
    """``sample_accept`` for children drawn from ``draft_probs``: the host's recursive rejection sampling, every node
    at once, one sibling rank at a time. Each parent holds its residual ``p`` and its ``q`` without the draws tried so
    far; the child of rank ``r`` hits with chance ``min(1, p(x) / q(x))`` of its parent's rows after ranks ``< r``,
    and matches when it hits and no earlier sibling hit; the bonus is an exponential race over the last node's
    residual after all its children."""
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    earlier = (parents[None, :] == parents[:, None]) & (idx[None, :] < idx[:, None])
    rank = earlier.sum(1)
    # child_of[u, r]: node u's child of rank r, or N (none); a padding column takes what does not belong
    child_of = torch.full((N + 1, siblings + 1), N, dtype=torch.long, device=tokens.device)
    drafted = (parents >= 0) & (rank < siblings)
    child_of[torch.where(drafted, parents, N), torch.where(drafted, rank, siblings)] = idx
    child_of = child_of[:N, :siblings]
    p, q = probs.float(), draft_probs.float()
    u = torch.rand(N, device=tokens.device)
    hit = torch.zeros(N + 1, dtype=torch.bool, device=tokens.device)
    for r in range(siblings):
        child = child_of[:, r]
        has = child < N
        x = tokens[child.clamp(max=N - 1)][:, None]
        px, qx = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
        hit[child] = has & (qx > 0) & (u[child.clamp(max=N - 1)] * qx < px)
        p = torch.where(has[:, None], _residual(p, q), p)
        q = torch.where(has[:, None], _without(q, x[:, 0]), q)
    hit = hit[:N]
    match = torch.where(parents >= 0, hit & ~(earlier & hit[None, :]).any(1), idx == 0)

    def bonus(node: torch.Tensor) -> torch.Tensor:
        rest = p.index_select(0, node)[0]
        return (rest / torch.empty_like(rest).exponential_()).argmax().view(1)
    return _walk(tokens, ancestors, match, bonus, cap)


def _earlier_twin(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``[N]``: whether an earlier sibling holds the same token (the host walk never reaches such a node)."""
    idx = torch.arange(tokens.shape[0], device=tokens.device)
    return ((parents[None, :] == parents[:, None]) & (tokens[None, :] == tokens[:, None])
            & (idx[None, :] < idx[:, None])).any(1)


def _walk(tokens: torch.Tensor, ancestors: torch.Tensor, match: torch.Tensor, bonus, cap: int) -> DeviceAcceptance:
    """The accepted path of nodes whose whole root path matches, ending at the deepest one, and the emitted tokens:
    its drafts, then ``bonus(node)`` (the target's own token after the last node ``node [1]``)."""
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    accepted = ~(ancestors & ~match[None, :]).any(1)
    depth = ancestors.sum(1)
    node = torch.where(accepted, depth, 0).argmax().view(1)
    length = depth.index_select(0, node)
    on_path = ancestors.index_select(0, node)[0]
    slot = torch.where(on_path, depth - 1, cap)                # a path node's position; the rest to a spare slot
    path = node.repeat(cap + 1).scatter(0, slot, idx)[:cap]
    after = torch.cat([path[1:], node])                         # the node each emitted draft token comes from
    emitted = torch.where(torch.arange(cap, device=idx.device) + 1 < length, tokens[after], bonus(node))
    return DeviceAcceptance(node, length, path, emitted, torch.cat([length, emitted, path]))
