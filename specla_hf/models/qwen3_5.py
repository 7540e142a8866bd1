"""transformers' GDN hybrids driven by SpecLA: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next, text decoders only.

``HybridRunner`` walks the model's own modules (embeddings, zero-centred RMSNorms, MLP / MoE blocks, rotary
embedding, full-attention modules, LM head) and replaces only how the mixers keep state:
- GDN layers (``linear_attn``): from the module's own projections, conv weights, gates and gated norm. Consuming
  tokens runs the modeling module's own conv and delta-rule functions on our committed state, as the stock forward
  does; verifying tree nodes runs ``ops.tree_conv_gates`` / ``ops.tree_gated_delta_rule`` from the committed state
  and records their compact factors (``SpecLALayer``), as ``GDNRunner`` does. Our state is V-first ``[B, HV, V, K]``,
  transformers' K-first: consuming transposes it in and out. Value head ``i`` reads key head ``i // (HV / H)`` in both
  (transformers' ``repeat_interleave``).
- full-attention layers (``self_attn``): the model's own attention module, handed a view of our
  ``SpecLAAttentionLayer`` as ``past_key_values`` whose ``update`` returns its whole key and value buffers (the
  committed positions, then the pending nodes', then unused slots), an explicit 4D mask built on the device from the
  committed length (each node sees the committed prefix and its own ancestors, itself included) and the rotary
  embedding at position ``prefix + depth(node)`` (``specla_hf.models.tree_attention``).
- MLPs, dense or MoE, run on the tree's tokens as on any tokens: routing is per token.
A GDN layer's four input projections run as one GEMM (``fuse_projections``). A one-token step of batch 1 of a Qwen3.5
dense model (autoregressive decoding) goes further (``_decode_step``, ``supports_fused_step``): a GDN layer is four
GEMVs and the recurrence, with the norms, the short conv, the gated norm, the residual adds and SwiGLU fused around the
GEMVs (``specla_kernels.gemv``); an attention layer is its fused projection GEMV, one kernel for the head norms,
rotary and KV write (``ops.qk_norm_rope_append``), the model's attention function and the output projection. Calls
of several tokens (verify passes, prompt chains, the MTP head) compute Qwen3.5's gated attention layers of batch 1 the
same way with GEMMs (``_attention``), and their zero-centred norms as one kernel each.
Nothing the host holds changes with the committed length, so the decode-path calls (the one-token step, tree
verification per bucket, the commit, prompts as chains) of a target or a drafter run as CUDA graphs through
``GraphedAdapter``.
``transformers_cache`` exports the committed state as the ``DynamicCache`` the stock forward keeps (``generate``'s
``past_key_values``).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specla_hf.cache import SpecLAAttentionLayer, SpecLACache, SpecLALayer
from specla_hf.drafters.options import MAX_TREE_BUCKET
from specla_hf.models import ADAPTERS, transformers_backend
from specla_hf.models import fla_backend as backend
from specla_hf.models.base import RunnerOutput, embed
from specla_hf.models.graphed import DRAFT_SEQ_TOKENS, MAX_SEQ_TOKENS, GraphedAdapter, tree_bucket
from specla_hf.models.one_token import (fusable_gated_head, fused_rows, fused_tree_pass, product, recurrent_step_,
                                       unit_offset_weight)
from specla_hf.models.tree_attention import (KVView, attention_inputs, attention_kernels, kernel_takes,
                                             specla_masked_attention)
from specla_kernels import ops
from specla_kernels.gemv import MAX_K as GEMV_MAX_K

# attention implementations that take an arbitrary 4D mask (a tree is not causal)
MASKED_ATTENTION = ("eager", "sdpa")
# positions a graphed cache holds when no generation length is given (direct calls of the adapter)
GRAPHED_CAPACITY = 1024
# RMSNorms that scale by ``1 + weight`` (computed in fp32)
ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")


def zero_centred(norm) -> bool:
    """Whether ``norm`` is a zero-centred RMSNorm (``x * (1 + w)``, computed in fp32)."""
    return type(norm).__name__ in ZERO_CENTRED_NORMS


def zero_centred_norm(norm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """Zero-centred RMSNorm ``norm`` of ``x`` (or of ``x + residual``, returning the sum too) as one kernel: its
    module's own ops take ~9 launches."""
    return backend.rms_norm_scaled(x, unit_offset_weight(norm), norm.eps, residual)


def text_decoder(model):
    """The decoder stack of ``model``: ``model.model``, or the language model of a vision-language model."""
    return getattr(model.model, "language_model", model.model)


def check_hybrid_model(model, role: str = "target") -> None:
    """Raise a clear error for anything this runner cannot drive faithfully."""
    cfg = text_decoder(model).config
    attn = cfg._attn_implementation
    if attn not in MASKED_ATTENTION:
        raise NotImplementedError(f"the {role} uses attn_implementation={attn!r}, which takes no tree mask; load it "
                                  "with attn_implementation='sdpa' (or 'eager')")
    kinds = set(cfg.layer_types) - {"linear_attention", "full_attention"}
    if kinds:
        raise NotImplementedError(f"the {role} has layers of type {sorted(kinds)}; SpecLA drives linear_attention "
                                  "(GDN) and full_attention layers")
    if cfg.hidden_act not in ("silu", "swish"):
        raise NotImplementedError(f"the {role} uses hidden_act={cfg.hidden_act!r} in its GDN short convolutions; "
                                  "SpecLA's tree convolution applies SiLU")


def hidden_norms(decoder) -> list:
    """A decoder's hidden-size RMSNorms: the final one and each block's two."""
    return [decoder.norm] + [n for b in decoder.layers for n in (b.input_layernorm, b.post_attention_layernorm)]


def fuse_projections(m) -> torch.Tensor | None:
    """A Qwen3.5 GDN module's input projections as one ``[qkv | z | b | a, hidden]`` weight (``fused_rows``:
    idempotent, the parameters become views of it); ``None`` for Qwen3-Next's interleaved ``in_proj_qkvz``."""
    if not hasattr(m, "in_proj_qkv"):
        return None
    return fused_rows(m, "_specla_fused_proj", [m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight,
                                                m.in_proj_a.weight], pad_to=64)


def dense_mlp(mlp) -> bool:
    """Whether a block's MLP is a dense SwiGLU (gate_proj, up_proj, down_proj), not an MoE block."""
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) and not hasattr(mlp, "experts")


def fuse_gate_up(mlp) -> torch.Tensor:
    """A dense MLP's gate_proj and up_proj rows as one ``[gate | up, hidden]`` weight (``fused_rows``)."""
    return fused_rows(mlp, "_specla_fused_gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight])


def fuse_qkv(m) -> torch.Tensor:
    """A gated attention module's q (queries and output gates), k and v projections as one weight (``fused_rows``)."""
    return fused_rows(m, "_specla_fused_qkv", [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])


def experts_blocker(mlps) -> str | None:
    """Why calls through ``mlps`` cannot be CUDA graphs: transformers' MoE experts copy between the host and the GPU
    inside their forward, which a capture refuses, and a capture that fails part-way can leave the device unusable
    (an illegal address on the next eager call, on an H200)."""
    moe = sorted({type(m).__name__ for m in mlps if not dense_mlp(m)})
    return f"the MoE blocks ({', '.join(moe)}) cannot be captured as CUDA graphs" if moe else None


def fusable_attention(m) -> bool:
    """Whether ``HybridRunner._attention`` computes this full-attention module's calls itself (batch 1): gated queries
    (q_proj gives each head its query and output gate), zero-centred q/k norms of one eps, bias-free projections."""
    return (zero_centred(m.q_norm) and m.q_norm.eps == m.k_norm.eps
            and m.q_proj.out_features == 2 * m.config.num_attention_heads * m.head_dim
            and all(lin.bias is None for lin in (m.q_proj, m.k_proj, m.v_proj, m.o_proj)))


def fused_block(block, kind: str) -> bool:
    """Whether the fused paths (``HybridRunner._decode_step``, ``_fused_block``) compute this ``kind`` decoder block:
    a dense SwiGLU MLP, and Qwen3.5's GDN layout (separate input projections, power-of-two value heads for the gated
    norm, at least 16 wide) or a ``fusable_attention`` module, all bias-free."""
    mlp = block.mlp
    if not dense_mlp(mlp):
        return False
    linears = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if kind == "linear_attention":
        m = block.linear_attn
        if not hasattr(m, "in_proj_qkv") or not fusable_gated_head(m.head_v_dim):
            return False
        linears += [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a, m.out_proj]
    elif not fusable_attention(block.self_attn):
        return False
    return all(lin.bias is None for lin in linears)


def supports_fused_step(model) -> bool:
    """Whether ``HybridRunner._decode_step`` computes this model's one-token step: fused blocks (``fused_block``),
    zero-centred RMSNorms and GEMV inputs of at most 16384 features. Others (Qwen3-Next's interleaved projections,
    MoE blocks) take the general path."""
    decoder = text_decoder(model)
    cfg = decoder.config
    if not all(map(zero_centred, hidden_norms(decoder))) or model.lm_head.bias is not None:
        return False
    widths = [cfg.hidden_size]
    for block, kind in zip(decoder.layers, cfg.layer_types):
        if not fused_block(block, kind):
            return False
        mixed = block.linear_attn.value_dim if kind == "linear_attention" else block.self_attn.o_proj.in_features
        widths += [mixed, block.mlp.down_proj.in_features]
    return max(widths) <= GEMV_MAX_K      # the GEMVs hold their whole input in registers


class HybridRunner(GraphedAdapter):
    """Drive one Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text decoder over a ``SpecLACache`` (see module docstring).

    ``cuda_graphs`` (default: on for a model on CUDA) replays captured graphs for decode-path calls, as
    ``GDNRunner`` does (``specla_hf.models.graphed``): the attention layers then hold buffers of a fixed capacity,
    reserved by ``new_cache(max_length=...)`` (for a drafter: ``DynamicTreeDrafter.reserve``). ``bucket_trees`` pads
    verified trees to power-of-two sizes with inert nodes (on with graphs).
    """

    fused_step = False        # ``_decode_step`` serves one-token calls (``supports_fused_step``; set per model)
    one_kernel_norms = False  # zero-centred norms as one kernel each (``_norm``; set per model)
    fused_attention = False   # full-attention calls of batch 1 through ``_attention``'s kernels (set per model)

    def __init__(self, model, role: str = "target", cuda_graphs: bool | None = None,
                 bucket_trees: bool | None = None):
        check_hybrid_model(model, role)
        self.model = model
        self.decoder = text_decoder(model)
        self.config = self.decoder.config
        self.built_for = (model.device, model.dtype)
        self.blocks = self.decoder.layers
        self._init_graphs(cuda_graphs, DRAFT_SEQ_TOKENS if role == "drafter" else MAX_SEQ_TOKENS, bucket_trees)
        self.fused_step = supports_fused_step(model)   # tests turn it off to compare with the general path
        for block, kind in zip(self.blocks, self.config.layer_types):   # before any graph reads the parameters
            if kind == "linear_attention":                                # (``fused_rows``)
                fuse_projections(block.linear_attn)
        self._choose_fusions(self.blocks)
        # the last cache ``new_cache`` made: the loop's, from which ``generate`` builds ``past_key_values``
        self.last_cache: SpecLACache | None = None

    def graph_blocker(self) -> str | None:
        return experts_blocker(block.mlp for block in self.blocks)

    def _hidden_norms(self) -> list:
        """The hidden-size RMSNorms the runner's calls apply."""
        return hidden_norms(self.decoder)

    def _attention_modules(self) -> list:
        """The full-attention modules the runner's calls run."""
        return [b.self_attn for b, kind in zip(self.blocks, self.config.layer_types) if kind == "full_attention"]

    def _choose_fusions(self, blocks) -> None:
        """Which fused paths the modules allow (one kernel per zero-centred norm, ``_attention``), and the
        projections of ``blocks`` those paths multiply as one fused (``fused_rows``): before any graph reads the
        parameters."""
        self.one_kernel_norms = all(map(zero_centred, self._hidden_norms()))
        self.fused_attention = all(map(fusable_attention, self._attention_modules()))
        for block in blocks:
            if self.fused_attention and hasattr(block, "self_attn"):
                fuse_qkv(block.self_attn)
            if dense_mlp(block.mlp):
                fuse_gate_up(block.mlp)

    def _scaled_norms(self) -> list:
        """The zero-centred norms whose ``unit_offset_weight`` the runner's calls read."""
        heads = [n for m in self._attention_modules() if self.fused_attention for n in (m.q_norm, m.k_norm)]
        return (self._hidden_norms() if self.one_kernel_norms else []) + heads

    def new_cache(self, batch_size: int = 1, max_length: int | None = None) -> SpecLACache:
        """A fresh cache: a ``SpecLALayer`` per GDN layer, a ``SpecLAAttentionLayer`` per attention layer, room for
        ``max_length`` positions. With CUDA graphs the runner's one cache per batch size is reset and returned (the
        graphs are bound to its tensors); one too small for ``max_length`` (or ``GRAPHED_CAPACITY`` positions) is
        replaced, and the graphs bound to it are dropped, to be captured again."""
        for norm in self._scaled_norms():     # a weight updated since the graphs were captured: refreshed in place
            unit_offset_weight(norm)
        if self.graphs is None:
            capacity = 64 if max_length is None else max_length + MAX_TREE_BUCKET
            self.last_cache = self._make_cache(batch_size, capacity, fixed=False)
            return self.last_cache
        # a power of two: nearby lengths share one cache (and its graphs); room for a tree pending on top
        capacity = tree_bucket(max(max_length or 0, GRAPHED_CAPACITY) + MAX_TREE_BUCKET)
        cache = self._caches.get(batch_size)
        if cache is not None and all(l.capacity >= capacity for l in cache.others):
            cache.reset()
        else:
            if cache is not None:
                self.graphs.clear()
            cache = self._caches[batch_size] = self._make_cache(batch_size, capacity, fixed=True)
        self.last_cache = cache
        return cache

    def _make_cache(self, batch_size: int, capacity: int, fixed: bool) -> SpecLACache:
        layers = []
        for block, kind in zip(self.blocks, self.config.layer_types):
            if kind == "linear_attention":
                m = block.linear_attn
                layers.append(SpecLALayer(batch_size, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim,
                                          m.conv_dim, m.conv_kernel_size, self.dtype, self.device))
            else:
                m = block.self_attn
                layers.append(SpecLAAttentionLayer(batch_size, m.k_proj.out_features // m.head_dim, m.head_dim,
                                                   self.dtype, self.device, capacity, fixed))
        return SpecLACache(layers)

    def transformers_cache(self, cache: SpecLACache) -> DynamicCache:
        """``cache``'s committed state as the transformers cache the stock forward keeps (a ``DynamicCache`` of the
        text config): conv windows, K-first recurrent states, the committed keys and values."""
        if cache.num_pending:
            raise RuntimeError("commit or discard the pending draft nodes before exporting the cache")
        exported = DynamicCache(config=self.config)
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, SpecLALayer):
                exported.update_conv_state(layer.window.clone(), i, conv_kernel_size=layer.window.shape[-1])
                exported.update_recurrent_state(layer.state.transpose(-1, -2).contiguous(), i)
            else:
                n = layer.committed_length()
                exported.update(layer.key_buffer[:, :, :n].clone(), layer.value_buffer[:, :, :n].clone(), i)
        return exported

    # ------------------------------------------------------------------------------------------------------------
    def compute(self, input_ids, cache, parents, logits_positions, hidden_layers) -> RunnerOutput:
        """``forward`` on device tensors, the tree as given (drafters call it)."""
        if (self.fused_step and parents is None and not hidden_layers and isinstance(input_ids, torch.Tensor)
                and input_ids.shape == (1, 1)):
            logits = self._decode_step(input_ids, cache)
            return RunnerOutput(logits if logits_positions is None else logits[:, logits_positions], ())
        B, T = input_ids.shape
        pending_before = cache.num_pending
        if parents is None:
            cache.check_consumable()
            all_parents = None
        else:
            all_parents = cache.add_nodes(parents)
        h = embed(self.decoder.embed_tokens, input_ids)
        attention = self._attention_inputs(h, cache, pending_before, parents is not None)
        if parents is not None and self.fused_step and fused_tree_pass(B, T):
            return self._verify_fused(h[0], cache, all_parents, attention, logits_positions, hidden_layers)
        hidden = [h] if 0 in hidden_layers else []
        out = None                            # the last block's MLP output, not yet added to the residual stream
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_types)):
            if out is None:
                x = self._norm(block.input_layernorm, h)
            else:                             # the block's closing residual add rides on the next norm
                x, h = self._norm(block.input_layernorm, out, residual=h)
                if i in hidden_layers:
                    hidden.append(h)
            if kind == "linear_attention":
                x = self._linear_attention(block.linear_attn, x, cache.layers[i], all_parents, cache.ancestors)
            else:
                x = self._attention(block.self_attn, x, cache.layers[i], attention, pending=parents is not None)
            x, h = self._norm(block.post_attention_layernorm, x, residual=h)
            out = self._mlp(block.mlp, x)
        x, h = self._norm(self.decoder.norm, out, residual=h)
        if len(self.blocks) in hidden_layers:
            hidden.append(h)
        if logits_positions is not None:
            x = x[:, logits_positions]
        return RunnerOutput(self.model.lm_head(x), tuple(hidden))

    def _decode_step(self, input_ids: torch.Tensor, cache: SpecLACache) -> torch.Tensor:
        """One token of batch 1 (``supports_fused_step``). A GDN layer: the input projection GEMV (input norm before
        it, short conv and window shift after it), the recurrence in place, the output projection (gated norm before
        it); an attention layer: ``_attention_step``. Then the MLP's gate|up (residual add and norm before it) and
        down projection (SwiGLU before it, residual add after it). Computes the general path's step up to summation
        order and where it rounds intermediates in a 16-bit dtype."""
        cache.check_consumable()
        h = self.decoder.embed_tokens(input_ids).view(-1)
        attention = self._attention_inputs(h.view(1, 1, -1), cache, 0, False)
        for block, kind, layer in zip(self.blocks, self.config.layer_types, cache.layers):
            norm = block.input_layernorm
            if kind == "linear_attention":
                m = block.linear_attn
                p = product(fuse_projections(m), h, norm=(unit_offset_weight(norm), norm.eps),
                            conv=(layer.window[0], m.conv1d.weight[:, 0], m.conv1d.bias))
                q, k, v, z, b, a = torch.split(p, [m.key_dim, m.key_dim, m.value_dim, m.value_dim, m.num_v_heads,
                                                   m.num_v_heads, p.numel() - m.conv_dim - m.value_dim
                                                   - 2 * m.num_v_heads])[:6]     # q|k|v after the conv epilogue
                o = recurrent_step_(q, k, v, a, b, layer.state, m.A_log, m.dt_bias)
                mixed = product(m.out_proj.weight, o, norm=(m.norm.weight, m.norm.variance_epsilon), gate=z)
            else:
                mixed = self._attention_step(block.self_attn, h, norm, layer, attention)
            post, residual = block.post_attention_layernorm, torch.empty_like(h)
            x = product(fuse_gate_up(block.mlp), mixed, norm=(unit_offset_weight(post), post.eps), add=h,
                        add_out=residual)
            h = product(block.mlp.down_proj.weight, x, swiglu=True, residual=residual)
        norm = self.decoder.norm
        return product(self.model.lm_head.weight, h, norm=(unit_offset_weight(norm), norm.eps)).view(1, 1, -1)

    def _verify_fused(self, h: torch.Tensor, cache: SpecLACache, parents: torch.Tensor, attention, logits_positions,
                      hidden_layers) -> RunnerOutput:
        """Tree nodes of batch 1 (embedded: ``h [T, hidden]``; ``supports_fused_step``, at most
        ``fused_verify_max_nodes``) as ``_decode_step`` computes a token, ``ops.fused_gemm`` products in place of its
        GEMVs: a GDN layer's input projection (input norm before it), tree conv, gates and tree verify, output
        projection (gated norm before it); an attention layer's q|gate, k, v projection (input norm before it),
        ``_attend`` over the cache and output projection; the MLP's gate|up (residual add and norm before it) and
        down projection (SwiGLU before it, residual add after it)."""
        hidden = [h[None]] if 0 in hidden_layers else []
        for i, (block, kind, layer) in enumerate(zip(self.blocks, self.config.layer_types, cache.layers)):
            h = self._fused_block(block, kind, layer, h, parents, cache.ancestors, attention)
            if i + 1 in hidden_layers:
                hidden.append(h[None])
        if logits_positions is not None:
            h = h[logits_positions]
        final = (unit_offset_weight(self.decoder.norm), self.decoder.norm.eps)
        return RunnerOutput(ops.fused_gemm(self.model.lm_head.weight, h, norm=final)[None], tuple(hidden))

    def _fused_block(self, block, kind: str, layer, h: torch.Tensor, parents: torch.Tensor | None,
                     ancestors: torch.Tensor | None, attention) -> torch.Tensor:
        """Decoder block ``block`` (``fused_block``: a ``kind`` layer) verifying tree nodes
        ``h [T, hidden]`` of batch 1 through ``fused_gemm`` products; returns its output residual stream."""
        T = h.shape[0]
        norm = (unit_offset_weight(block.input_layernorm), block.input_layernorm.eps)
        if kind == "linear_attention":
            m = block.linear_attn
            x, z, b, a = self._split_projection(m, ops.fused_gemm(fuse_projections(m), h, norm=norm)[None])
            o = self._tree_delta_rule(m, layer, x, b, a, parents, ancestors)
            mixed = ops.fused_gemm(m.out_proj.weight, o.to(h.dtype).reshape(T, m.value_dim),
                                   norm=(m.norm.weight, m.norm.variance_epsilon), gate=z[0])
        else:
            m = block.self_attn
            (cos, sin), mask = attention
            qkv = ops.fused_gemm(fuse_qkv(m), h, norm=norm)
            mixed = ops.fused_gemm(m.o_proj.weight, self._attend(m, qkv, cos[0], sin[0], mask, layer, True))
        post, residual = block.post_attention_layernorm, torch.empty_like(h)
        gate_up = ops.fused_gemm(fuse_gate_up(block.mlp), mixed, norm=(unit_offset_weight(post), post.eps), add=h,
                                 add_out=residual)
        return ops.fused_gemm(block.mlp.down_proj.weight, gate_up, swiglu=True, residual=residual)

    @staticmethod
    def _attention_step(m, h: torch.Tensor, norm, layer: SpecLAAttentionLayer, attention) -> torch.Tensor:
        """Gated attention module ``m`` on one token ``h [hidden]`` of batch 1: the q|gate, k, v projection (input norm
        before it), then ``_attend``, with the output projection as a GEMV."""
        (cos, sin), mask = attention
        qkv = product(fuse_qkv(m), h, norm=(unit_offset_weight(norm), norm.eps))
        o = HybridRunner._attend(m, qkv.view(1, -1), cos, sin, mask, layer, pending=False)
        return product(m.o_proj.weight, o.view(-1))

    def _attention(self, m, x: torch.Tensor, layer: SpecLAAttentionLayer, attention, pending: bool) -> torch.Tensor:
        """Full-attention module ``m`` on ``x [B, T, hidden]``, consumed or verified as pending tree nodes after
        ``layer``'s committed positions under ``attention`` (rotary embedding, mask): with ``fused_attention`` and
        batch 1, its q|gate, k, v projection as one GEMM, then ``_attend``, then the output projection; otherwise
        the module itself over a ``KVView``."""
        position_embeddings, mask = attention
        if not (self.fused_attention and x.shape[0] == 1):
            with attention_kernels():
                out, _ = m(hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask,
                           past_key_values=KVView(layer, pending))
            return out
        cos, sin = position_embeddings
        o = self._attend(m, F.linear(x[0], fuse_qkv(m)), cos[0], sin[0], mask, layer, pending)
        return F.linear(o, m.o_proj.weight)[None]

    @staticmethod
    def _attend(m, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                layer: SpecLAAttentionLayer, pending: bool) -> torch.Tensor:
        """Gated attention module ``m`` from its projections ``qkv [T, W]`` of batch 1 (rotary ``cos, sin [T, R]``):
        the head norms, rotary and KV write as one kernel (``ops.qk_norm_rope_append``, after the layer's entries),
        the module's attention function over the cache under ``mask``, the output gate (inside the attention kernel
        where ours takes the call); ``[T, heads * D]``, what the output projection takes. The module's own ops take
        ~40 launches for this."""
        T = qkv.shape[0]
        H, D = m.config.num_attention_heads, m.head_dim
        layer.make_room(layer.num_pending + T)
        q = ops.qk_norm_rope_append(qkv, unit_offset_weight(m.q_norm), unit_offset_weight(m.k_norm), m.q_norm.eps,
                                    cos, sin, layer.key_buffer, layer.value_buffer, layer.length, H,
                                    first=layer.num_pending)
        layer.stored(T, pending)
        q = q.view(1, T, H, D).transpose(1, 2)
        gate = qkv[:, :2 * H * D].view(T, H, 2, D)[:, :, 1]
        with attention_kernels():
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(m.config._attn_implementation,
                                                           sys.modules[type(m).__module__].eager_attention_forward)
            if attend is specla_masked_attention and kernel_takes(q, layer.key_buffer, layer.value_buffer, mask):
                return ops.masked_attention(q, layer.key_buffer, layer.value_buffer, mask, m.scaling,
                                            gate=gate[None]).view(T, H * D)
            o, _ = attend(m, q, layer.key_buffer, layer.value_buffer, mask, dropout=0.0, scaling=m.scaling)
        return (o.view(T, H, D) * torch.sigmoid(gate)).view(T, H * D)

    def _norm(self, norm, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or ``(norm(x + residual), x + residual)``: one kernel for a zero-centred norm."""
        if not self.one_kernel_norms:
            if residual is None:
                return norm(x)
            total = x + residual
            return norm(total), total
        return zero_centred_norm(norm, x, residual)

    @staticmethod
    def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        """A block's MLP: a dense one as one gate|up GEMM, SwiGLU and the down projection; MoE blocks as they are."""
        if not dense_mlp(mlp):
            return mlp(x)
        gate, up = F.linear(x, fuse_gate_up(mlp)).chunk(2, -1)
        return mlp.down_proj(backend.swiglu_product(gate, up))

    def _attention_inputs(self, h: torch.Tensor, cache: SpecLACache, pending_before: int,
                          tree: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The attention layers' rotary embedding and mask for the new tokens (``tree_attention.attention_inputs``):
        every attention layer holds the same positions and capacity, so the first one's serve all."""
        layer = next((l for l in cache.layers if isinstance(l, SpecLAAttentionLayer)), None)
        if layer is None:
            return None
        ancestors = cache.ancestors[:, pending_before:] if tree else None                 # [B, T, pending]
        return attention_inputs(self.decoder.rotary_emb, h, layer, ancestors)

    def _projections(self, m, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A GDN module's input projections: the raw conv inputs q|k|v ``[B, T, conv_dim]``, the output gate z
        ``[B, T, HV, V]`` and the gate inputs ``b``, ``a`` ``[B, T, HV]``. Qwen3-Next interleaves q, k, v, z (and b,
        a) per key-head group in one projection: its module's own ``fix_query_key_value_ordering`` splits them."""
        B, T, _ = h.shape
        fused = fuse_projections(m)
        if fused is None:
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
            return torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], -1), z, b, a
        x, z, b, a = self._split_projection(m, F.linear(h, fused))
        return x, z.view(B, T, m.num_v_heads, m.head_v_dim), b, a

    @staticmethod
    def _split_projection(m, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Column views of a Qwen3.5 GDN module's fused input projection ``[B, T, rows]`` (``fuse_projections``): the
        raw conv inputs q|k|v, the output gate z ``[B, T, value_dim]``, the gate inputs ``b``, ``a``."""
        sizes = [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads]
        return torch.split(projected, sizes + [projected.shape[-1] - sum(sizes)], -1)[:4]

    def _linear_attention(self, m, h: torch.Tensor, layer: SpecLALayer, parents: torch.Tensor | None,
                          ancestors: torch.Tensor) -> torch.Tensor:
        """GDN module ``m`` on ``h [B, T, hidden]``: consuming into the committed state (``parents=None``) or
        verifying tree nodes from it (see module docstring)."""
        B, T, _ = h.shape
        x, z, b, a = self._projections(m, h)
        if parents is None:
            o = self._consume(m, x, b, a, m.conv1d.weight[:, 0], layer)
        else:
            o = self._tree_delta_rule(m, layer, x, b, a, parents, ancestors)
        if getattr(m.norm, "activation", None) in ("silu", "swish"):
            # one kernel, reading the gate (a column slice of the projection) in place
            o = ops.rms_norm_gated(o.to(h.dtype), z, m.norm.weight, None, m.norm.variance_epsilon, "swish")
        else:
            o = m.norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(o.reshape(B, T, m.value_dim))

    def _tree_delta_rule(self, m, layer: SpecLALayer, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         parents: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """GDN module ``m`` verifying tree nodes from ``layer``'s committed state: the tree conv of the raw q|k|v
        inputs ``x [B, T, conv_dim]``, gates, tree verify, factors recorded; returns ``o [B, T, heads, head_v_dim]``."""
        x, y, g, beta = layer.conv_and_gates(x, a, b, m.conv1d.weight[:, 0], m.conv1d.bias, parents, m.A_log,
                                             m.dt_bias)
        q, k, v = self._heads(m, y)
        prefix = (layer.k_hat, layer.u, layer.g) if layer.k_hat.shape[1] else None
        o, k_hat, u = ops.tree_gated_delta_rule(q, k, v, g, beta, parents, layer.state, prefix=prefix,
                                                ancestors=ancestors)
        layer.add_factors(k_hat, u, g, x)
        return o

    @staticmethod
    def _heads(m, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = y.shape
        q, k, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim], -1)
        return (q.reshape(B, T, m.num_k_heads, m.head_k_dim), k.reshape(B, T, m.num_k_heads, m.head_k_dim),
                v.reshape(B, T, m.num_v_heads, m.head_v_dim))

    def _consume(self, m, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 layer: SpecLALayer) -> torch.Tensor:
        """Tokens ``x`` through the modeling module's conv and delta rule, from and into the committed state, with
        the stock forward's choice of kernel (recurrent for one token, chunked otherwise). q and k are repeated to the
        value heads here: transformers 5.17's torch functions expect that of their caller (5.23's repeat them)."""
        T, W = x.shape[1], layer.window.shape[-1]
        # the functions the stock forward calls, looked up at call time as it does (``install`` rebinds them)
        modeling = sys.modules[type(m).__module__]
        inputs = torch.cat([layer.window, x.transpose(1, 2)], -1)            # [B, conv_dim, W + T], newest last
        layer.window.copy_(inputs[..., -W:])
        y = modeling.causal_conv1d_fn(inputs, weight, m.conv1d.bias, activation=m.activation)
        q, k, v = self._heads(m, y[..., -T:].transpose(1, 2))
        rep = m.num_v_heads // m.num_k_heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        rule = (modeling.torch_recurrent_gated_delta_rule if T == 1
                else modeling.torch_chunk_gated_delta_rule)
        o, state = rule(q, k, v, g=g, beta=b.sigmoid(), initial_state=layer.state.transpose(-1, -2).contiguous(),
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        layer.state.copy_(state.transpose(-1, -2))
        return o


def install(module) -> None:
    """For a hybrid modeling ``module`` just imported: the CPU path for its kernel-bound functions
    (``transformers_backend``) and SpecLA's ``generate`` on its model classes registered for ``HybridRunner``."""
    from specla_hf.generation import patch_generate

    transformers_backend.install(module)
    ours = f"{__name__}:{HybridRunner.__name__}"
    for (module_name, name), adapter in ADAPTERS.items():
        if adapter == ours and module_name == module.__name__ and hasattr(module, name):
            patch_generate(getattr(module, name))
