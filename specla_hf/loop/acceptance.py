"""The acceptance rule, lossless for greedy decoding and for sampling: which path of a verified tree is kept.

``accept_path`` walks a tree on the host with the target's processed distributions (any logits processor, sampling);
``greedy_accept`` is the same rule for plain greedy decoding as device tensor ops (static shapes, no host
synchronisation: the device loop captures it in a CUDA graph). Tests check the two agree on random trees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessorList


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

    Greedy: follow the child equal to the target's argmax. Sampling: the children of a node are candidates chosen
    deterministically by the drafter, tried in order: accept ``x`` with probability ``p(x)``, otherwise set
    ``p(x) = 0`` and renormalise; if all fail, the bonus token is sampled from what is left of ``p``. This reproduces
    plain sampling from ``p`` exactly (a sequence of exact rejection steps). ``p`` is the target's distribution after
    the same logits processors plain decoding applies, evaluated on the node's own ``context``.
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
                nxt = None
                for c in kids:
                    if torch.rand(()) < p[tokens[c]]:
                        nxt = c
                        break
                    p[tokens[c]] = 0
                    p = p / p.sum()
                choice = tokens[nxt] if nxt is not None else int(torch.multinomial(p, 1))
        emitted.append(choice)
        if nxt is None:
            return Acceptance(path, emitted, scores)
        node = nxt
        path.append(node)
        if processed:
            ctx = torch.cat([ctx, ctx.new_tensor([[choice]])], 1)


@dataclass
class DeviceAcceptance:
    """``greedy_accept``'s result, on the device: what the commit, the drafter's catch-up and the host need."""
    node: torch.Tensor        # [1] the last accepted node
    length: torch.Tensor      # [1] nodes on its root path (the root included) = tokens emitted
    path: torch.Tensor        # [cap] those nodes, root first (padded with ``node``)
    emitted: torch.Tensor     # [cap] the accepted drafts, then the target's bonus token (padded with it)
    packed: torch.Tensor      # [1 + cap] length, then emitted: what the host reads back


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, argmax: torch.Tensor,
                  cap: int) -> DeviceAcceptance:
    """``accept_path`` for plain greedy decoding as device tensor ops.

    ``tokens``/``parents`` ``[N]`` (node 0 the root; parents -1 for it and for padding nodes, which are never
    accepted), ``ancestors [N, N]`` (row ``i``: ``i`` and its ancestors), ``argmax [N]`` the target's choice after
    each node; ``cap`` bounds the path length. A node matches when its token is its parent's argmax and no earlier
    sibling has that token (the host walk takes the first such child); it is accepted when every node on its root
    path matches; the deepest accepted node ends the path (one per depth: at most one child of a node matches).
    """
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    up = parents.clamp(min=0)
    earlier_twin = ((parents[None, :] == parents[:, None]) & (tokens[None, :] == tokens[:, None])
                    & (idx[None, :] < idx[:, None])).any(1)
    match = torch.where(parents >= 0, (tokens == argmax[up]) & ~earlier_twin, idx == 0)
    accepted = ~(ancestors & ~match[None, :]).any(1)
    depth = ancestors.sum(1)
    node = torch.where(accepted, depth, 0).argmax().view(1)
    length = depth.index_select(0, node)
    on_path = ancestors.index_select(0, node)[0]
    slot = torch.where(on_path, depth - 1, cap)                # a path node's position; the rest to a spare slot
    path = node.repeat(cap + 1).scatter(0, slot, idx)[:cap]
    after = torch.cat([path[1:], node])                         # the node each emitted draft token comes from
    emitted = torch.where(torch.arange(cap, device=idx.device) + 1 < length, tokens[after],
                          argmax.index_select(0, node))
    return DeviceAcceptance(node, length, path, emitted, torch.cat([length, emitted]))
