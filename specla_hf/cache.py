"""``SpecLACache``: a transformers ``Cache`` holding, per layer, the committed state and the draft nodes verified on
top of it since the last commit.

A GDN layer (``SpecLALayer``) keeps its recurrent state, its conv window and, per pending node, the compact factors
``k_hat [H, K]``, ``u [HV, V]``, the log-decay ``g [HV]`` and the raw pre-conv inputs: a verify pass leaves the
committed state untouched, and ``commit`` rebuilds the state after the accepted root-to-node path with one
rank-|path| update (``docs/kernels.md``). Nothing stores a state per draft node. A hybrid model's full-attention
layer (``SpecLAAttentionLayer``) keeps the committed keys and values followed by the pending nodes', its committed
length as a device tensor, and commits by moving the accepted path's entries down on the device, every attention
layer's keys and values in one launch (``ops.commit_kv_``).

The cache holds no position count on the host: the decoding loop owns it (a commit recorded in a CUDA graph cannot
tell the host how many tokens it kept).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specla_kernels import ops
from specla_kernels.commit import root_path


class SpecLALayer(CacheLayerMixin):
    """One GDN layer: committed ``state [B, HV, V, K]`` (fp32), ``window [B, D, W]`` (raw q|k|v inputs, newest
    last, fla's layout) and the pending nodes' factors."""

    is_compileable = False

    def __init__(self, batch_size: int, num_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_dim: int, conv_size: int | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.state = torch.zeros(batch_size, num_v_heads, head_v_dim, head_k_dim, dtype=torch.float32, device=device)
        self.window = (torch.zeros(batch_size, conv_dim, conv_size, dtype=dtype, device=device)
                       if conv_size else None)
        self.k_hat = torch.empty(batch_size, 0, num_heads, head_k_dim, dtype=torch.float32, device=device)
        self.u = torch.empty(batch_size, 0, num_v_heads, head_v_dim, dtype=torch.float32, device=device)
        self.g = torch.empty(batch_size, 0, num_v_heads, dtype=torch.float32, device=device)
        self.x = torch.empty(batch_size, 0, conv_dim, dtype=dtype, device=device)
        self._none_pending = (self.k_hat, self.u, self.g, self.x)
        self.device, self.batch_size = device, batch_size
        self.is_initialized = True

    # ---- factors of the pending (verified, not yet committed) nodes ----
    def add_factors(self, k_hat: torch.Tensor, u: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
        if not self.k_hat.shape[1]:          # a fresh tree (every target step): keep the tensors, no copies
            self.k_hat, self.u, self.g, self.x = k_hat, u, g, x.contiguous()
            return
        self.k_hat = torch.cat([self.k_hat, k_hat], 1)
        self.u = torch.cat([self.u, u], 1)
        self.g = torch.cat([self.g, g], 1)
        self.x = torch.cat([self.x, x], 1)

    def conv_and_gates(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, parents: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor | None, allow_neg_eigval: bool = False) -> tuple[torch.Tensor, ...]:
        """New tree nodes' short conv (SiLU) after the pending ones and their gates, one launch on a GPU
        (``ops.tree_conv_gates``): ``(x, y, g, beta)``, ``x`` the nodes' raw q|k|v inputs made contiguous (the
        factors keep it), ``y`` their conv outputs. ``x``, ``a``, ``b``: column slices of the input projection,
        read in place."""
        if not self.x.shape[1]:               # a fresh tree (every decoding step): the contiguous copy on the way
            x_slice, x = x, x.new_empty(x.shape)
            y, g, beta = ops.tree_conv_gates(x_slice, weight, bias, self.window, parents, a, b, A_log, dt_bias,
                                             allow_neg_eigval, x_out=x)
            return x, y, g, beta
        x = x.contiguous()
        y, g, beta = ops.tree_conv_gates(torch.cat([self.x, x], 1), weight, bias, self.window, parents, a, b, A_log,
                                         dt_bias, allow_neg_eigval)
        return x, y[:, -x.shape[1]:], g, beta

    def pending(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the pending nodes (references: a CUDA graph's outputs become them after a replay)."""
        return self.k_hat, self.u, self.g, self.x

    def set_pending(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.k_hat, self.u, self.g, self.x = tensors

    def drop_pending(self) -> None:
        # the empty tensors made once: every step discards, and slicing 4 x layers tensors costs host time
        self.set_pending(self._none_pending)

    def committed(self) -> tuple[torch.Tensor, ...]:
        """The committed tensors, written in place (graphs hold their addresses)."""
        return (self.state,) if self.window is None else (self.state, self.window)

    def factor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pending())

    # ---- CacheLayerMixin interface: this layer is driven by a SpecLA adapter, not by a model's forward ----
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        pass  # allocated eagerly in __init__, with the model's shapes

    def update(self, *args, **kwargs):
        raise TypeError("SpecLACache is advanced by SpecLA's decoding loop (specla_hf.models.adapter_for); it cannot "
                        "be passed as `past_key_values` to a model forward. Use model.generate(..., "
                        "assistant_model=...).")

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return 0, 0  # a recurrent layer takes no attention mask

    def get_seq_length(self, *args, **kwargs) -> int:
        raise TypeError("a SpecLACache counts no positions: the decoding loop does")

    def get_max_length(self) -> int:
        return -1  # no sequence dimension

    def reset(self) -> None:
        for t in self.committed():
            t.zero_()
        self.drop_pending()


class SpecLAAttentionLayer(CacheLayerMixin):
    """One full-attention layer of a hybrid model: keys and values in one buffer per tensor ``[B, KV heads,
    capacity, head dim]``, the committed positions first (``length [B]``, a device tensor), then the pending nodes'
    (each verified node's, in node order). The attention module reads the whole buffer under a mask built on the
    device from ``length`` (``specla_hf.models.tree_attention``), new entries are scattered to ``length + i`` and a
    commit moves the accepted path's entries down on the device: nothing the host holds changes with the committed
    length, so every call is capturable in a CUDA graph.

    A ``fixed`` layer keeps its capacity (graphs hold its buffers' addresses): its owner reserves what a generation
    needs. Otherwise the buffers grow on the host, judged from ``bound``, a host upper bound of the committed length
    (tightened by reading ``length`` only when the bound says the buffer may be too small)."""

    is_compileable = False

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 64, fixed: bool = False):
        super().__init__()
        # zeros: unused positions are masked, and a masked weight (0) times a NaN left in memory would still be NaN
        self.key_buffer = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.value_buffer = torch.zeros_like(self.key_buffer)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)      # committed positions
        self.num_pending = 0
        self.fixed, self.bound = fixed, 0
        self.device, self.batch_size = device, batch_size
        # cos|sin of positions 0..capacity-1 [2, capacity, rotary dim] (``tree_attention.rotary_rows``): kept with
        # the buffers, since graphs captured over them hold its address too
        self.rotary_table: torch.Tensor | None = None
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, pending: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``keys``, ``values`` ``[B, KV heads, T, head dim]`` after the positions held, as pending nodes or
        (``pending=False``) straight into the committed ones; returns the whole buffers (the caller masks them)."""
        if not pending and self.num_pending:
            raise RuntimeError("commit or discard the pending draft nodes before consuming tokens directly")
        T = keys.shape[2]
        self.make_room(self.num_pending + T)
        slots = self.length[:, None] + torch.arange(self.num_pending, self.num_pending + T, device=self.device)
        for buffer, new in ((self.key_buffer, keys), (self.value_buffer, values)):
            buffer.scatter_(2, self._expand(slots), new)
        self.stored(T, pending)
        return self.key_buffer, self.value_buffer

    def stored(self, T: int, pending: bool) -> None:
        """``T`` keys and values were written after the positions held (``make_room`` first), as pending nodes or
        committed positions: by ``append``, or by a kernel that writes them itself (``ops.qk_norm_rope_append``)."""
        if pending:
            self.num_pending += T
        else:
            self.length.add_(T)
            self.bound += T

    def path_committed(self, width: int) -> None:
        """The host's side of a commit (``SpecLACache.commit`` moves the entries and advances ``length`` on the
        device, ``ops.commit_kv_``): a path of at most ``width`` nodes was kept, the other pending nodes dropped."""
        self.bound += width
        self.num_pending = 0

    def _expand(self, slots: torch.Tensor) -> torch.Tensor:
        B, H, _, D = self.key_buffer.shape
        return slots[:, None, :, None].expand(B, H, slots.shape[1], D)

    def make_room(self, needed: int) -> None:
        """Room for ``needed`` positions after the committed ones: a fixed layer has it by its owner's reservation;
        a growing one grows here, on the host (so it refuses to be captured)."""
        if self.fixed or self.bound + needed <= self.capacity:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this attention cache grows on the host and cannot be captured in a CUDA graph")
        self.bound = int(self.length.max())
        if self.bound + needed <= self.capacity:
            return
        capacity = max(self.bound + needed, 2 * self.capacity)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def committed_length(self) -> int:
        """The committed length on the host (one read of the device tensor); the same for every sequence."""
        lengths = set(self.length.tolist())
        if len(lengths) != 1:
            raise ValueError(f"sequences hold different committed lengths {sorted(lengths)}")
        return lengths.pop()

    def drop_pending(self) -> None:
        self.num_pending = 0

    def pending(self) -> tuple:
        """How many pending entries follow the committed ones (their keys and values are in the buffers)."""
        return (self.num_pending,)

    def set_pending(self, pending: tuple) -> None:
        (self.num_pending,) = pending

    def committed(self) -> tuple[torch.Tensor, ...]:
        return self.key_buffer, self.value_buffer, self.length

    def factor_bytes(self) -> int:
        B, H, _, D = self.key_buffer.shape
        return 2 * B * H * self.num_pending * D * self.key_buffer.element_size()

    # ---- CacheLayerMixin interface: this layer is driven by a SpecLA adapter, not by a model's forward ----
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        pass  # allocated in __init__

    def update(self, *args, **kwargs):
        raise TypeError("SpecLACache is advanced by specla_hf's decoding loop through a model adapter; it cannot be "
                        "passed as `past_key_values` to a model forward. Use model.generate(..., assistant_model=...).")

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.committed_length() + query_length, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.committed_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length.zero_()
        self.num_pending = self.bound = 0


class SpecLACache(Cache):
    """Per-layer committed state and pending nodes, and the pending nodes' tree: ``parents [B, N]`` (indices into
    the pending nodes, -1 for the committed state) and its ancestor mask ``ancestors [B, N, N]``, built once per
    verify pass (every layer's verify and the commit read it)."""

    def __init__(self, layers: list):
        super().__init__(layers=layers)
        first = layers[0]
        self.parents = self._no_parents = torch.empty(first.batch_size, 0, dtype=torch.long, device=first.device)
        self.ancestors = self._no_ancestors = torch.empty(first.batch_size, 0, 0, dtype=torch.bool,
                                                          device=first.device)
        # the recurrent layers commit together (one launch), the attention layers too (``ops.commit_kv_``)
        self.recurrent = [layer for layer in layers if isinstance(layer, SpecLALayer)]
        self.others = [layer for layer in layers if not isinstance(layer, SpecLALayer)]

    @property
    def num_pending(self) -> int:
        return self.parents.shape[1]

    def get_seq_length(self, *args, **kwargs) -> int:
        raise TypeError("a SpecLACache counts no positions: the decoding loop does")

    def add_nodes(self, parents: torch.Tensor) -> torch.Tensor:
        """Append nodes with ``parents`` (indices into all pending nodes); returns all pending parents."""
        self.parents = torch.cat([self.parents, parents], 1)
        self.ancestors = ops.tree_ancestors(self.parents)
        return self.parents

    def commit_operands(self) -> dict[str, tuple[list[torch.Tensor], ...] | None]:
        """The ``states`` and ``windows`` arguments of ``ops.commit_`` for every recurrent layer's pending nodes."""
        layers = self.recurrent
        if not layers:
            return dict(states=None, windows=None)
        return dict(states=tuple([getattr(l, name) for l in layers] for name in ("state", "k_hat", "u", "g")),
                    windows=None if layers[0].window is None else ([l.x for l in layers], [l.window for l in layers]))

    def commit(self, accepted: torch.Tensor | int, path: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep the root-to-``accepted`` path of the pending nodes (index per sequence; -1 keeps none) and drop the
        rest. ``path = (nodes [B, P], length [B])``, that path root first, when the caller has it on the device (the
        acceptance does), saves reading it off the ancestor mask."""
        B = self.parents.shape[0]
        if isinstance(accepted, int):
            accepted = torch.full((B,), accepted, dtype=torch.long, device=self.parents.device)
        if self.others and path is None:
            path = root_path(self.ancestors, accepted)
        if self.recurrent:
            ops.commit_(self.parents, accepted, ancestors=self.ancestors, path=path, **self.commit_operands())
        if self.others:
            width = path[0].shape[1]
            for layer in self.others:
                layer.make_room(width)
            ops.commit_kv_(*path, *([getattr(l, name) for l in self.others]
                                    for name in ("key_buffer", "value_buffer", "length")))
            for layer in self.others:
                layer.path_committed(width)
        self.discard()

    def check_consumable(self) -> None:
        if self.num_pending:
            raise RuntimeError("commit or discard the pending draft nodes before consuming tokens directly")

    def discard(self) -> None:
        """Drop the pending nodes without committing any (the committed state is untouched: nothing to run)."""
        for layer in self.layers:
            layer.drop_pending()
        self.parents, self.ancestors = self._no_parents, self._no_ancestors

    # ---- what CUDA graphs and their emulation need to know of the cache ----
    def pending_refs(self) -> tuple:
        """Python-side references to the pending nodes (a real graph replay leaves them; see ``StaticCall``)."""
        return self.parents, self.ancestors, [layer.pending() for layer in self.layers]

    def set_pending_refs(self, refs: tuple) -> None:
        self.parents, self.ancestors, pending = refs
        for layer, tensors in zip(self.layers, pending):
            layer.set_pending(tensors)

    def snapshot(self) -> tuple:
        """The pending references and a copy of every committed tensor (``restore`` puts both back in place)."""
        return self.pending_refs(), [tuple(t.clone() for t in layer.committed()) for layer in self.layers]

    def restore(self, snapshot: tuple) -> None:
        refs, committed = snapshot
        self.set_pending_refs(refs)
        for layer, saved in zip(self.layers, committed):
            for t, s in zip(layer.committed(), saved):
                t.copy_(s)

    def factor_bytes(self) -> int:
        return sum(layer.factor_bytes() for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.parents, self.ancestors = self._no_parents, self._no_ancestors
