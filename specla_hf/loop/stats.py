"""What users of speculative decoding look at after a ``generate`` call."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecLAStats:
    """One ``generate`` call's counts and times (``model.specla_stats``)."""
    target_calls: int = 0                 # target forward passes (prefill included)
    steps: int = 0                        # target passes after the prompt: verify passes, then autoregressive steps
    new_tokens: int = 0
    draft_nodes: list[int] = field(default_factory=list)      # draft nodes verified per step
    accepted: list[int] = field(default_factory=list)         # draft tokens accepted per step
    # host wall time launching and collecting proposals (GPU drafting included), and of verify, acceptance, commit
    # (GPU verify included); in the device loop the host waits only for each step's tokens, under verify_time
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    committed_positions: int = 0          # positions the target's cache holds at the end (past the output when the
                                          # stop fell inside a committed block)
    mode: str = "speculative"             # how the call ended: "speculative" or "autoregressive"
    mode_reason: str = ""                 # why (e.g. the fallback's measured costs)
    graph_captures: int = 0               # CUDA graphs the call captured (each costs milliseconds: first calls, new
                                          # tree sizes)
    acceptance: str = ""                  # where speculative steps accepted: "device" (``loop.decode.DeviceDriver``)
                                          # or "host" (``HostDriver``); "" when none ran

    @property
    def tau(self) -> float:
        """Mean tokens kept per target step (accepted drafts + the target's own token): the new tokens over the steps.
        ``accepted`` also counts a last step's drafts past the stop, which no output holds."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def rejected_nodes_per_step(self) -> float:
        return (sum(self.draft_nodes) - sum(self.accepted)) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    @property
    def speculative_steps(self) -> int:
        """Steps that verified a draft (the rest, after a fallback, were autoregressive)."""
        return sum(1 for n in self.draft_nodes if n)

    def summary(self) -> str:
        line = (f"{self.new_tokens} tokens in {self.total_time:.2f}s ({self.tokens_per_second:.1f} tok/s), "
                f"tau={self.tau:.2f} over {self.steps} target steps, draft {self.draft_time:.2f}s, "
                f"verify {self.verify_time:.2f}s, mode {self.mode}")
        return f"{line} ({self.mode_reason})" if self.mode_reason else line
