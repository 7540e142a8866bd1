"""A fla ``GatedDeltaNetForCausalLM`` driven by SpecLA: consume tokens, verify a token tree, commit a path.

``GDNRunner`` walks the model's own modules (embeddings, norms, MLPs, LM head: fla's Triton on CUDA, our torch path
on CPU) and replaces only the GatedDeltaNet mixer's state handling:
- ``forward(ids, cache)`` consumes tokens straight into the committed state (prefill, autoregressive steps), with
  fla's chunk / fused-recurrent kernels on CUDA, exactly as the stock layer does (with CUDA graphs, inputs longer
  than the graphed sequence calls, i.e. prompts, are verified and committed as chains instead: ``_consume_as_chains``);
- ``forward(ids, cache, parents=...)`` verifies tree nodes on top of the committed state in one pass per layer
  (tree conv + ancestor-masked delta rule), records their compact factors and leaves the state untouched;
- ``cache.commit(accepted)`` then rebuilds the state after the accepted path from the factors.

A batch-1 decode step is bound by its kernel count, so each layer's input projections (q|k|v|g|a|b), short
convolutions and MLP gate|up run as one GEMM / conv each, against fused weights whose rows the model's parameters
are views of (``fuse_mixer_weights``). A one-token step of batch 1 (autoregressive decoding, a drafter's steps) goes
further (``_decode_step``): four GEMVs per layer with the norms, residual adds, short conv and SwiGLU fused around
them (``specla_kernels.gemv``) and the recurrence updating the state in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fla.layers.gated_deltanet as fla_gdn
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.models import GatedDeltaNetForCausalLM
from fla.modules import FusedRMSNormGated, GatedMLP, RMSNorm
from specla_hf.models import fla_backend as backend
from specla_hf.cache import SpecLACache, SpecLALayer
from specla_hf.models.base import RunnerOutput, embed
from specla_hf.models.graphed import DRAFT_SEQ_TOKENS, MAX_SEQ_TOKENS, GraphedAdapter
from specla_hf.models.one_token import fusable_gated_head, fused_rows, fused_tree_pass, product, recurrent_step_
from specla_kernels import ops
from specla_kernels.gemv import MAX_K as GEMV_MAX_K


def fuse_mixer_weights(m: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A mixer's fused weights (see ``fused_rows``; idempotent): the input projections ``[q|k|v|g|a|b, hidden]``
    (no g rows without ``use_gate``) and the q|k|v depthwise conv's weight ``[conv_dim, conv_size]`` and bias
    (``None`` without a short conv / conv bias)."""
    projs = [m.q_proj, m.k_proj, m.v_proj] + ([m.g_proj] if m.use_gate else []) + [m.a_proj, m.b_proj]
    proj = fused_rows(m, "_specla_fused_proj", [p.weight for p in projs], pad_to=64)
    if not m.use_short_conv:
        return proj, None, None
    convs = [m.q_conv1d, m.k_conv1d, m.v_conv1d]
    weight = fused_rows(m, "_specla_fused_conv_weight", [c.weight for c in convs])[:, 0]   # [D, 1, W] -> [D, W]
    bias = fused_rows(m, "_specla_fused_conv_bias", [c.bias for c in convs]) if m.q_conv1d.bias is not None else None
    return proj, weight, bias


def fuse_mlp_weights(mlp: GatedMLP) -> torch.Tensor:
    """An MLP's gate_proj and up_proj rows as one ``[gate | up, hidden]`` weight (see ``fused_rows``; idempotent)."""
    return fused_rows(mlp, "_specla_fused_gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight])


def projection_columns(m: GatedDeltaNet, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Column views of a mixer's fused input projection output (``[..., rows]``): the raw q|k|v conv inputs, the
    output gate (empty without ``use_gate``), and the decay and write-strength inputs ``a``, ``b``."""
    sizes = [2 * m.key_dim + m.value_dim, m.value_dim if m.use_gate else 0, m.num_v_heads, m.num_v_heads]
    return torch.split(projected, sizes + [projected.shape[-1] - sum(sizes)], -1)[:4]


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


def plain_norm(norm) -> bool:
    """A fla ``RMSNorm`` with a weight and no bias."""
    return isinstance(norm, RMSNorm) and norm.weight is not None and norm.bias is None


def fused_block(block) -> bool:
    """Whether the fused paths (``GDNRunner._decode_step``, ``_fused_layer``) compute this fla GatedDeltaNet block:
    fla's default layout (bias-free RMSNorms and projections, short conv with SiLU, swish-gated output norm with
    power-of-two heads of at least 16, SwiGLU MLP)."""
    m, mlp = block.attn, block.mlp
    return (m.use_short_conv and m.use_gate and m.q_conv1d.activation in ("silu", "swish")
            and isinstance(m.o_norm, FusedRMSNormGated) and m.o_norm.weight is not None
            and getattr(m.o_norm, "bias", None) is None and m.o_norm.activation in ("swish", "silu")
            and fusable_gated_head(m.head_v_dim)
            and plain_norm(block.attn_norm) and plain_norm(block.mlp_norm) and mlp.hidden_act == "swish"
            and all(lin.bias is None for lin in (m.q_proj, m.k_proj, m.v_proj, m.g_proj, m.a_proj, m.b_proj,
                                                 m.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)))


def supports_fused_step(model: GatedDeltaNetForCausalLM) -> bool:
    """Whether ``GDNRunner._decode_step`` computes this model's one-token step: fused blocks (``fused_block``) with
    fla's fused pre-norm residual adds, inputs of at most 16384 features. Other models take the general path."""
    blocks = model.model.layers
    widths = [model.config.hidden_size] + [b.attn.value_dim for b in blocks] + [b.mlp.down_proj.in_features
                                                                                for b in blocks]
    if max(widths) > GEMV_MAX_K:          # the GEMVs hold their whole input in registers
        return False
    return (all(map(fused_block, blocks)) and model.config.fuse_norm and plain_norm(model.model.norm)
            and model.lm_head.bias is None)


class GDNRunner(GraphedAdapter):
    """Drive one GDN causal LM over a ``SpecLACache`` (see module docstring).

    ``cuda_graphs`` (default: on when the model is on CUDA) replays captured graphs for decode-path calls and pads
    verified trees to power-of-two buckets with inert dummy nodes (``specla_hf.models.graphed``); ``bucket_trees``
    turns the padding on alone (to test it on CPU).
    """

    def __init__(self, model: GatedDeltaNetForCausalLM, role: str = "target", cuda_graphs: bool | None = None,
                 bucket_trees: bool | None = None):
        check_gdn_model(model, role)
        self.model = model
        self.config = model.config
        self.built_for = (model.device, model.dtype)
        self.blocks = model.model.layers
        self.mixers: list[GatedDeltaNet] = [block.attn for block in self.blocks]
        self._init_graphs(cuda_graphs, DRAFT_SEQ_TOKENS if role == "drafter" else MAX_SEQ_TOKENS, bucket_trees)
        self.fused_step = supports_fused_step(model)   # tests turn it off to compare with the general path
        self._fuse_weights()

    def _fuse_weights(self) -> None:
        """Fuse the blocks' weights now, before any graph reads the parameters (``one_token.fused_rows``)."""
        for m, block in zip(self.mixers, self.blocks):
            fuse_mixer_weights(m)
            if block.mlp.hidden_act == "swish":
                fuse_mlp_weights(block.mlp)

    def new_cache(self, batch_size: int = 1, max_length: int | None = None) -> SpecLACache:
        """A fresh (zero) cache (a recurrent state: ``max_length`` asks for nothing). With CUDA graphs the runner's
        one cache per batch size is reset and returned: the graphs are bound to its tensors, so a runner drives one
        generation at a time."""
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
    def compute(self, input_ids, cache, parents, logits_positions, hidden_layers) -> RunnerOutput:
        if (self.fused_step and parents is None and not hidden_layers and isinstance(input_ids, torch.Tensor)
                and input_ids.shape == (1, 1)):
            logits = self._decode_step(input_ids, cache)
            return RunnerOutput(logits if logits_positions is None else logits[:, logits_positions], ())
        if parents is None:
            cache.check_consumable()
            all_parents = None
        else:
            all_parents = cache.add_nodes(parents)
            if self.fused_step and fused_tree_pass(*input_ids.shape):
                return self._verify_fused(input_ids, cache, all_parents, logits_positions, hidden_layers)
        residual = embed(self.model.model.embeddings, input_ids)
        hidden = [residual] if 0 in hidden_layers else []
        out = None                            # the last block's MLP output, not yet added to the residual stream
        for i, block in enumerate(self.blocks):
            if out is None:
                x = block.attn_norm(residual)
            else:
                x, residual = self._add_norm(block.attn_norm, out, residual)
                if i in hidden_layers:
                    hidden.append(residual)
            x, residual = self._add_norm(block.mlp_norm, self._mixer(i, x, cache.layers[i], all_parents,
                                                                     cache.ancestors), residual)
            out = self._mlp(i, x)
        x, residual = self._add_norm(self.model.model.norm, out, residual)
        if len(self.blocks) in hidden_layers:
            hidden.append(residual)
        if logits_positions is not None:
            x = x[:, logits_positions]
        return RunnerOutput(self.model.lm_head(x), tuple(hidden))

    def _add_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: one launch with fla's fused norms (``config.fuse_norm``), which
        take the sum in fp32 before rounding it; so a block's closing residual add rides on the next norm."""
        if self.config.fuse_norm:
            return norm(x, residual=residual, prenorm=True)
        residual = residual + x
        return norm(residual), residual

    def _decode_step(self, input_ids: torch.Tensor, cache: SpecLACache) -> torch.Tensor:
        """One token of batch 1 (``supports_fused_step``): per layer, the input projection GEMV (attn norm before
        it, short conv and window shift after it), the recurrence in place, the output projection (gated norm before
        it), the MLP's gate|up (residual add and norm before it) and down projection (SwiGLU before it, residual add
        after it). Rounds where the general path rounds: it computes the same step up to summation order."""
        cache.check_consumable()
        h = self.model.model.embeddings(input_ids).view(-1)
        for block, m, layer in zip(self.blocks, self.mixers, cache.layers):
            proj, conv_weight, conv_bias = fuse_mixer_weights(m)
            p = product(proj, h, norm=(block.attn_norm.weight, block.attn_norm.eps),
                        conv=(layer.window[0], conv_weight, conv_bias))
            y, gate, a, b = projection_columns(m, p)          # y: q|k|v after the conv epilogue
            q, k, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim])
            o = recurrent_step_(q, k, v, a, b, layer.state, m.A_log, m.dt_bias, m.allow_neg_eigval)
            mixed = product(m.o_proj.weight, o, norm=(m.o_norm.weight, m.o_norm.eps), gate=gate)
            mlp = block.mlp
            residual = torch.empty_like(h)
            x = product(fuse_mlp_weights(mlp), mixed, norm=(block.mlp_norm.weight, block.mlp_norm.eps), add=h,
                        add_out=residual)
            h = product(mlp.down_proj.weight, x, swiglu=True, residual=residual)
        norm = self.model.model.norm
        return product(self.model.lm_head.weight, h, norm=(norm.weight, norm.eps)).view(1, 1, -1)

    def _verify_fused(self, input_ids: torch.Tensor, cache: SpecLACache, parents: torch.Tensor,
                      logits_positions, hidden_layers) -> RunnerOutput:
        """Tree nodes of batch 1 (``supports_fused_step``, at most ``fused_verify_max_nodes``) with the one-token
        step's fusions around ``ops.fused_gemm`` products: per layer the input projection (attn norm before it),
        tree conv, gates and tree verify, the output projection (gated norm before it), the MLP's gate|up (residual
        add and norm before it) and down projection (SwiGLU before it, residual add after it). Rounds where the
        general path rounds."""
        h = embed(self.model.model.embeddings, input_ids)[0]                # [T, hidden]
        hidden = [h[None]] if 0 in hidden_layers else []
        for i, (block, layer) in enumerate(zip(self.blocks, cache.layers)):
            h = self._fused_layer(block, layer, h, parents, cache.ancestors)
            if i + 1 in hidden_layers:
                hidden.append(h[None])
        if logits_positions is not None:
            h = h[logits_positions]
        norm = self.model.model.norm
        return RunnerOutput(ops.fused_gemm(self.model.lm_head.weight, h, norm=(norm.weight, norm.eps))[None],
                            tuple(hidden))

    def _fused_layer(self, block, layer: SpecLALayer, h: torch.Tensor, parents: torch.Tensor,
                     ancestors: torch.Tensor) -> torch.Tensor:
        """Block ``block`` (``fused_block``) verifying tree nodes ``h [T, hidden]`` of batch 1; returns its output
        residual stream."""
        m, mlp = block.attn, block.mlp
        projected = ops.fused_gemm(fuse_mixer_weights(m)[0], h, norm=(block.attn_norm.weight, block.attn_norm.eps))
        x, gate, a, b = projection_columns(m, projected[None])
        o = self._delta_rule(m, layer, x, a, b, parents, ancestors)
        mixed = ops.fused_gemm(m.o_proj.weight, o.to(h.dtype).reshape(h.shape[0], m.value_dim),
                               norm=(m.o_norm.weight, m.o_norm.eps), gate=gate[0])
        residual = torch.empty_like(h)
        gate_up = ops.fused_gemm(fuse_mlp_weights(mlp), mixed, norm=(block.mlp_norm.weight, block.mlp_norm.eps),
                                 add=h, add_out=residual)
        return ops.fused_gemm(mlp.down_proj.weight, gate_up, swiglu=True, residual=residual)

    def _mixer(self, i: int, h: torch.Tensor, layer: SpecLALayer, parents: torch.Tensor | None,
               ancestors: torch.Tensor) -> torch.Tensor:
        """Mixer ``i``: the fused input projection, the short conv and the delta rule (``_delta_rule``), the output
        norm and projection."""
        m = self.mixers[i]
        B, T, _ = h.shape
        # one GEMM for all input projections; the rest take column views of it (fla's kernels and ours read strided
        # rows)
        x, gate, a, b = projection_columns(m, F.linear(h, fuse_mixer_weights(m)[0]))
        o = self._delta_rule(m, layer, x, a, b, parents, ancestors)
        if m.use_gate and parents is not None:
            # the gate is a column slice of the projection GEMM: our gated norm reads it in place (fla's copies it)
            o = ops.rms_norm_gated(o.to(h.dtype), gate.view(B, T, m.num_v_heads, m.head_v_dim), m.o_norm.weight,
                                   m.o_norm.bias, m.o_norm.eps, m.o_norm.activation)
        elif m.use_gate:
            o = m.o_norm(o.to(h.dtype), gate.view(B, T, m.num_v_heads, m.head_v_dim))
        else:
            o = m.o_norm(o.to(h.dtype))
        return m.o_proj(o.reshape(B, T, m.value_dim))

    def _delta_rule(self, m: GatedDeltaNet, layer: SpecLALayer, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    parents: torch.Tensor | None, ancestors: torch.Tensor) -> torch.Tensor:
        """A mixer's short conv and delta rule on its projected q|k|v inputs ``x``, decay and write-strength inputs
        ``a``, ``b`` (column views of the input projection): fla's stock kernels when consuming tokens; tree conv,
        tree kernel and factors when verifying nodes. Returns ``o [B, T, value heads, head_v_dim]``."""
        B, T, _ = x.shape
        _, conv_weight, conv_bias = fuse_mixer_weights(m)
        if not m.use_short_conv:
            y = F.silu(x)
            if parents is not None:
                g, beta = ops.gdn_gate_beta(a, b, m.A_log, m.dt_bias, m.allow_neg_eigval)
        elif parents is None:
            # one depthwise conv over the concatenated q|k|v inputs, as fla's fused path does
            y, window = fla_gdn.causal_conv1d(x=x, weight=conv_weight, bias=conv_bias, initial_state=layer.window,
                                              output_final_state=True, activation=m.q_conv1d.activation)
            layer.window.copy_(window)
        else:
            x, y, g, beta = layer.conv_and_gates(x, a, b, conv_weight, conv_bias, parents, m.A_log, m.dt_bias,
                                                 m.allow_neg_eigval)
        q, k, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim], -1)
        q = q.view(B, T, m.num_heads, m.head_k_dim)
        k = k.view(B, T, m.num_heads, m.head_k_dim)
        v = v.view(B, T, m.num_v_heads, m.head_v_dim)

        if parents is None:
            kernel = (fla_gdn.fused_recurrent_gated_delta_rule if T <= 64
                      else fla_gdn.chunk_gated_delta_rule)                     # the stock layer's choice
            o, state = kernel(q=q, k=k, v=v, g=a, beta=b, initial_state=layer.state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=m.A_log,
                              dt_bias=m.dt_bias, use_beta_sigmoid_in_kernel=True,
                              allow_neg_eigval=m.allow_neg_eigval, state_v_first=True)
            layer.state.copy_(state)
        else:
            prefix = (layer.k_hat, layer.u, layer.g) if layer.k_hat.shape[1] else None
            o, k_hat, u = ops.tree_gated_delta_rule(q, k, v, g, beta, parents, layer.state, prefix=prefix,
                                                    ancestors=ancestors)
            layer.add_factors(k_hat, u, g, x)
        return o

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block ``i``'s fla ``GatedMLP`` with gate_proj and up_proj as one GEMM (``fuse_mlp_weights``), then
        exactly ``GatedMLP.forward``'s SwiGLU and down_proj (``specla_hf.models.fla_backend``'s torch path where that is
        chosen)."""
        mlp: GatedMLP = self.blocks[i].mlp
        if mlp.hidden_act != "swish":
            return mlp(x)
        # strided halves: fla's SwiGLU reads them in place
        gate, up = F.linear(x, fuse_mlp_weights(mlp)).chunk(2, -1)
        return backend.gated_mlp_down(mlp, gate, up)
