"""When speculation does not pay, decode autoregressively instead (``FallbackPolicy``), and remember it across calls
(``FallbackMemory``).

A speculative step costs a proposal and a verify pass; it pays only when it keeps more tokens than an autoregressive
step could produce in the same time. Both sides are measured on the device that runs: the adapter's autoregressive
step once per sampling rule (``loop.autoregressive.ar_step_seconds``: a sampled step costs more than a greedy one),
each speculative step as it runs, with the tokens it kept (a step that captured CUDA graphs is not observed).
Lossless either way, since both modes decode the target.

A step keeps 1 to 8 tokens at tau 2-4, so a few steps measure tau loosely, and the two mistakes cost unequally:
ending speculation that runs 1.3-1.6x autoregressive decoding gives all of that up, continuing one that runs 0.9x
loses a tenth. Speculation is therefore ended only when it loses *clearly* (``clearly_losing``): when the tokens a
step keeps, their mean plus ``CONFIDENCE`` standard errors, stay below what a step must keep to pay (its median time
over the autoregressive step's). Simulated over 48-step calls (as ``tests/test_fallback.py`` does): at 0.5x (this
CPU's kind of loss) every call falls back, after ~8 steps; at 0.75x nearly all, after ~12; at 1.26x (tau 2.6 where
2.07 pays) 2% of calls fall back, against 50% for a policy that compares its point estimate.

The steps outlive the call: the target's adapter keeps one ``SpeculationMemory`` (this fallback memory and the
proposal shapes' costs and acceptance, ``loop.shapes``) per drafter (its adapter), drafter kind, draft options and
sampling rule (greedy or sampling, and each logits processor's class and scalar settings: temperature, top-k, top-p,
penalties), the things that decide acceptance and cost (``speculation_memory``; ``clear_speculation_memory`` forgets
them). So:
- a call is judged once it has made ``warmup`` speculative steps of its own, and falls back to autoregressive decoding
  for the rest of the call when its recent steps (the last ``window``, earlier calls' included) lose and its own
  steps lose clearly, or lose while the remembered steps (the last ``HISTORY``, over calls) lose clearly: a device
  where speculation loses over many calls ends it after ``warmup`` steps of a call that loses, without waiting for
  that call's own evidence;
- after a call that fell back, the next calls start autoregressively while the remembered steps (the last
  ``HISTORY``, over calls) lose clearly: 1 call, then 2, 4, ... up to ``MAX_BACKOFF`` after each further call that
  falls back (the calls in between re-probe speculation, ``warmup`` steps or more); a call judged that speculates to
  its end resets the back-off. Prompts differ in acceptance, so one that loses does not stop speculation for the
  next ones while speculation pays over the remembered calls.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import weakref
from dataclasses import dataclass, field

from specla_hf.loop.acceptance import processor_key
from specla_hf.loop.shapes import ShapeMemory

MAX_BACKOFF = 16           # most calls started autoregressively between two that try speculation again
HISTORY = 64               # speculative steps remembered over calls: the back-off's evidence
CONFIDENCE = 1.5           # standard errors of the mean tokens a step by which speculation must lose to be ended
                           # (it is tested at every step: at 1.0, 13% of simulated calls at 1.26x fell back)


@dataclass
class FallbackMemory:
    """Speculation's recent steps under one drafter and sampling rule, and the back-off, across calls."""
    steps: list[tuple[float, int]] = field(default_factory=list)   # (seconds, tokens kept) per step, the latest last
    backoff: int = 0                      # calls the last fallback skipped (0: none since speculation paid)
    skip: int = 0                         # calls still to start autoregressively


def cost_per_token(steps: list[tuple[float, int]]) -> float:
    """Speculation's cost per kept token: the median step time over the mean tokens per step (a median, so that one
    step slowed by something else, e.g. the host, does not decide)."""
    return statistics.median(s for s, _ in steps) / statistics.mean(t for _, t in steps)


def clearly_losing(steps: list[tuple[float, int]], ar_seconds: float) -> bool:
    """Whether ``steps`` lose against an autoregressive step beyond their spread: the mean tokens a step keeps, plus
    ``CONFIDENCE`` standard errors, below the tokens ``must_keep`` that a step of their median time must keep to pay.
    The spread is at least that of a step at break-even whose drafts are each accepted with one probability until
    the first rejection (tokens a step ``1 +`` a geometric count: variance ``must_keep (must_keep - 1)``), so that a
    few steps keeping alike do not look certain."""
    tokens = [t for _, t in steps]
    if len(tokens) < 2:
        return False
    must_keep = statistics.median(s for s, _ in steps) / ar_seconds
    spread = max(statistics.stdev(tokens), math.sqrt(must_keep * max(must_keep - 1, 0)))
    return statistics.mean(tokens) + CONFIDENCE * spread / math.sqrt(len(tokens)) < must_keep


@dataclass
class FallbackPolicy:
    ar_seconds: float                     # one autoregressive step (= one token) on this device
    memory: FallbackMemory = field(default_factory=FallbackMemory)
    warmup: int = 4                       # a call's own steps before it is judged
    window: int = 8                       # recent steps that must lose too
    own: list[tuple[float, int]] = field(default_factory=list)    # (seconds, tokens kept) of this call's steps

    @property
    def steps(self) -> list[tuple[float, int]]:
        return self.memory.steps

    def observe(self, seconds: float, tokens: int) -> None:
        self.steps.append((seconds, tokens))
        del self.steps[:-HISTORY]
        self.own.append((seconds, tokens))

    def seconds_per_token(self) -> float:
        """Speculation's recent cost per kept token (``cost_per_token`` of the last ``window`` steps)."""
        return cost_per_token(self.steps[-self.window:])

    def describe(self, steps: list[tuple[float, int]]) -> str:
        tau = statistics.mean(t for _, t in steps)
        return (f"speculation cost {cost_per_token(steps) * 1e3:.2f} ms a token at tau {tau:.2f}, an "
                f"autoregressive step {self.ar_seconds * 1e3:.2f} ms")

    def judged(self) -> bool:
        return len(self.own) >= self.warmup

    def verdict(self) -> str | None:
        """Why to fall back now, or ``None`` to keep speculating."""
        if not self.judged() or self.seconds_per_token() <= self.ar_seconds:
            return None
        # the call's own steps lose clearly; or they lose, and so do the remembered calls' steps, clearly
        if clearly_losing(self.own, self.ar_seconds) or (cost_per_token(self.own) > self.ar_seconds
                                                          and clearly_losing(self.steps, self.ar_seconds)):
            return self.describe(self.steps[-self.window:])
        return None

    def start_autoregressive(self) -> str | None:
        """Why this call decodes autoregressively from the start (the back-off), or ``None`` to speculate."""
        if not self.memory.skip or not clearly_losing(self.steps, self.ar_seconds):
            return None
        self.memory.skip -= 1
        again = (f"after {self.memory.skip} more call{'s' if self.memory.skip > 1 else ''}" if self.memory.skip
                 else "on the next call")
        return (f"autoregressive from the start: in earlier calls {self.describe(self.steps)} (the last "
                f"{len(self.steps)} speculative steps); speculating again {again}")

    def settle(self, fell_back: bool) -> None:
        """After a call that speculated: a fallback doubles the back-off (1 call, then 2, 4, ... up to
        ``MAX_BACKOFF``), a call judged that speculated to its end resets it."""
        memory = self.memory
        if fell_back:
            memory.backoff = memory.skip = min(2 * memory.backoff or 1, MAX_BACKOFF)
        elif self.judged():
            memory.backoff = memory.skip = 0

    def summary(self) -> str:
        """How speculation compares, for a call that kept speculating."""
        if not self.judged():
            return "too few steps to compare with autoregressive decoding"
        return (f"speculation {cost_per_token(self.own) * 1e3:.2f} ms a token, an autoregressive step "
                f"{self.ar_seconds * 1e3:.2f} ms")


def memory_key(drafter, logits_processor, do_sample: bool) -> tuple:
    """What, besides the target and the drafter's adapter, decides acceptance and step cost: the drafter's kind and
    draft options, and the sampling rule with each logits processor's class and scalar settings."""
    return type(drafter).__name__, dataclasses.astuple(drafter.options), do_sample, processor_key(logits_processor)


@dataclass
class SpeculationMemory:
    """What the target's adapter remembers of speculation under one drafter and sampling rule."""
    fallback: FallbackMemory = field(default_factory=FallbackMemory)
    shapes: ShapeMemory = field(default_factory=ShapeMemory)


def speculation_memory(target, drafter, logits_processor, do_sample: bool) -> SpeculationMemory:
    """The target adapter's memory for this drafter and sampling rule (created empty). Kept per drafter adapter,
    weakly, so that a drafter's memory goes with it."""
    if getattr(target, "speculation_memory", None) is None:
        target.speculation_memory = weakref.WeakKeyDictionary()
    per_drafter = target.speculation_memory.setdefault(drafter.runner, {})
    return per_drafter.setdefault(memory_key(drafter, logits_processor, do_sample), SpeculationMemory())


def clear_speculation_memory(target) -> None:
    """Forget what the target's adapter (``specla_hf.adapter_for(model)``) remembers of speculation: the next call
    with each drafter pays the warm-up steps again and measures the proposal shapes anew."""
    target.speculation_memory = None
