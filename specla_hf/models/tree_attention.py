"""A model's own attention module driven over a ``SpecLAAttentionLayer``: what it is handed as its cache, its rotary
embedding and its mask, for tokens consumed into the committed positions or verified as draft-tree nodes after them.

The module runs unchanged: ``past_key_values`` is a ``KVView`` whose ``update`` stores the new keys and values in the
layer and returns its whole buffers; the mask lets each new token see the committed prefix and, consuming, the new
tokens up to itself or, verifying, its own ancestors among the pending nodes (itself included), and hides the unused
rest; a token sits at position ``committed + offset`` (its index among the consumed tokens, or its depth in the
tree). Mask and positions are computed on the device from the layer's committed length, so the calls are
capturable in CUDA graphs. ``HybridRunner``'s full-attention layers (``specla_hf.models.qwen3_5``) and the MTP
drafter's layer (``specla_hf.drafters.mtp``) both attend this way.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from specla_hf.cache import SpecLAAttentionLayer
from specla_kernels import tuning
from specla_kernels.reference import tree_depth


def tree_sdpa_backends() -> contextlib.AbstractContextManager:
    """The SDPA backends the attention modules' calls over a ``KVView`` may use (``tuning``'s
    ``tree_attention_backends``; none named: torch's choice), as a context around those calls (a capture records the
    kernels chosen inside). The fused one-token step calls the attention function itself, outside it."""
    names = tuning.active().tree_attention_backends
    if not names:
        return contextlib.nullcontext()
    choices = {m.lower(): b for m, b in SDPBackend.__members__.items() if m != "ERROR"}
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown SDPA backends {unknown}; choose from {sorted(choices)}")
    return sdpa_kernel([choices[n] for n in names])


class KVView:
    """What a model's attention module is handed as ``past_key_values``: ``update`` stores the new keys and values
    in the layer (as pending nodes or, consuming, as committed positions) and returns the layer's whole buffers."""

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


def attention_inputs(rotary_emb, h: torch.Tensor, layer: SpecLAAttentionLayer,
                     ancestors: torch.Tensor | None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotary embedding and the additive mask ``[B, 1, T, capacity]`` of the new tokens ``h [B, T, .]`` after
    ``layer``'s committed positions: consumed (``ancestors=None``), or tree nodes whose rows of the cache's ancestor
    mask (``[B, T, pending]``, all pending nodes, these included) are ``ancestors``. Built on the device from
    ``layer.length``: slot ``j`` of the buffer holds committed position ``j`` below the length and pending node
    ``j - length`` from there."""
    B, T = h.shape[:2]
    layer.make_room(T if ancestors is None else ancestors.shape[-1])     # a growing layer: before the mask is sized
    length = layer.length[:, None]                                               # [B, 1]
    slots = torch.arange(layer.capacity, device=h.device)
    if ancestors is None:
        offsets = torch.arange(T, device=h.device).expand(B, T)
        seen = slots <= (length + offsets)[..., None]                            # [B, T, capacity]
    else:
        offsets = tree_depth(ancestors)
        pending = slots - length                                                 # [B, capacity]
        N = ancestors.shape[-1]
        among = ancestors.gather(2, pending.clamp(0, N - 1)[:, None].expand(B, T, -1))
        seen = (pending < 0)[:, None] | (among & (pending < N)[:, None])
    rotary = rotary_emb(h, rotary_positions(rotary_emb, length + offsets))
    mask = torch.zeros(B, 1, T, layer.capacity, dtype=h.dtype, device=h.device)
    return rotary, mask.masked_fill_(~seen[:, None], torch.finfo(h.dtype).min)
