"""When speculation does not pay, decode autoregressively instead (``FallbackPolicy``), and remember it across calls
(``FallbackMemory``).

A speculative step costs a proposal and a verify pass; it pays only when it keeps more tokens than an autoregressive
step could produce in the same time. Both sides are measured on the device that runs: the adapter's autoregressive
step once per sampling rule (``loop.autoregressive.ar_step_seconds``: a sampled step costs more than a greedy one),
each speculative step as it runs, with the tokens it kept (a step that captured CUDA graphs is not observed).
Speculation loses when its recent steps (the last ``window``) cost more per kept token than the autoregressive step;
lossless either way, since both modes decode the target.

The recent steps outlive the call: the target's adapter keeps one ``SpeculationMemory`` (this fallback memory and the
proposal shapes' costs and acceptance, ``loop.shapes``) per drafter (its adapter), drafter kind, draft options and
sampling rule (greedy or sampling, and each logits processor's class and scalar settings: temperature, top-k, top-p,
penalties), the things that decide acceptance and cost (``speculation_memory``; ``clear_speculation_memory`` forgets
them). So:
- a call is judged once it has made ``warmup`` speculative steps of its own: a step keeps 1 to 8 tokens at tau 2-4,
  so one step cannot tell (judged after one step, a call at tau 3.9 on the 9B Qwen3.5 shape, where speculation
  alone ran 1.98x autoregressive decoding, fell back after an unlucky first step whenever the remembered steps, of
  other prompts, lost: 1.46x);
- a call falls back to autoregressive decoding, for the rest of the call, when its recent steps (earlier calls'
  included) lose and all its own steps together lose too, so that a call where speculation pays is not held back by
  the history, and one where it pays by a little is not ended by a few unlucky steps (a window of a few steps,
  tested at every step, loses by chance sooner or later at tau 2-3);
- after a call that fell back, the next calls start autoregressively while the remembered steps still lose: 1 call,
  then 2, 4, ... up to ``MAX_BACKOFF`` after each further call that falls back (the calls in between re-probe
  speculation, ``warmup`` steps or more); a call judged that speculates to its end resets the back-off.
"""
from __future__ import annotations

import dataclasses
import statistics
import weakref
from dataclasses import dataclass, field

from specla_hf.loop.acceptance import processor_key
from specla_hf.loop.shapes import ShapeMemory

MAX_BACKOFF = 16           # most calls started autoregressively between two that try speculation again


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


@dataclass
class FallbackPolicy:
    ar_seconds: float                     # one autoregressive step (= one token) on this device
    memory: FallbackMemory = field(default_factory=FallbackMemory)
    warmup: int = 4                       # a call's own steps before it is judged
    window: int = 8                       # recent steps judged, and remembered
    own_steps: int = 0                    # steps observed in this call
    own_seconds: float = 0.0              # their time
    own_tokens: int = 0                   # and tokens kept

    @property
    def steps(self) -> list[tuple[float, int]]:
        return self.memory.steps

    def observe(self, seconds: float, tokens: int) -> None:
        self.steps.append((seconds, tokens))
        del self.steps[:-self.window]
        self.own_steps += 1
        self.own_seconds += seconds
        self.own_tokens += tokens

    def seconds_per_token(self) -> float:
        """Speculation's recent cost per kept token (``cost_per_token`` of the last ``window`` steps)."""
        return cost_per_token(self.steps)

    def losing(self) -> str | None:
        """Why the recent steps (earlier calls' included) lose against an autoregressive step, or ``None``."""
        if len(self.steps) < self.warmup or self.seconds_per_token() <= self.ar_seconds:
            return None
        tau = statistics.mean(t for _, t in self.steps)
        return (f"speculation cost {self.seconds_per_token() * 1e3:.2f} ms a token at tau {tau:.2f}, an "
                f"autoregressive step {self.ar_seconds * 1e3:.2f} ms")

    def judged(self) -> bool:
        return self.own_steps >= self.warmup

    def verdict(self) -> str | None:
        """Why to fall back now, or ``None`` to keep speculating."""
        if not self.judged() or self.own_seconds / max(self.own_tokens, 1) <= self.ar_seconds:
            return None
        return self.losing()

    def start_autoregressive(self) -> str | None:
        """Why this call decodes autoregressively from the start (the back-off), or ``None`` to speculate."""
        reason = self.losing() if self.memory.skip else None
        if reason is None:
            return None
        self.memory.skip -= 1
        again = (f"after {self.memory.skip} more call{'s' if self.memory.skip > 1 else ''}" if self.memory.skip
                 else "on the next call")
        return (f"autoregressive from the start: in earlier calls {reason} (the last {len(self.steps)} speculative "
                f"steps); speculating again {again}")

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
        return (f"speculation {self.seconds_per_token() * 1e3:.2f} ms a token, an autoregressive step "
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
