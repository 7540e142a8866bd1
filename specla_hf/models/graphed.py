"""An adapter's forward calls as CUDA graphs, by call shape (``ForwardGraphs``).

- consuming ``T <= max_seq_tokens`` tokens (autoregressive steps, a drafter catching up) is one graph per ``T``;
  longer inputs (prompts) are consumed by the adapter as chains of ``CHAIN_CHUNK`` tree nodes, verified and
  committed (the graphs below);
- verifying tree nodes is one graph per power-of-two bucket of nodes: a tree is padded with dummy nodes that hang off
  the committed state (``parents = -1``), so no real node descends from them, real outputs are unchanged and they are
  never accepted;
- committing a path of the last verified tree is one graph per verify graph (and per path longer than a chunk).
A graph reads its inputs (token ids, or any tuple of ``[B, T, ...]`` tensors: a drafter's features and tokens) from
static buffers and writes the cache in place (committed tensors) or to its own outputs (the new pending nodes, which
the cache holds after a replay). Graphs are bound to one cache's tensors: the adapter keeps one cache per batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from specla_hf.drafters.options import MAX_TREE_BUCKET
from specla_hf.runtime.graphs import GraphSet, StaticCall
from specla_hf.runtime.transfer import copy_in

MAX_SEQ_TOKENS = 4
DRAFT_SEQ_TOKENS = 16   # a drafter catching up after a step consumes up to draft depth + 1 tokens: graph those too
CHAIN_CHUNK = 64        # longer inputs (prompts) are consumed as chains of this many nodes on the graphed tree path


def num_tokens(inputs) -> int:
    """``T`` of a call's inputs: a ``[B, T]`` id tensor or a tuple of ``[B, T, ...]`` tensors."""
    return tree_flatten(inputs)[0][0].shape[1]


def batch_size(inputs) -> int:
    """``B`` of a call's inputs (see ``num_tokens``)."""
    return tree_flatten(inputs)[0][0].shape[0]


def pad_tokens(inputs, pad: int):
    """Append ``pad`` zero positions along ``T`` to every input tensor."""
    return tree_map(lambda x: torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1), inputs)


def tree_bucket(n: int) -> int:
    """Smallest power of two >= n (so a handful of graphs serve every tree size)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Forward:
    call: StaticCall
    inputs: object                  # static copies of the call's input tensors
    parents: torch.Tensor | None
    prefix: tuple | None            # static copies of the pending nodes the call extends (cache.pending_refs layout)
    pending: tuple | None           # the cache's pending references after the call (its outputs)
    commit: dict | None = None      # a tree call's commit graphs (captured on first use) by "path longer than a chunk"
    path: torch.Tensor | None = None    # and the path they commit


class ForwardGraphs(GraphSet):
    """Capture-on-first-use and replay of ``adapter.compute`` keyed by call shape (see module docstring), plus the
    other calls of the adapter and of whoever drives it (``GraphSet``)."""

    def __init__(self, adapter, emulate: bool = False, max_seq_tokens: int = MAX_SEQ_TOKENS):
        super().__init__(emulate)
        self.adapter = adapter
        self.max_seq_tokens = max_seq_tokens
        self.forwards: dict[tuple, _Forward] = {}
        self.last_tree: _Forward | None = None     # the tree call whose outputs are the cache's pending nodes

    def supports(self, inputs, parents: torch.Tensor | None) -> bool:
        T = num_tokens(inputs)
        return batch_size(inputs) == 1 and (T <= self.max_seq_tokens if parents is None else T <= MAX_TREE_BUCKET)

    def forward(self, inputs, cache, parents, logits_positions, hidden_layers):
        key = (num_tokens(inputs), None if parents is None else cache.num_pending,
               None if logits_positions is None else (logits_positions.start, logits_positions.stop,
                                                      logits_positions.step), tuple(hidden_layers))
        if key not in self.forwards:
            if parents is None:
                # every sequence length at once: a length first seen mid-generation (a drafter catching up after a
                # long accepted path) would otherwise put a capture into that step
                for t in range(1, self.max_seq_tokens + 1):
                    if (t, *key[1:]) not in self.forwards:
                        shaped = tree_map(lambda x: x.new_zeros(x.shape[0], t, *x.shape[2:]), inputs)
                        self.forwards[(t, *key[1:])] = self._capture(shaped, cache, None, logits_positions,
                                                                      hidden_layers)
            else:
                self.forwards[key] = self._capture(inputs, cache, parents, logits_positions, hidden_layers)
        g = self.forwards[key]
        for buf, x in zip(tree_flatten(g.inputs)[0], tree_flatten(inputs)[0]):
            copy_in(buf, x)
        if parents is not None:
            copy_in(g.parents, parents)
            if g.prefix is not None:
                prefix_parents, _, prefix_pending = g.prefix
                _, _, pending = cache.pending_refs()
                prefix_parents.copy_(cache.parents)
                for bufs, tensors in zip(prefix_pending, pending):
                    for buf, t in zip(bufs, tensors):
                        buf.copy_(t)
        out, _ = g.call.replay()
        if parents is not None:
            cache.set_pending_refs(g.pending)
            self.last_tree = g
        return out

    def commit(self, cache, path: list[int]) -> bool:
        """``cache.commit`` of the pending nodes ``path`` (root first) of the last tree call as one graph replay (the
        commit kernel reads that graph's static outputs); False, doing nothing, if the cache holds other nodes."""
        g = self.last_tree
        if g is None or cache.parents is not g.pending[0]:
            return False
        from specla_kernels import commit as commit_kernels
        # two graphs: one for paths of up to one chunk of nodes, whose kernel has no loop over further chunks (fewer
        # registers), and one for longer paths
        long = len(path) > commit_kernels.PATH_CHUNK
        if g.path is None:
            # the accepted node, the path's length, then its nodes: what the host writes before each replay, one copy
            g.path, g.commit = torch.zeros(1, 2 + cache.num_pending, dtype=torch.long, device=cache.parents.device), {}
        if long not in g.commit:
            nodes = g.path[:, 2:] if long else g.path[:, 2:2 + commit_kernels.PATH_CHUNK]
            pending = cache.pending_refs()

            def commit_all():
                cache.commit(g.path[0, :1], path=(nodes, g.path[:, 1]))
                cache.set_pending_refs(pending)      # the Python side of a commit: a replay leaves it to the caller
            # captured with a path of length 0: the warm-up run then commits nothing
            g.path[0, 1] = 0
            g.commit[long] = self.capture(("commit", id(g), long), commit_all, "the commit")
        static = g.commit[long]
        if static is None:
            return False
        g.path[0, :2 + len(path)].copy_(torch.tensor([path[-1], len(path), *path]))
        static.replay()
        cache.discard()
        return True

    def _capture(self, inputs, cache, parents, logits_positions, hidden_layers) -> _Forward:
        # static buffers on the adapter's device (callers may pass host tensors: replays copy them in)
        device = self.adapter.device
        static_inputs = tree_map(lambda t: t.to(device, copy=True), inputs)
        static_parents = None if parents is None else parents.to(device, copy=True)
        prefix = None
        if parents is not None and cache.num_pending:
            parents_now, ancestors_now, pending_now = cache.pending_refs()
            prefix = (parents_now.clone(), ancestors_now, [tuple(t.clone() for t in p) for p in pending_now])
        saved = cache.snapshot()

        def restore():                # outside the recorded region: a copy recorded in a graph would replay each step
            cache.restore(saved)
            if prefix is not None:
                cache.set_pending_refs(prefix)

        def call():
            out = self.adapter.compute(static_inputs, cache, static_parents, logits_positions, hidden_layers)
            return out, (None if parents is None else cache.pending_refs())

        restore()
        self.captures += 1
        static = StaticCall(call, self.emulate, between=restore,
                            python_state=(cache.pending_refs, cache.set_pending_refs))
        restore()                     # undo the warm-up's / recording's effects
        return _Forward(static, static_inputs, static_parents, prefix, static.outputs[1])
