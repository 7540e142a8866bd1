"""Our own autoregressive decoding baseline: greedy, one token per step through the same runner (CUDA graphs on
GPU), no host synchronisation inside the loop. Speedups are reported against this, not only against stock HF."""
from __future__ import annotations

import torch

from specla_hf.models.fla_gdn import GDNRunner


@torch.no_grad()
def autoregressive_decode(runner: GDNRunner, input_ids: torch.LongTensor, max_new_tokens: int) -> torch.LongTensor:
    """Greedy continuation of ``input_ids [1, T]`` by ``max_new_tokens`` tokens (no EOS: a fixed-length baseline)."""
    cache = runner.new_cache(1)
    input_ids = input_ids.to(runner.device)
    if input_ids.shape[1] > 1:
        runner.forward(input_ids[:, :-1], cache, logits_positions=slice(0, 0))
    token, new = input_ids[:, -1:], []
    for _ in range(max_new_tokens):
        token = runner.forward(token, cache).logits[:, -1].argmax(-1, keepdim=True)
        new.append(token)
    return torch.cat([input_ids, *new], 1)
