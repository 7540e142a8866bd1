"""Autoregressive decoding through an adapter: the step with no proposal, and what it costs.

The target consumes the pending token and chooses the next one, with the logits processors and the sampling rule of
transformers' own loop (``GenerationMixin._sample``: the last position's logits in fp32, the processors, then argmax
or one multinomial draw), so greedy output equals stock ``generate`` and a seeded sampling run draws the same tokens
(on the GPU, where the warpers are kernels, up to draws that rounding decides: ``acceptance.sampling_probs``).
Plain greedy decoding, and sampling under processors that treat each row of scores alone (``row_wise``: temperature,
top-k, top-p, min-p), is one captured call per token that writes the next token into its own input (``ARStep``), and
each token is read back while the GPU already computes the next one.
"""
from __future__ import annotations

import time

import torch
from transformers.generation.logits_process import LogitsProcessorList

from specla_hf.loop.acceptance import kernel_warpers, processor_key, row_wise, sampling_probs
from specla_hf.runtime.transfer import HostCopy, copy_in, to_device


class ARStep:
    """One token as one call on static tensors: the target consumes ``token`` and overwrites it with its argmax, or
    with ``sampling``'s draw (row-wise processors, then one multinomial draw, as stock ``generate``), as a CUDA graph
    where the adapter runs them. Bound to the adapter's cache."""

    def __init__(self, target, cache, sampling: LogitsProcessorList | None = None):
        self.target, self.cache, self.sampling = target, cache, sampling
        self.key = self.key_for(sampling)
        graphs = target.graphs
        make = lambda: torch.zeros(1, 1, dtype=torch.long, device=target.device)   # noqa: E731
        self.token = make() if graphs is None else graphs.static(("ar token",), make)

    @staticmethod
    def key_for(sampling: LogitsProcessorList | None) -> tuple:
        """The captured call's key: one per sampling rule and where its warpers run (``sampling_probs``)."""
        if sampling is None:
            return ("ar step",)
        return ("ar step", processor_key(sampling), kernel_warpers(sampling) is not None)

    def _advance(self) -> None:
        logits = self.target.compute(self.token, self.cache, None, slice(-1, None), ()).logits[:, -1]
        if self.sampling is None:
            self.token.copy_(logits.argmax(-1, keepdim=True))
            return
        self.token.copy_(torch.multinomial(sampling_probs(self.sampling, logits), num_samples=1))

    def __call__(self) -> None:
        graphs = self.target.graphs
        if graphs is None:
            self._advance()
            return
        if self.key not in graphs.calls:
            saved = self.cache.snapshot(), self.token.clone(), rng_state(self.token.device)

            def restore():                   # the warm-up consumed a token (and random numbers): put them back
                self.cache.restore(saved[0])
                self.token.copy_(saved[1])
                set_rng_state(self.token.device, saved[2])
            graphs.capture(self.key, self._advance, "the autoregressive step", between=restore)
            restore()
        graphs.call(self.key, self._advance, "the autoregressive step")

    def seconds(self, steps: int = 8) -> float:
        """Seconds one step takes on this device, timed back to back after two warm-up steps (the cache is reset
        after: call it between generations)."""
        self.cache.reset()
        self.token.zero_()
        for _ in range(2):
            self()
        sync = torch.cuda.synchronize if self.target.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            self()
        sync()
        elapsed = (time.perf_counter() - start) / steps
        self.cache.reset()
        return elapsed


def rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on ``device`` (a capture's warm-up draws from it; stock ``generate`` did not)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def ar_step_seconds(target, sampling: LogitsProcessorList | None = None) -> float:
    """The adapter's autoregressive step time, greedy or under row-wise ``sampling`` (the step a fallback runs: a
    sampled step draws inside its graph and costs more), measured once per adapter (per model, device and dtype) and
    rule."""
    measured = target.__dict__.setdefault("_ar_step_seconds", {})
    key = ARStep.key_for(sampling)
    if key not in measured:
        measured[key] = ARStep(target, target.new_cache(1), sampling).seconds()
    return measured[key]


class ARDriver:
    """The decoding loop's step without a proposal (``loop.decode``): one token per step."""

    def __init__(self, target, cache, logits_processor: LogitsProcessorList, do_sample: bool, device: torch.device,
                 keep_scores: bool):
        self.target, self.cache = target, cache
        self.logits_processor, self.do_sample, self.device = logits_processor, do_sample, device
        self.keep_scores = keep_scores
        # one captured call per token: greedy with no processors, or sampling with row-wise ones
        self.pipelined = not keep_scores and (row_wise(logits_processor) if do_sample else not len(logits_processor))
        if self.pipelined:
            self.ar_step = ARStep(target, cache, logits_processor if do_sample else None)
            self.copies = [HostCopy((1,), torch.long, target.device) for _ in range(2)]
            self.queued = None           # the HostCopy of the token in flight
            self.queued_steps = 0

    def step(self, host_ids: torch.LongTensor):
        from specla_hf.loop.decode import StepResult
        if self.pipelined:
            first = self.queued is None
            if first:                                        # from the host's pending token
                copy_in(self.ar_step.token, host_ids[:, -1:])
                self.queued = self._queue()
            current, self.queued = self.queued, self._queue()   # the next step goes before this one is read
            # each queued step consumed a token: the first step queued two
            return StepResult([int(current.read()[0])], 0, 2 if first else 1)
        out = self.target.forward(host_ids[:, -1:], self.cache, logits_positions=slice(-1, None))   # copied in
        logits = out.logits[:, -1, :].to(self.device, torch.float32, copy=True)
        scores = logits
        if len(self.logits_processor):
            scores = self.logits_processor(to_device(host_ids, self.device), logits.clone())
        if self.do_sample:
            choice = int(torch.multinomial(torch.softmax(scores, -1), num_samples=1)[0, 0])
        else:
            choice = int(scores.argmax(-1)[0])
        return StepResult([choice], 0, 1, [scores] if self.keep_scores else None,
                          [logits] if self.keep_scores else None)

    def _queue(self) -> HostCopy:
        self.ar_step()
        copy = self.copies[self.queued_steps % 2]
        self.queued_steps += 1
        copy.queue(self.ar_step.token.view(1))
        return copy

    def finish(self) -> None:
        pass


def autoregressive_decode(target, input_ids: torch.LongTensor, max_new_tokens: int) -> torch.LongTensor:
    """Greedy continuation of ``input_ids [1, T]`` by exactly ``max_new_tokens`` tokens (no EOS): the loop
    ``generate(specla=True)`` runs, the baseline speedups are measured against."""
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

    from specla_hf.loop.decode import speculative_decode
    length = input_ids.shape[1] + max_new_tokens
    sequence, *_ = speculative_decode(target, None, input_ids, LogitsProcessorList(),
                                      StoppingCriteriaList([MaxLengthCriteria(length)]), False, length)
    return sequence
