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
from typing import NamedTuple

import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specla_kernels import ops, tuning
from specla_kernels.reference import earlier_siblings, earlier_twin, rejection_residual, without_draw

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


class Warpers(NamedTuple):
    """Transformers' temperature, top-k and top-p warpers as the kernels take them (``top_k`` 0, ``top_p`` 1: none)."""
    temperature: float
    top_k: int
    top_p: float


def kernel_warpers(processors: LogitsProcessorList, draws: int = 1) -> Warpers | None:
    """``processors`` as ``Warpers`` when they are transformers' temperature, top-k and top-p warpers alone, at most
    one of each, the top-p one last and keeping one token at least (generate's), the top-k one keeping at least
    ``draws`` entries (``ops.draw_children``'s children), and the tuning applies them in the kernels
    (``KernelTuning.draw_warpers``); else ``None``. (Temperature and top-k commute; top-p does with neither.)"""
    if not tuning.active().draw_warpers:
        return None
    temperature, top_k, top_p = 1.0, 0, 1.0
    for p in processors:
        if top_p < 1.0 or p.__dict__.get("filter_value", float("-inf")) != float("-inf"):
            return None
        if type(p) is TemperatureLogitsWarper and temperature == 1.0:
            temperature = float(p.temperature)
        elif type(p) is TopKLogitsWarper and not top_k:
            top_k = p.top_k
        elif type(p) is TopPLogitsWarper and p.min_tokens_to_keep == 1 and p.top_p < 1.0:
            top_p = float(p.top_p)
        else:
            return None
    return Warpers(temperature, top_k, top_p) if top_k == 0 or top_k >= draws else None


def sampling_probs(logits_processor: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """``row_wise_probs``, what both the autoregressive step and the acceptance of a verified tree draw from. Under
    the temperature, top-k and top-p warpers alone, where ``ops.warped_probs`` takes them in its kernels, it is that:
    one launch and the exponentials at vocabularies up to 16K, longer rows under top-k in slices, where transformers'
    warpers take ~5 launches more, a radix select and under top-p a sort of each row (0.3 ms a token at Qwen3.5's
    248K). Its probabilities equal the warpers' up to rounding, so a seeded draw (``torch.multinomial``'s exponential
    race over the row, as stock ``generate``'s) differs from stock's only where two candidates' races tie within
    rounding."""
    warpers = kernel_warpers(logits_processor)
    if warpers is None or not ops.warps_in_kernels(logits, warpers.top_k):
        return row_wise_probs(logits_processor, logits)
    return ops.warped_probs(logits, *warpers)


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
                        p, q = rejection_residual(p, q), without_draw(q, x)
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
    packed: torch.Tensor      # [1 + 2 cap] length, emitted, path: what the host reads back


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, argmax: torch.Tensor,
                  cap: int) -> DeviceAcceptance:
    """``accept_path`` for plain greedy decoding on the device.

    ``tokens``/``parents`` ``[N]`` (node 0 the root; parents -1 for it and for padding nodes, which are never
    accepted), ``ancestors [N, N]`` (row ``i``: ``i`` and its ancestors), ``argmax [N]`` the target's choice after
    each node; ``cap`` bounds the path length. A node matches when its token is its parent's argmax and no earlier
    sibling has that token (the host walk takes the first such child); it is accepted when every node on its root
    path matches; the deepest accepted node ends the path (one per depth: at most one child of a node matches).
    """
    return _acceptance(ops.accept_walk(tokens, parents, ancestors, cap, argmax=argmax), cap)


def sample_accept(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, probs: torch.Tensor,
                  cap: int, draft_probs: torch.Tensor | None = None, siblings: int = 1) -> DeviceAcceptance:
    """``accept_path``'s sampling rule on the device: ``probs [N, vocab]`` is the target's processed distribution
    after each node (the rest as ``greedy_accept``); ``draft_probs [N, vocab]``, for sampled drafts, the drafter's
    distribution after each node, which its children (at most ``siblings``) were drawn from.

    The host tries a node's children in order and draws one uniform per child it reaches; here every node draws its
    uniform up front (the same law), hits with its chance and matches when it hits and no earlier sibling hit.
    Drafts chosen by rank: child ``c`` hits with ``p(c)`` renormalised over what its earlier siblings' rejections
    left (zero for a token an earlier sibling already tried), and the bonus is an exponential race over the last
    node's distribution with its children's tokens removed. Drawn drafts: recursive rejection sampling of every
    parent's children at once (``ops.drawn_hits``), and the bonus races over the last node's residual."""
    N = tokens.shape[0]
    uniforms = torch.rand(N, device=tokens.device)
    if draft_probs is None:
        p = probs[parents.clamp(min=0), tokens]                      # each node's chance under its parent's law
        earlier = earlier_siblings(parents)
        twin = earlier_twin(tokens, parents)
        tried = (earlier & ~twin[None, :]).to(p.dtype) @ p            # mass the earlier siblings' rejections removed
        hit = uniforms < torch.where(twin, 0.0, p / (1 - tried).clamp(min=torch.finfo(p.dtype).tiny))
    else:
        hit, residual = ops.drawn_hits(tokens, parents, probs, draft_probs, uniforms, siblings)
    walked = ops.accept_walk(tokens, parents, ancestors, cap, hit=hit)
    node = walked[-1:]
    children = parents == node
    rest = probs.index_select(0, node)[0].float()
    if draft_probs is None:
        rest = rest * (torch.zeros_like(rest).scatter_add(0, tokens, children.to(rest.dtype)) == 0)
    else:
        rest = torch.where(children.any(), residual.index_select(0, node)[0], rest)
    bonus = (rest / torch.empty_like(rest).exponential_()).argmax()
    emitted = walked[1:1 + cap]
    emitted.copy_(torch.where(emitted < 0, bonus, emitted))      # (a tensor fill value would sync the host)
    return _acceptance(walked, cap)


def _acceptance(walked: torch.Tensor, cap: int) -> DeviceAcceptance:
    """``DeviceAcceptance`` as views of a walk's ``[length, emitted, path, node]``."""
    return DeviceAcceptance(walked[-1:], walked[:1], walked[1 + cap:1 + 2 * cap], walked[1:1 + cap],
                            walked[:1 + 2 * cap])
