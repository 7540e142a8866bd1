"""The decoding loop: one step (propose, verify, accept, commit, emit) and the two drivers that run it.

Invariant: the target's cache has consumed every token of the sequence but the last (the *pending* token), which is
the root of each draft tree. One target pass per step; accepted tokens are never run through the target again.

Each step verifies the launched proposal in one target pass, accepts a path of it (``loop.acceptance``), commits that
path in the target's cache, launches the next proposal, and hands the step's tokens to the stopping criteria and the
streamer (``loop.stopping``); a proposal launched past the stop is dropped. The drivers differ only in where the
acceptance runs:
- ``HostDriver`` (any acceptance rule, logits processor, confidence threshold or drafter): the host reads the tree and
  the target's outputs and walks the tree (``accept_path``);
- ``DeviceDriver`` (plain greedy decoding, or sampling under row-wise processors such as temperature, top-k and top-p;
  the tree selected on the device; a drafter that catches up there): the acceptance (``greedy_accept`` or
  ``sample_accept``), the commit and the drafter's catch-up are one CUDA graph queued behind the verify
  pass, and the next proposal and its verify pass are queued before the host reads the step's tokens, so the GPU
  drafts and verifies step ``i + 1`` while the host checks step ``i`` against the stopping criteria and the shape
  and fallback policies take their measurements. A step that may reach the length limit queues no verify pass ahead;
  one queued ahead of another stop (an EOS token, a stop string, the fallback) is discarded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.profiler import record_function
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from specla_hf.loop.acceptance import (ROW_WISE_PROCESSORS, DeviceAcceptance, accept_path, greedy_accept,
                                      kernel_warpers, processor_key, row_wise, sample_accept, sampling_probs)
from specla_hf.loop.autoregressive import ARDriver, ar_step_seconds
from specla_hf.loop.policy import FallbackPolicy, speculation_memory
from specla_hf.loop.shapes import ShapePolicy
from specla_hf.loop.stats import SpecLAStats
from specla_hf.loop.stopping import Stopping
from specla_hf.runtime.graphs import tensors_in
from specla_hf.runtime.transfer import HostCopy, to_device


@dataclass
class StepResult:
    emitted: list[int]                       # the step's tokens: accepted drafts, then the target's own
    nodes: int                               # draft nodes verified (root excluded)
    committed: int                           # positions the step added to the target's committed state
    scores: list[torch.Tensor] | None = None   # processed scores per emitted token (when asked for)
    logits: list[torch.Tensor] | None = None   # raw logits per emitted token (when asked for)
    # the verified tree (host parents, cumulative draft log-probs), its accepted path (root first) and the depths
    # drafted, for the shape policy (when it is on)
    verified: tuple[torch.Tensor, torch.Tensor, list[int], int] | None = None


class _QueuedVerify(NamedTuple):
    """A verify pass queued on the device: its step's start mark (``ShapePolicy.start``), the depths drafted, the
    tree and the target's outputs."""
    start: object
    depths: int
    tokens: torch.Tensor
    parents: torch.Tensor
    out: object


class HostDriver:
    """The step with the acceptance on the host (see module docstring)."""

    def __init__(self, target, drafter, cache, stats: SpecLAStats, shapes: ShapePolicy,
                 logits_processor: LogitsProcessorList, do_sample: bool, max_length: int, device: torch.device,
                 keep_scores: bool):
        self.target, self.drafter, self.cache, self.stats, self.shapes = target, drafter, cache, stats, shapes
        self.logits_processor, self.do_sample, self.max_length = logits_processor, do_sample, max_length
        self.device, self.keep_scores = device, keep_scores
        self.plain = not do_sample and not len(logits_processor)

    def step(self, host_ids: torch.LongTensor) -> StepResult:
        target, drafter, stats = self.target, self.drafter, self.stats
        t0, start, depths = time.perf_counter(), self.shapes.start(), drafter.launched_depths
        # a tree selected on the device is verified before the host reads it back, so the GPU goes from drafting to
        # verifying without waiting for the host; otherwise the host selects it and the adapter copies it in
        selected = drafter.device_tree()
        out = None if selected is None else verify(target, self.cache, *selected, drafter.feature_layers)
        t_collect = time.perf_counter()
        with record_function("specla.collect"):
            tree = drafter.collect()
        t1 = time.perf_counter()
        stats.draft_time += t1 - t_collect
        stats.verify_time += t_collect - t0
        if out is None:
            out = verify(target, self.cache, tree.tokens[None], tree.parents[None], drafter.feature_layers)
        with record_function("specla.accept"):
            # logits are copied (a verify graph's outputs are overwritten next step) only where they are used: plain
            # greedy reads back each node's argmax, no more; sampling and logits processors run on ``device`` with
            # the sequence there, as in plain decoding
            logits = (out.logits[0].to(self.device, torch.float32, copy=True)
                      if self.keep_scores or not self.plain else None)
            argmax = out.logits[0].argmax(-1).tolist() if self.plain else None
            context = None if self.plain else to_device(host_ids, self.device)
            acc = accept_path(tree, logits, context, self.logits_processor, self.do_sample, argmax)
        with record_function("specla.commit"):
            target.commit(self.cache, acc.path)
        if drafter.feature_layers:
            with record_function("specla.features"):
                drafter.add_features(out.hidden_states, acc.path)
        stats.verify_time += time.perf_counter() - t1
        drafter.observe(acc.emitted[:-1])
        # the next proposal goes to the device now, so the GPU drafts while the host checks the stopping criteria
        grown = torch.cat([host_ids, host_ids.new_tensor([acc.emitted])], 1)
        with record_function("specla.launch"):
            self.shapes.launch(drafter, start, len(tree), lambda: launch(drafter, grown, self.max_length, stats))
        kept = None if logits is None else [logits[n:n + 1] for n in acc.path]
        return StepResult(acc.emitted, len(tree) - 1, len(acc.path), acc.scores if self.keep_scores else None,
                          kept if self.keep_scores else None, (tree.parents, tree.log_probs, acc.path, depths))

    def finish(self) -> None:
        pass


class DeviceDriver:
    """The step with the acceptance, the commit and the drafter's catch-up on the device, in one CUDA graph per
    verify graph, and the next verify pass queued before the host reads the step's tokens (see module docstring).
    Greedy tokens equal the host driver's (``greedy_accept`` is ``accept_path``), sampled ones follow the same law
    (``sample_accept``, under ``sampling``: row-wise logits processors, each row of the tree processed alone); the
    drafter's catch-up runs as a chain verify, so drafts may differ from the host driver's by rounding."""

    def __init__(self, target, drafter, cache, stats: SpecLAStats, shapes: ShapePolicy, max_length: int,
                 sampling: LogitsProcessorList | None = None):
        self.target, self.drafter, self.cache, self.stats, self.shapes = target, drafter, cache, stats, shapes
        self.max_length, self.sampling = max_length, sampling
        self.rule = ("greedy",) if sampling is None else ("sampling", processor_key(sampling),
                                                          drafter.draft_sampling is not None,
                                                          kernel_warpers(sampling) is not None)
        self.cap = drafter.options.depth + 1
        self.readback = HostCopy((1 + 2 * self.cap,), torch.long, target.device)
        self.tree_readback = HostCopy(tuple(drafter.buffers.verified.shape), torch.float64, target.device)
        drafter.last_tree = None           # no host tree per step (nothing to calibrate against); set by ``finish``
        self.nodes = 0
        self.queued: _QueuedVerify | None = None   # the launched proposal's verify pass, once queued

    def _verify_launched(self) -> "_QueuedVerify":
        """Queue the verify pass of the launched proposal (a new step starts)."""
        start, depths = self.shapes.start(), self.drafter.launched_depths
        tokens, parents = self.drafter.device_tree()
        return _QueuedVerify(start, depths, tokens, parents,
                         verify(self.target, self.cache, tokens, parents, self.drafter.feature_layers))

    def step(self, host_ids: torch.LongTensor) -> StepResult:
        drafter, stats, shapes = self.drafter, self.stats, self.shapes
        t0 = time.perf_counter()
        step = self.queued if self.queued is not None else self._verify_launched()
        self.queued = None
        self.nodes = step.tokens.shape[1]
        with record_function("specla.accept"):
            acc = self._tail(step.tokens, step.parents, step.out)      # acceptance, commit, the drafter's catch-up
            self.readback.queue(acc.packed)
            if shapes.active:
                self.tree_readback.queue(drafter.buffers.verified)
        t1 = time.perf_counter()
        with record_function("specla.launch"):
            # this step emits at least one token, so no deeper than the length limit then leaves room for (a depth
            # at least: the device verifies only trees selected on the device)
            depth_room = max(1, self.max_length - host_ids.shape[1] - 2)
            shapes.launch(drafter, step.start, self.nodes, lambda: drafter.launch_caught_up(depth_room))
        t2 = time.perf_counter()
        # ahead of this step's tokens unless they may reach the length limit: the host's work until the next step
        # (stopping criteria, streamer, policies) then runs while the GPU verifies, not between drafting and verifying
        if host_ids.shape[1] + self.cap < self.max_length:
            self.queued = self._verify_launched()
        else:
            shapes.untime_drafting()
        with record_function("specla.collect"):
            length, *packed = self.readback.read().tolist()        # this step's tokens, while the GPU goes on
        emitted = packed[:length]
        drafter.advance(len(emitted))
        drafter.observe(emitted[:-1])
        stats.draft_time += t2 - t1
        stats.verify_time += time.perf_counter() - t2 + t1 - t0
        verified = None
        if shapes.active:
            rows = self.tree_readback.read()[:, :self.nodes]
            verified = (rows[1].long(), rows[2], packed[self.cap:self.cap + length], step.depths)
        return StepResult(emitted, self.nodes - 1, len(emitted), verified=verified)

    def finish(self) -> None:
        if self.queued is not None:          # verified ahead of a stop: its nodes are never committed
            self.cache.discard()
            self.queued = None
        self.drafter.last_tree = self.drafter.buffers.verified_tree(self.nodes)

    def _tail_step(self, tokens: torch.Tensor, parents: torch.Tensor, out) -> DeviceAcceptance:
        n = tokens.shape[1]
        self.drafter.buffers.keep_verified()              # the drafter's last_tree once the loop ends
        ancestors = self.cache.ancestors[0, :n, :n]
        if self.sampling is None:
            acc = greedy_accept(tokens[0], parents[0], ancestors, out.logits[0].argmax(-1), self.cap)
        else:
            drafter = self.drafter
            drawn = (None if drafter.draft_sampling is None else
                     drafter.tree_draft_logq(drafter.buffers.tree_slots[:n]).exp())
            acc = sample_accept(tokens[0], parents[0], ancestors, sampling_probs(self.sampling, out.logits[0]),
                                self.cap, drawn, drafter.options.topk)
        self.cache.commit(acc.node, path=(acc.path[None], acc.length))
        self.drafter.catch_up(out.hidden_states, acc)
        return acc

    def _tail(self, tokens: torch.Tensor, parents: torch.Tensor, out) -> DeviceAcceptance:
        """``_tail_step``: about 40 small kernels, one graph replay where the target runs CUDA graphs (its inputs are
        the verify graph's static outputs, the tree buffers and the caches), kept per drafter adapter."""
        graphs = self.target.graphs
        # captured only when the drafter's adapter runs graphs too: the tail writes its cache, which may grow if not
        if graphs is None or self.drafter.runner.graphs is None:
            return self._tail_step(tokens, parents, out)
        pending = tensors_in(self.cache.layers[0].pending())[0]           # which verify graph's outputs it reads
        drafted = tensors_in(self.drafter.cache.layers[0].committed())     # which drafter cache it writes
        static = (tokens, parents, out.logits, self.cache.ancestors, *out.hidden_states, pending, *drafted)
        key = ("step tail", self.rule, tokens.shape[1], *(t.data_ptr() for t in static))
        owner = self.drafter.runner
        store = graphs.store(owner)
        if key not in store:
            caches = (self.cache, self.drafter.cache)
            saved = [c.snapshot() for c in caches]

            def restore():
                for c, s in zip(caches, saved):
                    c.restore(s)
            graphs.capture(key, lambda: self._tail_step(tokens, parents, out),
                           "a step's acceptance and the drafter's catch-up", between=restore, owner=owner)
            restore()
        if store[key] is None:
            return self._tail_step(tokens, parents, out)
        acc = store[key].replay()
        self.cache.discard()                  # the Python side of the recorded commit (the drafter keeps none)
        return acc


def verify(target, cache, tokens: torch.Tensor, parents: torch.Tensor, feature_layers: tuple[int, ...]):
    """One target pass over a draft tree (host or device tensors: the adapter pads and copies them in)."""
    with record_function("specla.verify"):
        return target.forward(tokens, cache, parents=parents, logits_positions=slice(None),
                              hidden_layers=feature_layers)


def launch(drafter, ids: torch.LongTensor, max_length: int, stats: SpecLAStats) -> None:
    """Queue the proposal after ``ids`` on the device (no deeper than the length limit leaves room for)."""
    t = time.perf_counter()
    drafter.launch(ids, max_depth=max_length - ids.shape[1] - 1)
    stats.draft_time += time.perf_counter() - t


@torch.no_grad()
def speculative_decode(target, drafter, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                       stopping_criteria: StoppingCriteriaList, do_sample: bool, max_length: int, streamer=None,
                       keep_scores: bool = False, fallback: bool = False
                       ) -> tuple[torch.LongTensor, SpecLAStats, list[torch.Tensor], list[torch.Tensor]]:
    """Generate until a stopping criterion fires; returns (sequence, stats, processed scores, raw logits).

    ``drafter=None`` decodes autoregressively through the adapter. ``fallback``: switch to autoregressive decoding
    once speculation costs more per token than an autoregressive step on this device, or start there while earlier
    calls' speculation with this drafter and sampling rule lost (``loop.policy``)."""
    stats, all_scores, all_logits = SpecLAStats(), [], []
    start = time.perf_counter()
    policy = shapes = None
    # sampling under processors that treat each row alone runs on the device, in the speculative and the AR step
    sampled_on_device = do_sample and row_wise(logits_processor)
    graph_sets = [g for g in (target.graphs, getattr(getattr(drafter, "runner", None), "graphs", None)) if g]

    def captures() -> int:
        return sum(g.captures for g in graph_sets)
    if drafter is not None:
        # under sampling the drafter draws its children from its distribution under the target's row-wise processors
        drafter.sample_drafts(LogitsProcessorList(p for p in logits_processor if type(p) in ROW_WISE_PROCESSORS)
                              if do_sample and drafter.options.sampled else None)
        memory = speculation_memory(target, drafter, logits_processor, do_sample)
        shapes = ShapePolicy(drafter.options, memory.shapes, target.device, captures)
        if fallback:
            # the AR step the fallback runs: greedy or sampled on the device (other processors run a host-side step,
            # slower than either)
            ar_seconds = ar_step_seconds(target, logits_processor if sampled_on_device else None)
            policy = FallbackPolicy(ar_seconds, memory.fallback)
            stats.mode_reason = policy.start_autoregressive() or ""
            if stats.mode_reason:
                drafter = policy = shapes = None
    captured_before = captures()
    # the sequence grows on the host: the stopping criteria, the streamer and the drafter read it there, and nothing
    # in a greedy step waits for the GPU but the draft and the verify results
    device = input_ids.device
    host_ids = input_ids.cpu()
    stopping = Stopping(stopping_criteria, streamer, device)
    cache = target.new_cache(1, max_length)
    if drafter is not None:
        drafter.reserve(max_length)
    if input_ids.shape[1] > 1:
        out = target.forward(input_ids[:, :-1].to(target.device), cache, logits_positions=slice(0, 0),
                             hidden_layers=() if drafter is None else drafter.feature_layers)
        if drafter is not None:
            drafter.add_features(out.hidden_states)
        stats.target_calls += 1
    prompt_len = input_ids.shape[1]
    stats.committed_positions = prompt_len - 1
    plain = not do_sample and not len(logits_processor)

    def autoregressive() -> ARDriver:
        return ARDriver(target, cache, logits_processor, do_sample, device, keep_scores)
    if drafter is None:
        driver, stats.mode = autoregressive(), "autoregressive"
    else:
        shapes.apply(drafter)
        launch(drafter, host_ids, max_length, stats)
        on_device = (plain or sampled_on_device) and not keep_scores
        if on_device and drafter.catches_up_on_device and drafter.device_tree() is not None:
            driver = DeviceDriver(target, drafter, cache, stats, shapes, max_length,
                                  logits_processor if do_sample else None)
            stats.acceptance = "device"
        else:
            driver = HostDriver(target, drafter, cache, stats, shapes, logits_processor, do_sample, max_length,
                                device, keep_scores)
            stats.acceptance = "host"
    while True:
        t, captured = time.perf_counter(), captures()
        step = driver.step(host_ids)
        stats.target_calls += 1
        stats.steps += 1
        stats.draft_nodes.append(step.nodes)
        stats.accepted.append(len(step.emitted) - 1)
        stats.committed_positions += step.committed
        grown = torch.cat([host_ids, host_ids.new_tensor([step.emitted])], 1)
        kept, stop = stopping.emit(grown, host_ids.shape[1])
        added = kept.shape[1] - host_ids.shape[1]
        if keep_scores:
            all_scores += step.scores[:added]
            all_logits += step.logits[:added]
        host_ids = kept
        if step.verified is not None:
            shapes.observe(*step.verified)
        if stop:
            break
        # a step that captured graphs says nothing of its cost
        if policy is not None and stats.mode == "speculative" and captures() == captured:
            policy.observe(time.perf_counter() - t, added)
            reason = policy.verdict()
            if reason is not None:
                driver.finish()
                driver, stats.mode = autoregressive(), "autoregressive"
                stats.mode_reason = f"fell back after {stats.steps} speculative steps: {reason}"
    driver.finish()
    if shapes is not None:
        shapes.finish()
    if policy is not None:
        policy.settle(fell_back=stats.mode == "autoregressive")
        if stats.mode == "speculative":
            stats.mode_reason = policy.summary()
    stats.new_tokens = host_ids.shape[1] - prompt_len
    stats.graph_captures = captures() - captured_before
    stats.total_time = time.perf_counter() - start
    return host_ids.to(device), stats, all_scores, all_logits
