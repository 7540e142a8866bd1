"""A model's own attention module driven over a ``SpecLAAttentionLayer``: what it is handed as its cache, its rotary
embedding and its mask, for tokens consumed into the committed positions or verified as draft-tree nodes after them.

The module runs unchanged: ``past_key_values`` is a ``KVView`` whose ``update`` stores the new keys and values in the
layer and returns every position's; the mask lets each new token see the committed prefix and, consuming, the new
tokens up to itself or, verifying, its own ancestors among the pending nodes (itself included); a token sits at
position ``committed + offset`` (its index among the consumed tokens, or its depth in the tree). ``HybridRunner``'s
full-attention layers (``specla_hf.models.qwen3_5``) and the MTP drafter's layer (``specla_hf.drafters.mtp``) both
attend this way.
"""
from __future__ import annotations

import torch

from specla_hf.cache import SpecLAAttentionLayer
from specla_kernels.reference import tree_depth


class KVView:
    """What a model's attention module is handed as ``past_key_values``: ``update`` stores the new keys and values
    in the layer (as pending nodes or, consuming, as committed positions) and returns every position's."""

    def __init__(self, layer: SpecLAAttentionLayer, pending: bool):
        self.layer, self.pending = layer, pending

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None):
        return self.layer.append(key_states, value_states, self.pending)


def rotary_positions(rotary_emb, positions: torch.Tensor) -> torch.Tensor:
    """``positions [B, T]`` as ``rotary_emb`` takes them: the multimodal rotary of Qwen3.5 takes a (time, height,
    width) position per token, all three equal for text (transformers 5.17 wants all three)."""
    if hasattr(rotary_emb, "mrope_section"):
        return positions.expand(3, *positions.shape)
    return positions


def attention_inputs(rotary_emb, attn_implementation: str, h: torch.Tensor, committed: int,
                     ancestors: torch.Tensor | None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """The rotary embedding and the additive mask ``[B, 1, T, committed + pending]`` of the new tokens ``h [B, T, .]``
    after ``committed`` positions: consumed (``ancestors=None``), or tree nodes whose rows of the cache's ancestor mask
    (``[B, T, pending]``, all pending nodes, these included) are ``ancestors``. A prompt consumed into an empty layer
    under SDPA gets no mask: SDPA's own causal masking, as in the stock forward, holds no ``T x T`` mask in memory."""
    B, T = h.shape[:2]
    offsets = tree_depth(ancestors) if ancestors is not None else torch.arange(T, device=h.device).expand(B, T)
    rotary = rotary_emb(h, rotary_positions(rotary_emb, committed + offsets))
    if ancestors is None:
        if not committed and attn_implementation == "sdpa":
            return rotary, None
        ancestors = torch.ones(T, T, dtype=torch.bool, device=h.device).tril().expand(B, T, T)
    seen = torch.cat([ancestors.new_ones(B, T, committed), ancestors], -1)[:, None]
    mask = torch.zeros(seen.shape, dtype=h.dtype, device=h.device).masked_fill_(~seen, torch.finfo(h.dtype).min)
    return rotary, mask
