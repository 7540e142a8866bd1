"""A model's own attention module driven over a ``SpecLAAttentionLayer``: what it is handed as its cache, its rotary
embedding and its mask, for tokens consumed into the committed positions or verified as draft-tree nodes after them.

The module runs unchanged: ``past_key_values`` is a ``KVView`` whose ``update`` stores the new keys and values in the
layer and returns its whole buffers; the mask lets each new token see the committed prefix and, consuming, the new
tokens up to itself or, verifying, its own ancestors among the pending nodes (itself included), and hides the unused
rest; a token sits at position ``committed + offset`` (its index among the consumed tokens, or its depth in the
tree). Mask and positions are computed on the device from the layer's committed length, so the calls are
capturable in CUDA graphs. Inside ``attention_kernels()`` an SDPA model's attention runs ``ops.masked_attention``'s
Triton kernel, which skips the hidden slots of the buffer. ``HybridRunner``'s full-attention layers
(``specla_hf.models.qwen3_5``) and the MTP drafter's layer (``specla_hf.drafters.mtp``) attend under these masks,
Qwen3.5's gated attention of batch 1 computed from the module's weights (``HybridRunner._attention``), other modules
run as they are over a ``KVView``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specla_hf.cache import SpecLAAttentionLayer
from specla_kernels import ops, tuning


KERNEL = "specla"        # ``tree_attention_backends``' name for ``ops.masked_attention``'s kernel
SDPA_BACKENDS = {m.lower(): b for m, b in SDPBackend.__members__.items() if m != "ERROR"}


def attention_kernels() -> contextlib.AbstractContextManager:
    """The kernels the hybrids' attention calls use (``tuning``'s ``tree_attention_backends``), as a context around
    those calls (a capture records the kernels chosen inside): ``"specla"`` runs ``ops.masked_attention``'s Triton
    kernel for an SDPA model's calls it takes (``specla_masked_attention``), SDPA backend names (lower case
    ``torch.nn.attention.SDPBackend`` members) restrict the other calls; none named: torch's choice."""
    names = tuning.active().tree_attention_backends
    unknown = [n for n in names if n not in SDPA_BACKENDS and n != KERNEL]
    if unknown:
        raise ValueError(f"unknown attention backends {unknown}; choose from {sorted(SDPA_BACKENDS) + [KERNEL]}")
    stack = contextlib.ExitStack()
    backends = [SDPA_BACKENDS[n] for n in names if n != KERNEL]
    if backends:
        stack.enter_context(sdpa_kernel(backends))
    if KERNEL in names:
        stack.enter_context(_sdpa_replaced())
    return stack


@contextlib.contextmanager
def _sdpa_replaced():
    """``ALL_ATTENTION_FUNCTIONS["sdpa"]`` is ``specla_masked_attention`` inside (the attention modules look their
    function up at each call); not thread-safe, as any change of a global registry."""
    replaced = ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = specla_masked_attention
    try:
        yield
    finally:
        if replaced is None:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = replaced


def kernel_takes(query, key, value, attention_mask, dropout: float = 0.0, **kwargs) -> bool:
    """Whether ``specla_masked_attention`` runs ``ops.masked_attention``'s kernel for this call: Triton on the
    tensors' device, an explicit additive mask the kernel takes, no dropout, no other options."""
    return (ops.use_triton(query) and attention_mask is not None and not dropout
            and all(v is None or v is False for v in kwargs.values())
            and ops.masked_attention_applies(query, key, value, attention_mask))


def specla_masked_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """transformers' attention-function signature: ``ops.masked_attention``'s kernel where it takes the call
    (``kernel_takes``), stock SDPA otherwise."""
    if kernel_takes(query, key, value, attention_mask, dropout, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return ops.masked_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


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
    T = h.shape[1]
    layer.make_room(T if ancestors is None else ancestors.shape[-1])     # a growing layer: before the mask is sized
    mask, positions = ops.attention_mask(layer.length, ancestors, T, layer.capacity, h.dtype)
    return rotary_rows(rotary_emb, h, positions, layer), mask


def rotary_rows(rotary_emb, x: torch.Tensor, positions: torch.Tensor,
                layer: SpecLAAttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_emb(x, positions)`` (cos, sin ``[B, T, R]``) as one gather from ``layer.rotary_table``, the module's
    own output for every slot's position (a position is below the capacity: each token holds a slot at or after
    it), built on first use; the module's ops take ~15 launches a call. The module's result for a position depends on
    that position alone (elementwise ops), so the rows are bitwise its output. Rope types whose frequencies follow
    the sequence length (dynamic NTK, LongRoPE) run the module."""
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return rotary_emb(x, rotary_positions(rotary_emb, positions))
    table = layer.rotary_table
    if table is None or table.shape[1] < layer.capacity or table.dtype != x.dtype or table.device != x.device:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():      # a capture's warm-up builds the table
            return rotary_emb(x, rotary_positions(rotary_emb, positions))
        every = torch.arange(layer.capacity, device=x.device)[None]
        table = layer.rotary_table = torch.cat(rotary_emb(x, rotary_positions(rotary_emb, every)))   # [2, capacity, R]
    # an indexing gather: aten's index_select of a few indices walks them one after another (9.4 us for 16)
    rows = table[:, positions.reshape(-1)].view(2, *positions.shape, -1)
    return rows[0], rows[1]
