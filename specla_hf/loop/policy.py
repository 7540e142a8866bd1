"""When speculation does not pay, decode autoregressively instead (``FallbackPolicy``).

A speculative step costs a proposal and a verify pass; it pays only when it keeps more tokens than an autoregressive
step could produce in the same time. Both sides are measured on the device that runs: the adapter's autoregressive
step once (``loop.autoregressive.ar_step_seconds``), each speculative step as it runs, with the tokens it kept. After
``warmup`` steps, once the recent speculative steps cost more per token than the autoregressive step, the loop
switches to autoregressive decoding for the rest of the call: lossless either way, since both decode the target.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class FallbackPolicy:
    ar_seconds: float                     # one autoregressive step (= one token) on this device
    warmup: int = 4                       # speculative steps before judging (the first ones capture graphs)
    window: int = 8                       # recent steps judged
    steps: list[tuple[float, int]] = field(default_factory=list)   # (seconds, tokens kept) per speculative step

    def observe(self, seconds: float, tokens: int) -> None:
        self.steps.append((seconds, tokens))

    def seconds_per_token(self) -> float:
        """Speculation's recent cost per kept token: the median step time over the mean tokens per step (a median,
        so that one step slowed by something else, e.g. the host, does not decide; steps that captured CUDA graphs
        are not observed at all)."""
        recent = self.steps[-self.window:]
        return statistics.median(s for s, _ in recent) / statistics.mean(t for _, t in recent)

    def verdict(self) -> str | None:
        """Why to fall back now, or ``None`` to keep speculating."""
        if len(self.steps) < self.warmup:
            return None
        spec = self.seconds_per_token()
        if spec <= self.ar_seconds:
            return None
        tau = statistics.mean(t for _, t in self.steps[-self.window:])
        return (f"speculation cost {spec * 1e3:.2f} ms a token at tau {tau:.2f}, an autoregressive step "
                f"{self.ar_seconds * 1e3:.2f} ms")

    def summary(self) -> str:
        """How speculation compares, for a call that kept speculating."""
        if len(self.steps) < self.warmup:
            return "too few steps to compare with autoregressive decoding"
        return (f"speculation {self.seconds_per_token() * 1e3:.2f} ms a token, an autoregressive step "
                f"{self.ar_seconds * 1e3:.2f} ms")
