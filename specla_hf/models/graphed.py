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
``GraphedAdapter`` is an adapter's ``forward`` and ``commit`` through them (prompts as chains, trees in buckets).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from specla_hf.drafters.options import MAX_TREE_BUCKET
from specla_hf.models.base import RunnerOutput
from specla_hf.runtime.graphs import GraphSet, StaticCall
from specla_hf.runtime.transfer import copy_in, to_device

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

    def clear(self) -> None:
        super().clear()
        self.forwards, self.last_tree = {}, None

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
                        self.forwards[(t, *key[1:])] = self._capture((t, *key[1:]), shaped, cache, None,
                                                                      logits_positions, hidden_layers)
            else:
                self.forwards[key] = self._capture(key, inputs, cache, parents, logits_positions, hidden_layers)
        g = self.forwards[key]
        if g is None:                 # its capture failed (and said so): this call runs eagerly
            self.last_tree = None
            return self.adapter.compute_on_device(inputs, cache, parents, logits_positions, hidden_layers)
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
                        if isinstance(buf, torch.Tensor):
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
            # captured with no accepted node and a path of length 0: the warm-up run then commits nothing (the
            # reference commit reads the node, the kernel the path)
            g.path[0, :2] = torch.tensor([-1, 0])
            g.commit[long] = self.capture(("commit", id(g), long), commit_all, "the commit")
        static = g.commit[long]
        if static is None:
            return False
        g.path[0, :2 + len(path)].copy_(torch.tensor([path[-1], len(path), *path]))
        static.replay()
        cache.discard()
        return True

    def _capture(self, key, inputs, cache, parents, logits_positions, hidden_layers) -> _Forward | None:
        # static buffers on the adapter's device (callers may pass host tensors: replays copy them in)
        device = self.adapter.device
        static_inputs = tree_map(lambda t: t.to(device, copy=True), inputs)
        static_parents = None if parents is None else parents.to(device, copy=True)
        prefix = None
        if parents is not None and cache.num_pending:
            parents_now, ancestors_now, pending_now = cache.pending_refs()
            # (an attention layer's pending entry is a count, not a tensor: kept as it is)
            prefix = (parents_now.clone(), ancestors_now,
                      [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in p) for p in pending_now])
        saved = cache.snapshot()

        def restore():                # outside the recorded region: a copy recorded in a graph would replay each step
            cache.restore(saved)
            if prefix is not None:
                cache.set_pending_refs(prefix)

        def call():
            out = self.adapter.compute(static_inputs, cache, static_parents, logits_positions, hidden_layers)
            return out, (None if parents is None else cache.pending_refs())

        restore()
        static = self.capture(("forward", *key), call, "a forward call", between=restore,
                              python_state=(cache.pending_refs, cache.set_pending_refs))
        restore()                     # undo the warm-up's / recording's effects
        if static is None:
            return None
        return _Forward(static, static_inputs, static_parents, prefix, static.outputs[1])


class GraphedAdapter:
    """An adapter's ``forward`` and ``commit`` over its ``compute``, through its ``graphs`` (a ``ForwardGraphs``, or
    ``None`` for eager calls) and ``bucket_trees`` (pad verified trees to their graph bucket): shared by the adapters
    that capture their calls."""

    graphs: ForwardGraphs | None
    bucket_trees: bool
    model: torch.nn.Module
    built_for: tuple[torch.device, torch.dtype]     # the model's device and dtype when the adapter was built

    @classmethod
    def for_model(cls, model, role: str = "target"):
        """The model's adapter for ``role``, kept on the model (one per role: a model may draft for itself), so that
        captured CUDA graphs serve every generate() call; built again once the model has moved to another device or
        dtype, as graphs and caches are bound to those."""
        key = f"_specla_runner_{role}"
        runner = model.__dict__.get(key)
        if runner is None or runner.built_for != (model.device, model.dtype):
            runner = cls(model, role)
            model.__dict__[key] = runner
        return runner

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _init_graphs(self, cuda_graphs: bool | None, max_seq_tokens: int, bucket_trees: bool | None = None) -> None:
        """``graphs`` (``cuda_graphs``: default on for a model on CUDA), ``bucket_trees`` (default: with graphs) and
        the per-batch-size caches the graphs are bound to."""
        blocker = self.graph_blocker()
        if cuda_graphs and blocker:
            raise ValueError(f"cuda_graphs=True: {blocker}; leave cuda_graphs unset (off for this model)")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not blocker
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {self.device}")
        self.graphs = ForwardGraphs(self, max_seq_tokens=max_seq_tokens) if cuda_graphs else None
        self.bucket_trees = cuda_graphs if bucket_trees is None else bucket_trees
        self._caches = {}

    def graph_blocker(self) -> str | None:
        """Why this adapter's calls cannot be captured, or ``None`` (the default: they can)."""
        return None

    def compute_on_device(self, inputs, cache, parents: torch.Tensor | None, logits_positions: slice | None,
                          hidden_layers: tuple[int, ...]) -> RunnerOutput:
        """``compute`` eagerly, the inputs moved to the adapter's device first (callers may pass host tensors)."""
        on_device = lambda t: to_device(t, self.device)      # noqa: E731
        return self.compute(tree_map(on_device, inputs), cache, None if parents is None else on_device(parents),
                            logits_positions, hidden_layers)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache, parents: torch.Tensor | None = None,
                logits_positions: slice | None = None, hidden_layers: tuple[int, ...] = ()) -> RunnerOutput:
        """Consume ``input_ids [B, T]`` (``parents=None``) or verify them as tree nodes (``parents [B, T]``,
        indices into all pending nodes of the cache, new nodes included). Tree calls return every node's logits."""
        T = num_tokens(input_ids)
        if (parents is None and self.graphs is not None and T > self.graphs.max_seq_tokens
                and batch_size(input_ids) == 1 and not cache.num_pending):
            return self._consume_as_chains(input_ids, cache, logits_positions, hidden_layers)
        if parents is not None:
            if logits_positions not in (None, slice(None)):
                raise ValueError("tree verification returns the logits of every node")
            logits_positions = None
            if self.bucket_trees and tree_bucket(T) <= MAX_TREE_BUCKET:
                pad = tree_bucket(T) - T                       # inert dummy nodes off the committed state
                input_ids = pad_tokens(input_ids, pad)
                parents = F.pad(parents, (0, pad), value=-1)
        if self.graphs is not None and self.graphs.supports(input_ids, parents):
            out = self.graphs.forward(input_ids, cache, parents, logits_positions, hidden_layers)
        else:
            out = self.compute_on_device(input_ids, cache, parents, logits_positions, hidden_layers)
        if parents is not None and num_tokens(input_ids) != T:
            out = RunnerOutput(out.logits[:, :T], tuple(h[:, :T] for h in out.hidden_states))
        return out

    def _consume_as_chains(self, inputs, cache, logits_positions: slice | None,
                           hidden_layers: tuple[int, ...]) -> RunnerOutput:
        """Consume a long input (a prompt) on the graphed path: chunks of ``CHAIN_CHUNK`` tokens, each verified as a
        chain (every node the child of the one before) in the ``CHAIN_CHUNK``-node tree bucket and committed whole,
        one verify and one commit graph replay per chunk (a short last chunk is padded with inert nodes to the same
        bucket: one graph serves every prompt length). Eager, chunked prompt kernels launch a dozen kernels per layer
        from Python. Chain verify + commit is the recurrence (``tests/test_kernels.py``), so this computes what
        consuming the tokens computes up to summation order. Returns the logits at ``logits_positions`` and the
        hidden states of every position, as a consuming call does."""
        T = num_tokens(inputs)
        wanted = range(T) if logits_positions is None else range(T)[logits_positions]
        logits, hidden = [], []
        for start in range(0, T, CHAIN_CHUNK):
            n = min(CHAIN_CHUNK, T - start)
            chunk = pad_tokens(tree_map(lambda x: x[:, start:start + n], inputs), CHAIN_CHUNK - n)
            parents = torch.tensor([list(range(-1, n - 1)) + [-1] * (CHAIN_CHUNK - n)])   # padding: off the state
            out = self.forward(chunk, cache, parents=parents, hidden_layers=hidden_layers)
            # the graph's outputs are overwritten by the next replay: keep copies (of slices: indexing with a host
            # list would copy it to the GPU and stall the host)
            rows = [i - start for i in wanted if start <= i < start + n]
            logits.append((out.logits[:, rows[0]:rows[-1] + 1:wanted.step] if rows else out.logits[:, :0]).clone())
            hidden.append([h[:, :n].clone() for h in out.hidden_states])
            self.commit(cache, list(range(n)))
        return RunnerOutput(torch.cat(logits, 1), tuple(torch.cat(h, 1) for h in zip(*hidden)))

    def commit(self, cache, path: list[int]) -> None:
        """Keep the verified nodes ``path`` (a root-to-node path, root first): one CUDA-graph replay when they came
        from a graphed verify pass, ``cache.commit`` otherwise."""
        if self.graphs is None or not self.graphs.commit(cache, path):
            cache.commit(path[-1])

