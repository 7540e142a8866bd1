"""A small language model of the target's family as drafter (the classic assistant model)."""
from __future__ import annotations

import torch

from specla_hf.drafters.base import DynamicTreeDrafter
from specla_hf.drafters.options import DraftOptions
from specla_hf.models import adapter_for


class GDNDrafter(DynamicTreeDrafter):
    """A small GDN language model as drafter (the classic assistant), with its own SpecLACache: ``start`` consumes the
    tokens it has not seen, the root included (sequence mode), ``score`` verifies the draft tree from its committed
    state."""

    def __init__(self, drafter_model, options: DraftOptions):
        super().__init__(options)
        self.runner = adapter_for(drafter_model, role="drafter")
        self.cache = self.runner.new_cache(1)
        self.consumed = 0                    # tokens of input_ids in the drafter's committed state

    def start(self, input_ids: torch.LongTensor) -> torch.Tensor:
        # every step emits at least one token, so the sequence always holds tokens the drafter has not consumed
        if self.consumed >= input_ids.shape[1]:
            raise RuntimeError("the drafter is ahead of the sequence: was one drafter shared by two generations?")
        out = self.runner.forward(input_ids[:, self.consumed:], self.cache, logits_positions=slice(-1, None))
        self.consumed = input_ids.shape[1]                 # the root included
        return torch.log_softmax(out.logits[0, -1], -1, dtype=torch.float32)

    def score(self, n: int, rows: slice = slice(None)) -> torch.Tensor:
        b = self.buffers
        out = self.runner.compute(b.tokens[None, :n], self.cache, b.parents[None, :n], rows, ())
        self.cache.discard()
        return torch.log_softmax(out.logits[0], -1, dtype=torch.float32), None     # fp32 log-probs

    # ---- steps accepted on the device (``speculative_decode``'s device loop) ----
    catches_up_on_device = True

    def catch_up(self, features: tuple[torch.Tensor, ...], accepted) -> None:
        """``start`` for a path accepted on the device (``accepted``: a ``DeviceAcceptance``), in static shapes: the
        emitted tokens (``depth + 1`` slots, padded) are verified as a chain from the committed state, the path's
        last node (the bonus token, the next root) is committed and its draft log-probs become the root's (the LM
        head runs on that slot only). The same recurrence as ``start``'s sequence mode, up to summation order."""
        b = self._buffers()
        b.reset()
        last = accepted.length - 1
        out = self.runner.compute(accepted.emitted[None], self.cache, b.chain, last, ())
        self._root_from(accepted, last, torch.log_softmax(out.logits[0, 0], -1, dtype=torch.float32))
