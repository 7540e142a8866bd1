"""CUDA graphs for every decode-path call of a ``GDNRunner``.

At batch 1 an eager GDN forward is bound by kernel-launch overhead (~15-20x slower than graph replay on the H200),
so each distinct call shape is captured once and replayed:
- consuming ``T <= MAX_SEQ_TOKENS`` tokens (autoregressive steps, a drafter catching up); longer inputs (prompts)
  are consumed by ``GDNRunner`` as chains of ``CHAIN_CHUNK`` tree nodes, verified and committed (the graphs below);
- verifying tree nodes, padded to a power-of-two bucket with dummy nodes that hang off the committed state
  (``parents = -1``): no real node descends from them, so real outputs are unchanged and they are never accepted.
A graph reads its inputs (token ids, or any tuple of ``[B, T, ...]`` tensors: a drafter's features and tokens) from
static buffers and writes the cache in place (state, window) or to its own outputs (the new pending factors, which
become the cache's pending tensors after replay). A graph is bound to one cache's tensors: the runner keeps a single
cache per batch size and ``GDNRunner.new_cache`` resets it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_SEQ_TOKENS = 4
DRAFT_SEQ_TOKENS = 16   # a drafter catching up after a step consumes up to draft depth + 1 tokens: graph those too
MAX_TREE_BUCKET = 128
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


_staging: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that does not stall the host when ``src`` is a host tensor and ``dst`` a CUDA one: a plain
    copy from pageable memory synchronises the stream (the host waits for all queued GPU work); this one goes through
    a pinned twin of ``dst`` kept for the next call (allocating pinned memory per call costs more host time than the
    copy), queued like a kernel. The twin is rewritten only once its last copy has run (an event)."""
    if not (dst.is_cuda and not src.is_cuda):
        dst.copy_(src)
        return
    key = (dst.data_ptr(), tuple(dst.shape), dst.dtype)
    if key not in _staging:
        if len(_staging) >= 256:          # destinations are static buffers; many means runners came and went
            for _, done in _staging.values():
                done.synchronize()
            _staging.clear()
        _staging[key] = (torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True), torch.cuda.Event())
    twin, done = _staging[key]
    done.synchronize()               # returns at once unless the previous copy is still queued
    twin.copy_(src)
    dst.copy_(twin, non_blocking=True)
    done.record()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` without stalling the host for a host-to-GPU copy (see ``copy_in``)."""
    if device.type == "cuda" and not t.is_cuda:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostCopy:
    """A device tensor's copy into pinned host memory, queued like a kernel behind the work before it (an event on
    CUDA): ``read`` waits for that copy only, not for work queued after it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty(shape, dtype=dtype, pin_memory=cuda)
        self.ready = torch.cuda.Event() if cuda else None

    def queue(self, src: torch.Tensor) -> None:
        self.host.copy_(src, non_blocking=True)
        if self.ready is not None:
            self.ready.record()

    def read(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


def tree_bucket(n: int) -> int:
    """Smallest power of two >= n (so a handful of graphs serve every tree size)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph | EmulatedGraph"
    inputs: object                  # static copies of the call's input tensors
    parents: torch.Tensor | None
    prefix: tuple | None            # static copies of the pending parents and factors the call extends
    out: object                     # RunnerOutput of the captured call
    pending: tuple | None           # (cache.parents, cache.ancestors, [(k_hat, u, g, x) per layer]) after the call
    commit: dict | None = None      # a tree call's commit graphs (captured on first use) by path length > one chunk
    path: torch.Tensor | None = None    # and the path they commit


class GraphedForward:
    """Capture-on-first-use and replay of ``runner._forward`` keyed by call shape (see module docstring).

    ``emulate=True`` swaps CUDA graphs for ``EmulatedGraph`` so that the capture/replay bookkeeping runs (and is
    tested) on CPU.
    """

    def __init__(self, runner, emulate: bool = False, max_seq_tokens: int = MAX_SEQ_TOKENS):
        self.runner = runner
        self.emulate = emulate
        self.max_seq_tokens = max_seq_tokens
        # each graph gets its own memory pool: the outputs of one (e.g. the target's pending factors) must survive
        # the replays of others (the drafter's) until they are committed
        self.graphs: dict[tuple, _Graph] = {}
        self.last_tree: _Graph | None = None     # the tree graph whose outputs are the cache's pending nodes

    def supports(self, inputs, parents: torch.Tensor | None) -> bool:
        T = num_tokens(inputs)
        return batch_size(inputs) == 1 and (T <= self.max_seq_tokens if parents is None else T <= MAX_TREE_BUCKET)

    def __call__(self, inputs, cache, parents, logits_positions, hidden_layers):
        key = (num_tokens(inputs), None if parents is None else cache.num_pending,
               _slice_key(logits_positions), tuple(hidden_layers))
        if key not in self.graphs:
            if parents is None:
                # every sequence length this runner graphs, at once: a length first seen mid-generation (a drafter
                # catching up after a long accepted path) would otherwise put a capture into that step
                for t in range(1, self.max_seq_tokens + 1):
                    if (t, *key[1:]) not in self.graphs:
                        shaped = tree_map(lambda x: x.new_zeros(x.shape[0], t, *x.shape[2:]), inputs)
                        self.graphs[(t, *key[1:])] = self._capture(shaped, cache, None, logits_positions,
                                                                    hidden_layers)
            else:
                self.graphs[key] = self._capture(inputs, cache, parents, logits_positions, hidden_layers)
        g = self.graphs[key]
        for buf, x in zip(tree_flatten(g.inputs)[0], tree_flatten(inputs)[0]):
            copy_in(buf, x)
        if parents is not None:
            copy_in(g.parents, parents)
            if g.prefix is not None:
                prefix_parents, prefix_factors = g.prefix
                prefix_parents.copy_(cache.parents)
                for layer, bufs in zip(cache.layers, prefix_factors):
                    for buf, t in zip(bufs, (layer.k_hat, layer.u, layer.g, layer.x)):
                        buf.copy_(t)
        g.graph.replay()
        if parents is None:
            cache.seq_length += num_tokens(inputs)
        else:
            cache.parents, cache.ancestors, factors = g.pending
            for layer, (k_hat, u, gate, x) in zip(cache.layers, factors):
                layer.k_hat, layer.u, layer.g, layer.x = k_hat, u, gate, x
            self.last_tree = g
        return g.out

    def commit(self, cache, path: list[int]) -> bool:
        """``cache.commit`` of the pending nodes ``path`` (root first) of the last tree call as one graph replay (the
        commit kernel reads that graph's static outputs); False, doing nothing, if the cache holds other nodes."""
        g = self.last_tree
        if g is None or cache.parents is not g.pending[0]:
            return False
        from specla_kernels import commit as commit_kernels, ops
        parents, ancestors, _ = g.pending
        # two graphs: one for paths of up to one chunk of nodes, whose kernel has no loop over further chunks (fewer
        # registers: 49.4 against 51.8 us for 21 layers, session 25), and one for longer paths
        long = len(path) > commit_kernels.PATH_CHUNK
        if g.path is None:
            # the accepted node, the path's length, then its nodes: what the host writes before each replay, one copy
            g.path, g.commit = torch.zeros(1, 2 + parents.shape[1], dtype=torch.long, device=parents.device), {}
        if long not in g.commit:
            operands = cache.commit_operands()          # the cache holds this graph's outputs as its pending nodes
            nodes = g.path[:, 2:] if long else g.path[:, 2:2 + commit_kernels.PATH_CHUNK]

            def commit_all():
                ops.commit_(parents, g.path[0, :1], ancestors=ancestors, path=(nodes, g.path[:, 1]), **operands)
            # captured with a path of length 0: the warm-up run inside `capture` then commits nothing
            g.path[0, 1] = 0
            g.commit[long] = capture_or_warn(commit_all, "the commit", "committing eagerly", self.emulate)
        graph = g.commit[long]
        if graph is None:
            return False
        g.path[0, :2 + len(path)].copy_(torch.tensor([path[-1], len(path), *path]))
        graph.replay()
        cache.discard()
        cache.seq_length += len(path)
        return True

    def _capture(self, inputs, cache, parents, logits_positions, hidden_layers) -> _Graph:
        # static buffers on the runner's device (callers may pass host tensors: replays copy them in)
        device = self.runner.device
        static_inputs = tree_map(lambda t: t.to(device, copy=True), inputs)
        static_parents = None if parents is None else parents.to(device, copy=True)
        prefix = None
        if parents is not None and cache.num_pending:
            prefix = (cache.parents.clone(), [tuple(t.clone() for t in (l.k_hat, l.u, l.g, l.x)) for l in cache.layers])
        saved = _snapshot(cache)

        def call():
            out = self.runner._forward(static_inputs, cache, static_parents, logits_positions, hidden_layers)
            pending = None if parents is None else (cache.parents, cache.ancestors,
                                                    [(l.k_hat, l.u, l.g, l.x) for l in cache.layers])
            return out, pending

        # the restores stay OUTSIDE the captured region: a copy recorded in a graph would be replayed on every step
        _restore(cache, saved, prefix)
        if self.emulate:
            graph = EmulatedGraph()
            out, pending = graph.capture(call, cache)
        else:
            recorded = {}                            # the recorded call's outputs (the warm-up's are overwritten)
            graph = capture(lambda: recorded.update(result=call()), between=lambda: _restore(cache, saved, prefix))
            out, pending = recorded["result"]
        _restore(cache, saved, prefix)               # undo the warm-up / Python-side effects of the capture
        return _Graph(graph, static_inputs, static_parents, prefix, out, pending)


class _Rerun:
    """CPU stand-in for a captured graph of a function that only reads and writes static tensors: a replay is a
    re-run (``capture``'s ``emulate``)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def capture(fn, emulate: bool = False, between=None):
    """A CUDA graph of ``fn()`` (no arguments; reads and writes static tensors only), after one warm-up run on a
    side stream (Triton compile/autotune, cuBLAS handles): ``fn`` must tolerate running twice. ``between()``, if
    given, runs after the warm-up and before the recording, outside the graph (e.g. undoing the warm-up's effects)."""
    if emulate:
        return _Rerun(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    if between is not None:
        between()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def capture_or_warn(fn, what: str, fallback: str, emulate: bool = False, between=None):
    """``capture(fn)``, or ``None`` with a warning if capturing fails: a failed capture costs speed, not correctness
    (the caller runs ``fn``'s work eagerly instead)."""
    try:
        return capture(fn, emulate=emulate, between=between)
    except Exception as e:  # noqa: BLE001 - any capture failure: say so, go eager
        warnings.warn(f"SpecLA: capturing {what} in a CUDA graph failed ({type(e).__name__}: {str(e)[:200]}); "
                      f"{fallback} (slower)", RuntimeWarning)
        return None


class EmulatedGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` (tests): a replay re-runs the captured call on the capture-time
    Python-side inputs and writes its tensors into the captured outputs, then undoes its Python-side effects, as a
    real replay (which runs only the recorded kernels) has none."""

    def capture(self, fn, cache):
        self.fn, self.cache = fn, cache
        self.inputs = _python_side(cache)
        self.result = fn()
        return self.result

    def replay(self) -> None:
        now = _python_side(self.cache)
        _set_python_side(self.cache, self.inputs)
        new = self.fn()
        for dst, src in zip(tree_flatten(_plain(self.result))[0], tree_flatten(_plain(new))[0]):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        _set_python_side(self.cache, now)


def _plain(result):
    out, pending = result
    return (out.logits, out.hidden_states), pending


def _python_side(cache) -> tuple:
    return cache.seq_length, cache.parents, cache.ancestors, [(l.k_hat, l.u, l.g, l.x) for l in cache.layers]


def _set_python_side(cache, side) -> None:
    cache.seq_length, cache.parents, cache.ancestors, factors = side
    for layer, (k_hat, u, g, x) in zip(cache.layers, factors):
        layer.k_hat, layer.u, layer.g, layer.x = k_hat, u, g, x


def _slice_key(s: slice | None):
    return None if s is None else (s.start, s.stop, s.step)


def _snapshot(cache) -> tuple:
    return (cache.seq_length, cache.parents, cache.ancestors,
            [(l.state.clone(), None if l.window is None else l.window.clone(), l.k_hat, l.u, l.g, l.x)
             for l in cache.layers])


def _restore(cache, saved, prefix) -> None:
    """Put the cache back as it was before a warm-up/capture (state and window in place: graphs hold their
    addresses); with ``prefix``, the pending factors are the graph's static prefix buffers."""
    seq_length, parents, ancestors, layers = saved
    cache.seq_length = seq_length
    cache.parents = parents if prefix is None else prefix[0]
    cache.ancestors = ancestors          # the prefix's too (a graph's add_nodes rebuilds them from the parents)
    for i, (layer, (state, window, k_hat, u, g, x)) in enumerate(zip(cache.layers, layers)):
        layer.state.copy_(state)
        if window is not None:
            layer.window.copy_(window)
        layer.k_hat, layer.u, layer.g, layer.x = (k_hat, u, g, x) if prefix is None else prefix[1][i]
