"""Where a step's emitted tokens stop: exactly where plain decoding would (``Stopping``)."""
from __future__ import annotations

import torch
from torch.profiler import record_function
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StopStringCriteria, StoppingCriteriaList)

# transformers' criteria that look at nothing but the sequence they are given (and the clock)
STATELESS_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)


class Stopping:
    """transformers' stopping criteria applied to each step's emitted tokens, token by token, and the streamer fed
    with the tokens kept. ``device``: where criteria that are not stateless see the sequence (generate() put it
    there)."""

    def __init__(self, criteria: StoppingCriteriaList, streamer, device: torch.device):
        self.criteria, self.streamer, self.device = criteria, streamer, device
        self.simple = all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in criteria)
        self.stateless = all(isinstance(c, STATELESS_CRITERIA) for c in criteria)
        if self.simple:     # generate()'s default pair, evaluated from their definitions on the host
            self.max_length = min((c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)), default=None)
            self.eos = {int(t) for c in criteria if isinstance(c, EosTokenCriteria)
                        for t in torch.as_tensor(c.eos_token_id).flatten().tolist()}

    def emit(self, grown: torch.LongTensor, first_new: int) -> tuple[torch.LongTensor, bool]:
        """``grown`` (host) cut after the first token after which a criterion fires, and whether one fired; the kept
        new tokens go to the streamer."""
        with record_function("specla.stop"):
            stop = self.stop_after(grown, first_new)
        kept = grown if stop is None else grown[:, :first_new + stop]
        if self.streamer is not None:
            self.streamer.put(kept[:, first_new:])
        return kept, stop is not None

    def stop_after(self, grown: torch.LongTensor, first_new: int) -> int | None:
        """How many of ``grown``'s tokens from ``first_new`` on to keep: up to and including the first after which a
        criterion fires (None: none fires).

        Stateless criteria are evaluated on every prefix on the host, without waiting for the GPU (calling the default
        pair costs ~10 launches of host time per prefix, so those are evaluated from their definitions); others (user
        criteria may keep state, and expect the sequence where generate() put it) are called on ``device``, prefix by
        prefix, in order, stopping at the first that fires, as plain decoding calls them."""
        if self.simple:
            new = grown[0, first_new:].tolist()
            return next((j + 1 for j, token in enumerate(new)
                         if token in self.eos or (self.max_length is not None
                                                  and first_new + j + 1 >= self.max_length)), None)
        grown = grown if self.stateless else grown.to(self.device)
        prefixes = (grown[:, :n] for n in range(first_new + 1, grown.shape[1] + 1))
        if self.stateless:
            flags = torch.stack([self.criteria(p, None).any() for p in prefixes]).tolist()
        else:
            flags = []
            for p in prefixes:
                flags.append(bool(self.criteria(p, None).any()))
                if flags[-1]:
                    break
        return next((j + 1 for j, hit in enumerate(flags) if hit), None)
