"""What the decoding loop and the drafters need of a model: the target-adapter protocol.

An adapter drives one model family's own modules (its weights, norms, MLPs, LM head) over a ``SpecLACache`` and
replaces only what speculative decoding must do differently: verify a token tree from the committed state without
writing a state per node, and commit an accepted root-to-node path. One file per family under ``specla_hf.models``
(``fla_gdn`` for flash-linear-attention's ``GatedDeltaNetForCausalLM``); ``specla_hf.models.adapter_for`` picks it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn


def plain_lookup(embedding: nn.Module) -> bool:
    """Whether ``embedding`` is a plain ``nn.Embedding`` lookup that no forward hook observes: its rows can then be
    gathered without calling the module (``embed``, and the drafters' input kernel)."""
    return (type(embedding) is nn.Embedding and embedding.max_norm is None
            and not embedding._forward_hooks and not embedding._forward_pre_hooks)


def embed(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``embedding(ids)``, a ``plain_lookup`` as an indexing gather: for a few tokens aten's lookup takes its
    small-index kernel, which walks the tokens one after another (a tree's embedding then costs more than its norm)."""
    return embedding.weight[ids] if plain_lookup(embedding) else embedding(ids)


@dataclass
class RunnerOutput:
    logits: torch.Tensor                       # [B, T, vocab] (fp32 upcast is the caller's choice)
    hidden_states: tuple[torch.Tensor, ...]    # outputs of the requested layers (index 0 = embeddings)


class TargetAdapter(Protocol):
    """One model driven by SpecLA (a target, or a drafter model of the same kind).

    Invariant kept by the loop: the cache has consumed every token but the pending one, the root of each tree.
    """

    model: torch.nn.Module
    graphs: object | None            # the adapter's ``runtime.graphs.GraphSet`` when it replays CUDA graphs

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def new_cache(self, batch_size: int = 1, max_length: int | None = None):
        """A fresh ``SpecLACache`` for this model with room for ``max_length`` positions (with CUDA graphs: the
        adapter's one cache, reset)."""

    def forward(self, inputs, cache, parents: torch.Tensor | None = None, logits_positions: slice | None = None,
                hidden_layers: tuple[int, ...] = ()) -> RunnerOutput:
        """Consume ``inputs [B, T]`` into the committed state (``parents=None``), or verify them as tree nodes on top
        of it (``parents [B, T]``: indices into the cache's pending nodes, new ones included; -1 = the committed
        state), recording what a commit needs and leaving the committed state untouched. ``hidden_layers``: the
        residual stream after these blocks (0 = embeddings), for target-aligned drafters."""

    def compute(self, inputs, cache, parents: torch.Tensor | None, logits_positions: slice | None,
                hidden_layers: tuple[int, ...]) -> RunnerOutput:
        """``forward``'s computation itself, on device tensors in their final shapes (no graph dispatch, no padding,
        no host inputs): what a captured CUDA graph records, and what drafters call inside their own captured
        steps."""

    def commit(self, cache, path: list[int]) -> None:
        """Keep the pending nodes ``path`` (root first, a root-to-node path) and drop the rest."""
