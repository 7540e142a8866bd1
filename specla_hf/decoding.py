"""The speculative decoding loop: draft a tree, verify it in one target pass, accept a path, commit it.

Invariant: the target's cache has consumed every token of ``input_ids`` except the last (the *pending* token), which
is the root of each draft tree. One target forward per step; accepted tokens are never run through the target again.
Two loops: the host loop (``speculative_decode``: any acceptance rule, logits processor, threshold or drafter) and,
for plain greedy decoding with a tree selected on the device, the device loop (``_decode_on_device``), which queues
each step's acceptance, commit and next proposal before the host reads the step's tokens.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StopStringCriteria, StoppingCriteriaList)

from specla_hf.cuda_graphs import HostCopy, _restore, _snapshot, capture_or_warn, to_device
from specla_hf.drafting import DraftTree, DynamicTreeDrafter
from specla_hf.models.fla_gdn import GDNRunner


@dataclass
class SpecLAStats:
    """What users of speculative decoding look at, for one ``generate`` call."""
    target_calls: int = 0                 # target forward passes (prefill included)
    steps: int = 0                        # verify passes
    new_tokens: int = 0
    draft_nodes: list[int] = field(default_factory=list)      # draft nodes verified per step
    accepted: list[int] = field(default_factory=list)         # draft tokens accepted per step
    # host wall time launching and collecting proposals (GPU drafting included), and of verify, acceptance, commit
    # (GPU verify included); in the device loop the host waits only for each step's tokens, under verify_time
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens kept per verify pass (accepted drafts + the target's own token): the new tokens over the steps.
        ``accepted`` also counts a last step's drafts past the stop, which no output holds (the device loop drafts
        its last proposal before the host knows the length)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def rejected_nodes_per_step(self) -> float:
        return (sum(self.draft_nodes) - sum(self.accepted)) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_time:.2f}s ({self.tokens_per_second:.1f} tok/s), "
                f"tau={self.tau:.2f} over {self.steps} verify steps, draft {self.draft_time:.2f}s, "
                f"verify {self.verify_time:.2f}s")


def accept_path(tree: DraftTree, logits: torch.Tensor | None, context: torch.LongTensor,
                logits_processor: LogitsProcessorList, do_sample: bool,
                argmax: list[int] | None = None) -> tuple[int, list[int], list[torch.Tensor]]:
    """Walk the tree from the root with the target's (processed) distributions; lossless for greedy and sampling.

    Greedy: follow the child equal to the target's argmax. Sampling: the children of a node are candidates chosen
    deterministically by the drafter, tried in order: accept ``x`` with probability ``p(x)``, otherwise set
    ``p(x) = 0`` and renormalise; if all fail, the bonus token is sampled from what is left of ``p``. This reproduces
    plain sampling from ``p`` exactly. ``p`` is the target's distribution after the same logits processors plain
    decoding applies, evaluated on the node's own context.
    ``argmax``: every node's argmax, given for plain greedy decoding (no logits processors), which then reads
    ``logits`` only to return them as scores (``None``: no scores).
    Returns (last accepted node, emitted tokens = accepted drafts + bonus, processed scores per emitted token).
    """
    node, emitted, scores = 0, [], []
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
            return node, emitted, scores
        node = nxt
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
    """``accept_path`` for plain greedy decoding as device tensor ops: static shapes, no host synchronisation.

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


def speculative_decode(
    target: GDNRunner,
    drafter: DynamicTreeDrafter,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    do_sample: bool,
    max_length: int,
    streamer=None,
    keep_scores: bool = False,
) -> tuple[torch.LongTensor, SpecLAStats, list[torch.Tensor], list[torch.Tensor]]:
    """Generate until a stopping criterion fires; returns (sequence, stats, processed scores, raw logits)."""
    stats, all_scores, all_logits = SpecLAStats(), [], []
    start = time.perf_counter()
    # the sequence grows on the host: the default stopping criteria, the streamer and the drafter read it there, and
    # nothing in a greedy step waits for the GPU but the draft and the verify results
    device = input_ids.device
    host_ids = input_ids.cpu()
    plain = not do_sample and not len(logits_processor)
    cache = target.new_cache(1)
    feature_layers = drafter.feature_layers            # target hidden states a target-aligned drafter reads
    if input_ids.shape[1] > 1:
        out = target.forward(input_ids[:, :-1].to(target.device), cache, logits_positions=slice(0, 0),
                             hidden_layers=feature_layers)
        drafter.add_features(out.hidden_states)
        stats.target_calls += 1
    prompt_len = input_ids.shape[1]

    def launch(ids: torch.LongTensor) -> float:
        """Queue the proposal after ``ids`` on the device; its host time."""
        t = time.perf_counter()
        drafter.launch(ids, max_depth=max_length - ids.shape[1] - 1)
        return time.perf_counter() - t

    def verify(tokens: torch.LongTensor, parents: torch.LongTensor):
        """One target pass over the draft tree (host or device tensors: the runner pads and copies them in)."""
        with record_function("specla.verify"):
            return target.forward(tokens, cache, parents=parents, logits_positions=slice(None),
                                  hidden_layers=feature_layers)

    launch_s = launch(host_ids)
    if plain and not keep_scores and drafter.catches_up_on_device and drafter.device_tree() is not None:
        host_ids = _decode_on_device(target, drafter, cache, host_ids, verify, stopping_criteria, streamer, device,
                                     stats, launch_s)
        stats.new_tokens = host_ids.shape[1] - prompt_len
        stats.total_time = time.perf_counter() - start
        return host_ids.to(device), stats, [], []
    while True:
        t0 = time.perf_counter()
        # a tree selected on the device is verified before the host reads it back, so the GPU goes from drafting to
        # verifying without waiting for the host; otherwise the host selects it and the runner copies it in
        selected = drafter.device_tree()
        if selected is not None:
            out = verify(*selected)
        t_collect = time.perf_counter()
        with record_function("specla.collect"):
            tree = drafter.collect()
        t1 = time.perf_counter()
        stats.draft_time += launch_s + t1 - t_collect
        stats.verify_time += t_collect - t0
        if selected is None:
            out = verify(tree.tokens[None], tree.parents[None])
        with record_function("specla.accept"):
            # logits are copied (the verify graph's output buffer is overwritten next step) only where they are used:
            # plain greedy reads back each node's argmax, no more; sampling and logits processors run on ``device``
            # with the sequence there, as in plain decoding
            logits = (out.logits[0].to(device, torch.float32, copy=True) if keep_scores or not plain else None)
            argmax = out.logits[0].argmax(-1).tolist() if plain else None
            context = None if plain else to_device(host_ids, device)
            node, emitted, scores = accept_path(tree, logits, context, logits_processor, do_sample, argmax)
            path = _path_nodes(tree, node)
        with record_function("specla.commit"):
            target.commit(cache, path)
        if feature_layers:
            with record_function("specla.features"):
                drafter.add_features(out.hidden_states, path)
        stats.verify_time += time.perf_counter() - t1
        stats.target_calls += 1
        stats.steps += 1
        stats.draft_nodes.append(len(tree) - 1)
        stats.accepted.append(len(emitted) - 1)
        drafter.observe(emitted[:-1])

        # the next proposal goes to the device now, so the GPU drafts while the host checks the stopping criteria
        # (if one fires, that proposal is dropped)
        grown = torch.cat([host_ids, host_ids.new_tensor([emitted])], 1)
        with record_function("specla.launch"):
            launch_s = launch(grown)
        kept, stop = _emit(grown, host_ids.shape[1], stopping_criteria, streamer, device)
        if keep_scores:
            added = kept.shape[1] - host_ids.shape[1]
            all_scores += scores[:added]
            all_logits += [logits[n:n + 1] for n in path[:added]]
        host_ids = kept
        if stop:
            break
    stats.new_tokens = host_ids.shape[1] - prompt_len
    stats.total_time = time.perf_counter() - start
    return host_ids.to(device), stats, all_scores, all_logits


class _StepTail:
    """What follows a verify pass in the device loop: ``greedy_accept``, the target's commit of the accepted path and
    the drafter's ``catch_up`` on it. About 40 small kernels: launched one by one they kept the GPU waiting for the
    host ~0.25 ms a step (``benchmarks/step_timeline.py``), so with CUDA graphs they are one replay per verify graph
    (its outputs, the tree buffers and the caches are static), captured on first use, as ``GraphedForward`` does:
    the caches are snapshotted, the capture's warm-up and recording run, the snapshot is restored and the graph
    replayed."""

    def __init__(self, target: GDNRunner, drafter: DynamicTreeDrafter, cache, cap: int):
        self.target, self.drafter, self.cache, self.cap = target, drafter, cache, cap
        # kept on the target's runner per drafter runner (weakly: a drafter's graphs go with it)
        self.graphs = (None if target.graphs is None else
                       target.__dict__.setdefault("_step_tail_graphs", weakref.WeakKeyDictionary())
                       .setdefault(drafter.runner, {}))

    def _step(self, tokens: torch.Tensor, parents: torch.Tensor, out) -> DeviceAcceptance:
        n = tokens.shape[1]
        self.drafter.buffers.keep_verified()              # the drafter's last_tree once the loop ends
        acc = greedy_accept(tokens[0], parents[0], self.cache.ancestors[0, :n, :n], out.logits[0].argmax(-1),
                            self.cap)
        self.cache.commit(acc.node, path_length=0, path=(acc.path[None], acc.length))   # the loop counts positions
        self.drafter.catch_up(out.hidden_states, acc)
        return acc

    def __call__(self, tokens: torch.Tensor, parents: torch.Tensor, out) -> DeviceAcceptance:
        if self.graphs is None:
            return self._step(tokens, parents, out)
        static = (tokens, parents, out.logits, self.cache.ancestors, *out.hidden_states, self.cache.layers[0].k_hat)
        key = (tokens.shape[1], *(t.data_ptr() for t in static))
        if key not in self.graphs:
            caches = (self.cache, self.drafter.cache)
            saved = [_snapshot(c) for c in caches]

            def restore():
                for c, s in zip(caches, saved):
                    _restore(c, s, None)
            result = {}
            graph = capture_or_warn(lambda: result.update(acc=self._step(tokens, parents, out)),
                                    "a step's acceptance and the drafter's catch-up", "running them eagerly",
                                    self.target.graphs.emulate, between=restore)
            restore()
            self.graphs[key] = (graph, result)
        graph, result = self.graphs[key]
        if graph is None:
            return self._step(tokens, parents, out)
        graph.replay()
        self.cache.discard()                  # the Python side of the recorded commit (the drafter keeps none)
        return result["acc"]


def _decode_on_device(target: GDNRunner, drafter: DynamicTreeDrafter, cache, host_ids: torch.LongTensor, verify,
                      stopping_criteria: StoppingCriteriaList, streamer, device: torch.device, stats: SpecLAStats,
                      launch_s: float) -> torch.LongTensor:
    """The loop for plain greedy decoding with a proposal selected on the device and a drafter that catches up there
    (``catches_up_on_device``): only each step's emitted tokens cross to the host. A step's acceptance
    (``greedy_accept``), its commit, the drafter's catch-up and the next proposal are all queued before the host reads
    that step's tokens, so the GPU drafts step ``i + 1`` while the host checks step ``i`` against the stopping
    criteria; the verify pass of step ``i + 1`` is queued after that check (the GPU drafts for longer than the host
    checks), so no pass is verified past the end. Tokens equal the host loop's (``greedy_accept`` is
    ``accept_path``); the drafter's catch-up runs as a chain verify, so drafts may differ from the host loop's by
    rounding."""
    cap = drafter.options.depth + 1
    readback, tail = HostCopy((1 + cap,), torch.long, target.device), _StepTail(target, drafter, cache, cap)
    drafter.last_tree = None               # no host tree per step (nothing to calibrate against); set at the end
    tokens, parents = drafter.device_tree()
    out = verify(tokens, parents)
    while True:
        t0 = time.perf_counter()
        with record_function("specla.accept"):
            n = tokens.shape[1]
            acc = tail(tokens, parents, out)        # acceptance, commit, the drafter's catch-up
            readback.queue(acc.packed)
        t1 = time.perf_counter()
        with record_function("specla.launch"):
            drafter.launch_caught_up()
        t2 = time.perf_counter()
        with record_function("specla.collect"):
            length, *emitted = readback.read().tolist()        # this step's tokens, while the GPU drafts the next
            emitted = emitted[:length]
        cache.seq_length += len(emitted)                        # the commit recorded in the tail counts none
        drafter.advance(len(emitted))
        stats.target_calls += 1
        stats.steps += 1
        stats.draft_nodes.append(n - 1)
        stats.accepted.append(len(emitted) - 1)
        drafter.observe(emitted[:-1])
        host_ids, stop = _emit(torch.cat([host_ids, host_ids.new_tensor([emitted])], 1), host_ids.shape[1],
                               stopping_criteria, streamer, device)
        if not stop:
            tokens, parents = drafter.device_tree()
            out = verify(tokens, parents)
        stats.draft_time += launch_s + t2 - t1
        stats.verify_time += time.perf_counter() - t2 + t1 - t0
        launch_s = 0.0
        if stop:
            drafter.last_tree = drafter.buffers.verified_tree(n)
            return host_ids


def _emit(grown: torch.LongTensor, first_new: int, stopping_criteria: StoppingCriteriaList, streamer,
          device: torch.device) -> tuple[torch.LongTensor, bool]:
    """``grown`` (host) cut after the first token after which EOS / max_length / any stopping criterion fires, exactly
    where plain decoding would stop, and whether one fired; the kept new tokens go to ``streamer``. ``device``: where
    criteria that are not stateless see the sequence (``_stop_after``)."""
    with record_function("specla.stop"):
        stop = _stop_after(stopping_criteria, grown, first_new, device)
    kept = grown if stop is None else grown[:, :first_new + stop]
    if streamer is not None:
        streamer.put(kept[:, first_new:])
    return kept, stop is not None


# transformers' criteria that look at nothing but the sequence they are given (and the clock)
STATELESS_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)


def _stop_after(stopping_criteria: StoppingCriteriaList, grown: torch.LongTensor, first_new: int,
                device: torch.device) -> int | None:
    """How many of ``grown``'s (host) tokens from ``first_new`` on to keep: up to and including the first after which
    a criterion fires (None: none fires).

    Stateless criteria are evaluated on every prefix on the host, without waiting for the GPU (generate()'s default
    pair, max length and EOS, straight from their definitions: calling them costs ~10 launches of host time per
    prefix); others (user criteria may keep state, and expect the sequence where generate() put it) are called on
    ``device``, prefix by prefix, in order, stopping at the first that fires, as plain decoding calls them.
    """
    if all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria):
        max_length = min((c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)),
                         default=None)
        eos = set().union(*(_eos_ids(c) for c in stopping_criteria if isinstance(c, EosTokenCriteria)))
        new = grown[0, first_new:].tolist()
        return next((j + 1 for j, token in enumerate(new)
                     if token in eos or (max_length is not None and first_new + j + 1 >= max_length)), None)
    stateless = all(isinstance(c, STATELESS_CRITERIA) for c in stopping_criteria)
    grown = grown if stateless else grown.to(device)
    prefixes = (grown[:, :n] for n in range(first_new + 1, grown.shape[1] + 1))
    if stateless:
        flags = torch.stack([stopping_criteria(p, None).any() for p in prefixes]).tolist()
    else:
        flags = []
        for p in prefixes:
            flags.append(bool(stopping_criteria(p, None).any()))
            if flags[-1]:
                break
    return next((j + 1 for j, hit in enumerate(flags) if hit), None)


def _eos_ids(criterion: EosTokenCriteria) -> set[int]:
    """An EOS criterion's token ids as a host set, read once per criterion (its tensor may live on the GPU)."""
    ids = criterion.__dict__.get("_specla_eos")
    if ids is None:
        ids = criterion.__dict__["_specla_eos"] = set(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
    return ids


def _path_nodes(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root to ``node`` inclusive (the positions whose logits produced the emitted tokens)."""
    out, parents = [], tree.parents.tolist()
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]
