"""A fla ``GatedDeltaNetForCausalLM`` driven by SpecLA: consume tokens, verify a token tree, commit a path.

``GDNRunner`` walks the model's own modules (embeddings, norms, MLPs, LM head: fla's Triton on CUDA, our torch path
on CPU) and replaces only the GatedDeltaNet mixer's state handling:
- ``forward(ids, cache)`` consumes tokens straight into the committed state (prefill, autoregressive steps), with
  fla's chunk / fused-recurrent kernels on CUDA, exactly as the stock layer does;
- ``forward(ids, cache, parents=...)`` verifies tree nodes on top of the committed state in one pass per layer
  (tree conv + ancestor-masked delta rule), records their compact factors and leaves the state untouched;
- ``cache.commit(accepted)`` then rebuilds the state after the accepted path from the factors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fla.layers.gated_deltanet as fla_gdn
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.models import GatedDeltaNetForCausalLM
from specla_hf.cache import SpecLACache, SpecLALayer
from specla_hf.cuda_graphs import MAX_TREE_BUCKET, GraphedForward, tree_bucket
from specla_kernels import ops
from specla_kernels.reference import gdn_gate


@dataclass
class RunnerOutput:
    logits: torch.Tensor                       # [B, T, vocab] (fp32 upcast is the caller's choice)
    hidden_states: tuple[torch.Tensor, ...]    # outputs of the requested layers (index 0 = embeddings)


def check_gdn_model(model, role: str = "target") -> None:
    """Raise a clear error for anything this runner cannot drive faithfully."""
    if not isinstance(model, GatedDeltaNetForCausalLM):
        raise TypeError(f"SpecLA needs a flash-linear-attention GatedDeltaNetForCausalLM as the {role}, got "
                        f"{type(model).__name__}. Load it with fla.models.GatedDeltaNetForCausalLM (or AutoModel "
                        "after `import fla`).")
    cfg = model.config
    if getattr(cfg, "attn", None) is not None:
        raise NotImplementedError(f"the {role} mixes attention layers into the GDN stack (config.attn set); hybrid "
                                  "targets are not supported yet")
    if getattr(cfg, "attnres_block_size", None) is not None:
        raise NotImplementedError(f"the {role} uses attention residuals (config.attnres_block_size); not supported")
    if cfg.hidden_act != "swish":
        raise NotImplementedError(f"the {role} uses hidden_act={cfg.hidden_act!r}; SpecLA supports 'swish'")


class GDNRunner:
    """Drive one GDN causal LM over a ``SpecLACache`` (see module docstring).

    ``cuda_graphs`` (default: on when the model is on CUDA) replays captured graphs for decode-path calls and pads
    verified trees to power-of-two buckets with inert dummy nodes (``specla_hf.cuda_graphs``); ``bucket_trees``
    turns the padding on alone (to test it on CPU).
    """

    def __init__(self, model: GatedDeltaNetForCausalLM, role: str = "target", cuda_graphs: bool | None = None,
                 bucket_trees: bool | None = None):
        check_gdn_model(model, role)
        self.model = model
        self.config = model.config
        self.blocks = model.model.layers
        self.mixers: list[GatedDeltaNet] = [block.attn for block in self.blocks]
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {self.device}")
        self.graphs = GraphedForward(self) if cuda_graphs else None
        self.bucket_trees = cuda_graphs if bucket_trees is None else bucket_trees
        self._caches: dict[int, SpecLACache] = {}

    @classmethod
    def for_model(cls, model: GatedDeltaNetForCausalLM, role: str = "target") -> "GDNRunner":
        """The model's runner, kept on the model so that captured CUDA graphs serve every generate() call."""
        key = f"_specla_runner_{role}"     # a model may serve as target and as drafter: one runner (cache) each
        runner = model.__dict__.get(key)
        if runner is None or runner.device != model.device or runner.dtype != model.dtype:
            runner = cls(model, role)
            model.__dict__[key] = runner
        return runner

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch_size: int = 1) -> SpecLACache:
        """A fresh (zero) cache. With CUDA graphs the runner's one cache per batch size is reset and returned: the
        graphs are bound to its tensors, so a runner drives one generation at a time."""
        if self.graphs is not None and batch_size in self._caches:
            cache = self._caches[batch_size]
            cache.reset()
            return cache
        layers = [
            SpecLALayer(batch_size, m.num_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim,
                        2 * m.key_dim + m.value_dim, m.conv_size if m.use_short_conv else None, self.dtype,
                        self.device)
            for m in self.mixers
        ]
        cache = SpecLACache(layers)
        if self.graphs is not None:
            self._caches[batch_size] = cache
        return cache

    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: SpecLACache, parents: torch.Tensor | None = None,
                logits_positions: slice | None = None, hidden_layers: tuple[int, ...] = ()) -> RunnerOutput:
        """Consume ``input_ids [B, T]`` (``parents=None``) or verify them as tree nodes (``parents [B, T]``,
        indices into all pending nodes of the cache, new nodes included). Tree calls return every node's logits."""
        T = input_ids.shape[1]
        if parents is not None:
            if logits_positions not in (None, slice(None)):
                raise ValueError("tree verification returns the logits of every node")
            logits_positions = None
            if self.bucket_trees and tree_bucket(T) <= MAX_TREE_BUCKET:
                pad = tree_bucket(T) - T                       # inert dummy nodes off the committed state
                input_ids = F.pad(input_ids, (0, pad))
                parents = F.pad(parents, (0, pad), value=-1)
        if self.graphs is not None and self.graphs.supports(input_ids, parents):
            out = self.graphs(input_ids, cache, parents, logits_positions, hidden_layers)
        else:
            out = self._forward(input_ids, cache, parents, logits_positions, hidden_layers)
        if parents is not None and input_ids.shape[1] != T:
            out = RunnerOutput(out.logits[:, :T], tuple(h[:, :T] for h in out.hidden_states))
        return out

    def _forward(self, input_ids, cache, parents, logits_positions, hidden_layers) -> RunnerOutput:
        if parents is None:
            cache.advance(input_ids.shape[1])
            all_parents = None
        else:
            all_parents = cache.add_nodes(parents)
        h = self.model.model.embeddings(input_ids)
        hidden = [h] if 0 in hidden_layers else []
        for i, block in enumerate(self.blocks):
            residual = h
            x = self._mixer(i, block.attn_norm(h), cache.layers[i], all_parents)
            if self.config.fuse_norm:
                x, residual = block.mlp_norm(x, residual=residual, prenorm=True)
            else:
                residual = residual + x
                x = block.mlp_norm(residual)
            h = residual + block.mlp(x)
            if i + 1 in hidden_layers:
                hidden.append(h)
        h = self.model.model.norm(h)
        if logits_positions is not None:
            h = h[:, logits_positions]
        return RunnerOutput(self.model.lm_head(h), tuple(hidden))

    def _mixer(self, i: int, h: torch.Tensor, layer: SpecLALayer, parents: torch.Tensor | None) -> torch.Tensor:
        m = self.mixers[i]
        B, T, _ = h.shape
        x = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], -1)          # raw pre-conv inputs
        if not m.use_short_conv:
            y = F.silu(x)
        else:
            # one depthwise conv over the concatenated q|k|v inputs, as fla's fused path does (read from the live
            # parameters on every call, so captured graphs and later weight updates stay in step)
            convs = (m.q_conv1d, m.k_conv1d, m.v_conv1d)
            weight = torch.cat([c.weight[:, 0] for c in convs])
            bias = torch.cat([c.bias for c in convs]) if m.q_conv1d.bias is not None else None
            if parents is None:
                y, window = fla_gdn.causal_conv1d(x=x, weight=weight, bias=bias, initial_state=layer.window,
                                                  output_final_state=True, activation=m.q_conv1d.activation)
                layer.window.copy_(window)
            else:
                x_all = torch.cat([layer.x, x], 1)
                y = ops.tree_conv(x_all, weight, bias, layer.window, parents)[:, -T:]
        q, k, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim], -1)
        q = q.view(B, T, m.num_heads, m.head_k_dim)
        k = k.view(B, T, m.num_heads, m.head_k_dim)
        v = v.view(B, T, m.num_v_heads, m.head_v_dim)
        a, b = m.a_proj(h), m.b_proj(h)

        if parents is None:
            kernel = (fla_gdn.fused_recurrent_gated_delta_rule if T <= 64
                      else fla_gdn.chunk_gated_delta_rule)                     # the stock layer's choice
            o, state = kernel(q=q, k=k, v=v, g=a, beta=b, initial_state=layer.state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=m.A_log,
                              dt_bias=m.dt_bias, use_beta_sigmoid_in_kernel=True,
                              allow_neg_eigval=m.allow_neg_eigval, state_v_first=True)
            layer.state.copy_(state)
        else:
            g = gdn_gate(a, m.A_log, m.dt_bias)
            beta = b.float().sigmoid() * (2.0 if m.allow_neg_eigval else 1.0)
            prefix = (layer.k_hat, layer.u, layer.g) if layer.k_hat.shape[1] else None
            o, k_hat, u = ops.tree_gated_delta_rule(q, k, v, g, beta, parents, layer.state, prefix=prefix)
            layer.add_factors(k_hat, u, g, x)

        if m.use_gate:
            gate = m.g_proj(h).view(B, T, m.num_v_heads, m.head_v_dim)
            o = m.o_norm(o.to(h.dtype), gate)
        else:
            o = m.o_norm(o.to(h.dtype))
        return m.o_proj(o.reshape(B, T, m.value_dim))
