"""The speculative decoding loop: draft a tree, verify it in one target pass, accept a path, commit it.

Invariant: the target's cache has consumed every token of ``input_ids`` except the last (the *pending* token), which
is the root of each draft tree. One target forward per step; accepted tokens are never run through the target again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StopStringCriteria, StoppingCriteriaList)

from specla_hf.cuda_graphs import to_device
from specla_hf.drafting import DraftTree, DynamicTreeDrafter
from specla_hf.gdn import GDNRunner


@dataclass
class SpecLAStats:
    """What users of speculative decoding look at, for one ``generate`` call."""
    target_calls: int = 0                 # target forward passes (prefill included)
    steps: int = 0                        # verify passes
    new_tokens: int = 0
    draft_nodes: list[int] = field(default_factory=list)      # draft nodes verified per step
    accepted: list[int] = field(default_factory=list)         # draft tokens accepted per step
    draft_time: float = 0.0               # host wall time launching and collecting proposals (GPU drafting included)
    verify_time: float = 0.0              # host wall time of verify, acceptance, commit (GPU verify included)
    total_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify pass (accepted drafts + the target's own token)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else 0.0

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
            target.commit(cache, node, len(path))
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
        # emit up to the first token after which EOS / max_length / any stopping criterion fires, exactly where plain
        # decoding would stop
        with record_function("specla.stop"):
            stop = _stop_after(stopping_criteria, grown, host_ids.shape[1], device)
        added = len(emitted) if stop is None else stop
        host_ids = grown[:, :host_ids.shape[1] + added]
        if keep_scores:
            all_scores += scores[:added]
            all_logits += [logits[n:n + 1] for n in path[:added]]
        if streamer is not None:
            streamer.put(host_ids[:, -added:])
        if stop is not None:
            break
    stats.new_tokens = host_ids.shape[1] - prompt_len
    stats.total_time = time.perf_counter() - start
    return host_ids.to(device), stats, all_scores, all_logits


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
