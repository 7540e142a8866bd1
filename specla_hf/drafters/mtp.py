"""The checkpoint's own multi-token-prediction (MTP) head as the drafter of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next target.

    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    mtp = MTPDrafter.from_pretrained(path)      # the mtp.* tensors only (specla_hf.drafters.mtp_checkpoint)
    target.generate(ids, assistant_model=mtp, tree=True)

``MTPDrafter`` holds the head's weights and nothing of the target; ``generate`` binds it to the target it drafts
for (``candidate_generator``: ``check_target``, then an ``MTPTreeDrafter`` on the target's embedding, rotary embedding,
final norm and LM head). Architecture, as vLLM and SGLang run these checkpoints (``docs/mtp.md``): drafter position
``t`` computes

    x_t = fc([pre_fc_norm_embedding(E(x_{t+1})) ; pre_fc_norm_hidden(g_t)])      E = the TARGET's embedding
    o_t = norm(DecoderLayer(x_t))          a full-attention decoder layer of the target's family, its own KV cache,
                                           at rotary position t
    p(x_{t+2}) = softmax(W_target · o_t)   the TARGET's LM head

where ``g_t`` is the target's last hidden state at position ``t`` after its final norm. That is transformers' own
``MtpLayer`` (``eh_proj`` = fc, ``enorm`` / ``hnorm`` = the pre-fc norms, ``mtp_block`` = the decoder layer,
``post_norm`` = norm) built from the target family's decoder-layer and RMSNorm classes. Deeper drafts apply the same
layer recursively: a node reads its parent's output ``o`` in place of ``g``, at rotary position ``prefix + depth``.
That is ``EagleDrafter``'s alignment (position ``t`` reads feature ``t`` and token ``t + 1``; deeper nodes their
parent's output), so ``MTPTreeDrafter`` is an ``EagleDrafter`` whose one feature layer is the target's top layer (read
after the final norm) and whose block is the MTP layer, run by ``_MTPRunner``: its KV cache is a ``SpecLACache`` of one
``SpecLAAttentionLayer``, attended through ``specla_hf.models.tree_attention`` as the target's own attention layers
are (each draft node sees the committed positions and its ancestors), committed along the accepted path.

On CUDA the runner's calls are CUDA graphs, as the hybrid target's are: its cache has a fixed capacity, reserved for
the generation's length when the loop starts the drafter (``DynamicTreeDrafter.reserve``).

A draft vocabulary (``MTPDrafter.restrict_vocabulary``, e.g. the ``frequent_tokens`` of a corpus) keeps the 248K-row
LM head out of drafting: each draft depth then multiplies by those rows only, and its log-softmax and top-k run over
them (EAGLE-3 drafts over 32K tokens so). The target still verifies over its whole vocabulary, so decoding stays
lossless; a token outside the draft vocabulary is never drafted, only emitted by the target.
"""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_layers import MtpLayer

from specla_hf.cache import SpecLAAttentionLayer, SpecLACache
from specla_hf.drafters import mtp_checkpoint
from specla_hf.drafters.base import DynamicTreeDrafter
from specla_hf.drafters.options import DraftOptions
from specla_hf.drafters.eagle import EagleDrafter, TargetBoundRunner
from specla_hf.models.base import RunnerOutput, plain_lookup
from specla_hf.models.one_token import fused_tree_pass, unit_offset_weight
from specla_hf.models.qwen3_5 import MASKED_ATTENTION, HybridRunner, experts_blocker, fused_block, text_decoder
from specla_hf.models.tree_attention import attention_inputs
from specla_kernels import ops

# text-config model_type -> (modeling module, decoder-layer class, RMSNorm class) the MTP layer is built from
FAMILIES = {
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm"),
    "qwen3_5_moe_text": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer",
                         "Qwen3_5MoeRMSNorm"),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm"),
}


def check_config(config: PretrainedConfig) -> None:
    """Raise a one-line ``ValueError`` for a text config whose MTP head ``MTPDrafter`` cannot build."""
    if config.model_type not in FAMILIES:
        raise ValueError(f"a {config.model_type!r} checkpoint: MTPDrafter reads the MTP heads of Qwen3.5, Qwen3.5-MoE "
                         "and Qwen3-Next checkpoints")
    layers = getattr(config, "mtp_num_hidden_layers", 1)
    if layers != 1:
        # vLLM runs layer 0 at every depth and SGLang builds one: no engine says how more would chain
        raise ValueError(f"unsupported MTP structure: mtp_num_hidden_layers={layers}; MTPDrafter runs one MTP layer "
                         "recursively, as the released checkpoints (and vLLM / SGLang) do")
    if getattr(config, "mtp_use_dedicated_embeddings", False):
        raise ValueError("unsupported MTP structure: mtp_use_dedicated_embeddings=True; MTPDrafter drafts on the "
                         "target's embeddings")


def frequent_tokens(sequences, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (sorted by id) in ``sequences`` (tensors or lists of token ids, e.g. a
    corpus tokenized with the target's tokenizer), ties to the lower id: a draft vocabulary
    (``MTPDrafter.restrict_vocabulary``)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long).flatten(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


class MTPDrafter(nn.Module):
    """An MTP head's weights (``layer``: transformers' ``MtpLayer``) and the target text config they belong to
    (module docstring). Pass it as ``target.generate(ids, assistant_model=mtp)``: ``specla_hf.generation`` sees
    ``is_specla_drafter`` and calls ``check_target`` then ``candidate_generator``."""

    is_specla_drafter = True

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        self.config = copy.deepcopy(config)
        self.config.mtp_num_hidden_layers = 1
        module_name, layer_class, norm_class = FAMILIES[config.model_type]
        module = importlib.import_module(module_name)
        # the decoder layer is built as layer 0 of a one-layer full-attention stack (vLLM builds it so too)
        layer_config = copy.deepcopy(self.config)
        layer_config.layer_types = ["full_attention"]
        layer_config._attn_implementation = "sdpa"
        self.layer = MtpLayer(layer_config, getattr(module, layer_class), getattr(module, norm_class), 0)
        self.draft_vocab: torch.Tensor | None = None      # sorted token ids it drafts from (None: all)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, inputs_embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask,
                past_key_values) -> torch.Tensor:
        """The MTP layer on the target's embeddings of the next tokens and the hidden states ``[B, T, H]`` it reads
        (the target's after its final norm, or the layer's own outputs): its normed output ``o [B, T, H]``."""
        return self.layer(inputs_embeds, hidden, position_embeddings, attention_mask, None, past_key_values)

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``EagleDrafter``'s feature fusion: the one feature, the target's top hidden state after its final norm, is
        read as it is."""
        (hidden,) = features
        return hidden

    def restrict_vocabulary(self, token_ids) -> MTPDrafter:
        """Draft from ``token_ids`` only (module docstring; ``None``: the whole vocabulary again); returns the head.
        The LM-head rows are taken from the target when ``generate`` binds the head to it."""
        if token_ids is not None:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique()
            if not ids.numel() or ids[0] < 0 or ids[-1] >= self.config.vocab_size:
                raise ValueError(f"a draft vocabulary is a non-empty set of token ids in [0, {self.config.vocab_size})"
                                 f"; got {ids.numel()} ids" + (f" from {int(ids[0])} to {int(ids[-1])}"
                                                               if ids.numel() else ""))
            token_ids = ids
        self.draft_vocab = token_ids
        self.__dict__.pop("_specla_runner", None)     # its head rows and graphs were for the other vocabulary
        return self

    # ---- loading and saving ----
    @classmethod
    def from_pretrained(cls, source: str | Path, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, revision: str | None = None,
                        local_files_only: bool = False) -> MTPDrafter:
        """The MTP head of the checkpoint at ``source``: a local folder, or a Hub repository id (fetched, or read from
        the Hub cache offline: ``local_files_only=True`` or ``HF_HUB_OFFLINE=1``). Reads the config and the
        ``mtp.*`` tensors only (only the shards holding them), and a draft vocabulary saved with the head; the
        target's embeddings and LM head are used when ``generate`` binds the head to its target. ``dtype`` /
        ``device``: default as stored / CPU; they must match the target's. A checkpoint without ``mtp.*`` tensors, or
        with a head of another structure, is a one-line ``ValueError``."""
        config = mtp_checkpoint.read_config(source, revision, local_files_only)
        check_config(config)
        state = mtp_checkpoint.module_state(mtp_checkpoint.read_tensors(source, revision, local_files_only))
        with torch.device("meta"):
            mtp = cls(config)
        expected = mtp.layer.state_dict()
        missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        wrong = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(f"unsupported MTP structure in {source}: the {config.model_type} MTP layer expects "
                             f"other tensors (missing {missing[:4]}, unexpected {unexpected[:4]}, other shapes "
                             f"{wrong[:4]}, MtpLayer names)")
        mtp.layer.load_state_dict({k: v.to(device=device, dtype=dtype if v.is_floating_point() else None)
                                   for k, v in state.items()}, assign=True)
        return mtp.restrict_vocabulary(mtp_checkpoint.read_draft_vocab(source, revision, local_files_only)).eval()

    def save_pretrained(self, folder: str | Path) -> None:
        """The config and the ``mtp.*`` tensors in the released checkpoints' layout, and the draft vocabulary if one
        is set (``draft_vocab.safetensors``): ``from_pretrained`` reads them back (``mtp_checkpoint``)."""
        mtp_checkpoint.write(folder, self.config, self.layer.state_dict())
        mtp_checkpoint.write_draft_vocab(folder, self.draft_vocab)

    # ---- fitting a target ----
    def check_target(self, target) -> None:
        """Raise ``ValueError`` naming every way ``target`` differs from the model this head belongs to."""
        mine, theirs = self.config, target.config.get_text_config()
        problems = [f"{what}: head of {getattr(mine, key)!r}, target has {getattr(theirs, key, None)!r}"
                    for what, key in (("model type", "model_type"), ("hidden size", "hidden_size"),
                                      ("vocabulary", "vocab_size"), ("layer count", "num_hidden_layers"))
                    if getattr(theirs, key, None) != getattr(mine, key)]
        if problems:
            raise ValueError("this MTP head does not fit the target: " + "; ".join(problems) + ". Load the target's "
                             "own head (MTPDrafter.from_pretrained(<target checkpoint>)) or train one with "
                             "`specla-train-drafter --mtp --target ...`.")

    def candidate_generator(self, target, options: DraftOptions) -> MTPTreeDrafter:
        self.check_target(target)
        # the MTP layer attends as the target's layers do (the target's adapter has checked that it takes a mask)
        attention = text_decoder(target).config._attn_implementation
        if attention not in MASKED_ATTENTION:
            raise NotImplementedError(f"the target uses attn_implementation={attention!r}, which takes no tree mask; "
                                      "load it with attn_implementation='sdpa' (or 'eager')")
        self.layer.config._attn_implementation = attention
        return MTPTreeDrafter(self, target, options)


class _MTPRunner(TargetBoundRunner, HybridRunner):
    """The MTP head over its own ``SpecLACache`` (one ``SpecLAAttentionLayer``): ``EagleDrafter``'s drafter adapter,
    with ``HybridRunner``'s caches (a fixed capacity under CUDA graphs, reserved by ``new_cache(max_length=...)``) and
    graphed calls (``GraphedAdapter``: catch-up sequences and prompts as chains, tree buckets, commits).

    A call's inputs are ``(hidden [1, T, H], tokens [1, T])``: the hidden states each position reads and the tokens
    whose target embeddings it reads; its ``logits`` are the draft log-probs (fp32), its one hidden state the layer's
    output ``o`` (what child nodes read). Consuming extends the committed positions; tree nodes (``parents``) are
    pending entries seen by their descendants only, until ``SpecLACache.commit`` keeps the accepted path.
    """

    def __init__(self, mtp: MTPDrafter, target, cuda_graphs: bool | None = None):
        self._bind_target(mtp, target, cuda_graphs)
        self._choose_fusions([mtp.layer.mtp_block])
        self.rotary_emb = text_decoder(target).rotary_emb
        self.last_cache: SpecLACache | None = None
        if mtp.draft_vocab is not None and self.lm_head.bias is not None:
            raise NotImplementedError("a draft vocabulary for an LM head with a bias")
        # the draft vocabulary's LM-head rows, copied once (a fixed tensor the graphs read)
        self.draft_vocab = None if mtp.draft_vocab is None else mtp.draft_vocab.to(self.device)
        self.draft_head = None if mtp.draft_vocab is None else self.lm_head.weight.detach()[self.draft_vocab]
        # tree passes through fused_gemm products (HybridRunner._fused_block) where the block allows them
        self.fused_tree = self.one_kernel_norms and fused_block(mtp.layer.mtp_block, "full_attention")

    def graph_blocker(self) -> str | None:
        return experts_blocker([self.model.layer.mtp_block.mlp])

    def _hidden_norms(self) -> list:
        layer = self.model.layer
        block = layer.mtp_block
        return [layer.enorm, layer.hnorm, block.input_layernorm, block.post_attention_layernorm] + (
            [layer.post_norm] if layer.use_post_norm else [])

    def _attention_modules(self) -> list:
        return [self.model.layer.mtp_block.self_attn]

    def _make_cache(self, batch_size: int, capacity: int, fixed: bool) -> SpecLACache:
        attn = self.model.layer.mtp_block.self_attn
        return SpecLACache([SpecLAAttentionLayer(batch_size, attn.k_proj.out_features // attn.head_dim,
                                                 attn.head_dim, self.dtype, self.device, capacity, fixed)])

    def compute(self, inputs, cache: SpecLACache, parents: torch.Tensor | None, logits_positions,
                hidden_layers: tuple[int, ...], log_probs: bool = True) -> RunnerOutput:
        hidden, tokens = inputs
        layer = cache.layers[0]
        pending_before = cache.num_pending
        if parents is None:
            cache.check_consumable()
            ancestors = None
        else:
            cache.add_nodes(parents)
            ancestors = cache.ancestors[:, pending_before:]
        fused = parents is not None and self.fused_tree and fused_tree_pass(*tokens.shape)
        out = self._mtp_layer(tokens, hidden, layer, attention_inputs(self.rotary_emb, hidden, layer, ancestors),
                              pending=parents is not None, fused=fused)
        top = out if logits_positions is None else out[:, logits_positions]
        logits = self.lm_head(top) if self.draft_head is None else F.linear(top, self.draft_head)
        return RunnerOutput(ops.log_softmax(logits) if log_probs else logits, (out,))     # as ``_BlockRunner``'s

    def _mtp_layer(self, tokens: torch.Tensor, hidden: torch.Tensor, layer: SpecLAAttentionLayer, attention,
                   pending: bool, fused: bool = False) -> torch.Tensor:
        """``MtpLayer.forward`` through the target runner's pieces (the input rows in one kernel, one kernel per other
        zero-centred norm, ``_attention``, ``_mlp``; with ``fused``, tree nodes of batch 1, the block as
        ``_fused_block``): what the module computes, up to where 16-bit intermediates round; its own ops take about
        twice the launches, and a draft depth is bound by them."""
        mtp = self.model.layer
        h = mtp.eh_proj(self._normed_inputs(tokens, hidden))
        block = mtp.mtp_block
        if fused:
            h = self._fused_block(block, "full_attention", layer, h[0], None, None, attention)[None]
        else:
            x = self._attention(block.self_attn, self._norm(block.input_layernorm, h), layer, attention, pending)
            x, h = self._norm(block.post_attention_layernorm, x, residual=h)
            out = self._mlp(block.mlp, x)
            if mtp.use_post_norm:                    # the residual add rides on the closing norm
                return self._norm(mtp.post_norm, out, residual=h)[0]
            return h + out
        return self._norm(mtp.post_norm, h) if mtp.use_post_norm else h

    def _normed_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[enorm(E[tokens]) ; hnorm(hidden)]`` ``[B, T, 2H]`` (the other way round where the config says the
        hidden state comes first): one kernel with one-kernel norms and a ``plain_lookup`` embedding."""
        mtp = self.model.layer
        hidden_first = getattr(mtp.config, "mtp_hidden_states_first", False)
        if not (self.one_kernel_norms and plain_lookup(self.embeddings)):
            inputs = [self._norm(mtp.enorm, self.embeddings(tokens)), self._norm(mtp.hnorm, hidden)]
            return torch.cat(inputs[::-1] if hidden_first else inputs, -1)
        return ops.embed_norm_cat(self.embeddings.weight, tokens, hidden, unit_offset_weight(mtp.enorm), mtp.enorm.eps,
                                  unit_offset_weight(mtp.hnorm), mtp.hnorm.eps, feature_first=hidden_first)


class MTPTreeDrafter(EagleDrafter):
    """Chain and tree drafting with an ``MTPDrafter`` beside its target: ``EagleDrafter``'s drafting (catch-up in
    ``start``, one tree pass per depth with each node fed its parent's output, the device loop's ``catch_up``) on the
    MTP layer (module docstring)."""

    def __init__(self, mtp: MTPDrafter, target, options: DraftOptions):
        DynamicTreeDrafter.__init__(self, options)        # not EagleDrafter.__init__: that one binds a GDN block
        decoder = text_decoder(target)
        top = decoder.config.num_hidden_layers
        self._bind(mtp, _MTPRunner.for_drafter(mtp, target), (top,), top, decoder.norm)
        self.draft_vocab = self.runner.draft_vocab
        self.vocab_size = self.runner.lm_head.weight.shape[0]
