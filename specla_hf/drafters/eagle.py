"""A target-aligned EAGLE-style drafter for GDN targets: one GDN decoder layer on the target's own features.

Targets: fla's ``GatedDeltaNetForCausalLM`` and transformers' GDN hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, driven
by ``specla_hf.models.qwen3_5.HybridRunner``). The drafter's block is one fla GDN block in either case, as wide as the
target's hidden size, with the target's GDN head shapes (a hybrid's ``linear_*`` fields).

Architecture (``SpecLADrafter``): for draft position ``t``

    g_t = fc([rms(f_t^low) ; rms(f_t^mid) ; rms(f_t^top)])          EAGLE-3 fusion of three target layers
    x_t = in_proj([embed_norm(E(x_{t+1})) ; feature_norm(g_t)])       E = the TARGET's embedding (not stored)
    h_t = GatedDeltaNetBlock(x_t)                                      one fla GDN block (mixer + SwiGLU MLP)
    p(x_{t+2}) = softmax(W_target · norm(h_t))                         the TARGET's LM head (not stored)

Alignment: drafter position ``t`` consumes (target feature of position ``t``, token ``t+1``) and predicts token
``t+2``; the target's own logits at position ``t+1`` are its label. At decode time the pending token ``x_{L-1}`` (the
tree root) sits at drafter position ``L-2``, whose feature ``f_{L-2}`` the target has computed; for deeper draft nodes
the target's features are unknown and the drafter feeds its own output ``h`` in place of ``g`` (EAGLE), which it is
trained for by a two-pass "training-time test" (``specla_hf.training.train_drafter``).

Feature layers use the adapters' numbering (``GDNRunner``, ``HybridRunner``): ``0`` = embeddings, ``i`` = after block
``i``. Hugging Face's ``output_hidden_states`` tuple agrees for ``i < L`` (its entry ``i`` is the input of block ``i``),
for fla's model as for the hybrids, but its last entry is the top block's output *after the final norm*, while the
adapters return it before. The drafter is defined on HF's version: at decode time ``EagleDrafter.add_features``
applies the target's final norm to feature layer ``L``.

Why a GDN layer rather than attention: it is driven by the same tree verification, compact factors and commit as
the target (``SpecLACache``, ``specla_kernels.ops``), so a whole draft tree is scored per depth in one pass, and
its state is O(1) per sequence however long the context; see ``docs/drafter.md`` for chain vs tree acceptance.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from fla.models import GatedDeltaNetConfig
from fla.models.gated_deltanet.modeling_gated_deltanet import GatedDeltaNetBlock
from fla.modules import RMSNorm
from specla_hf.drafters.base import DraftBuffers, DynamicTreeDrafter
from specla_hf.drafters.options import DraftOptions
from specla_hf.models.graphed import DRAFT_SEQ_TOKENS
from specla_hf.runtime.transfer import copy_in, to_device
from specla_hf.models.base import RunnerOutput, plain_lookup
from specla_hf.models.fla_gdn import GDNRunner, fused_block, plain_norm
from specla_hf.models.one_token import fused_tree_pass
from specla_hf.models.qwen3_5 import text_decoder, zero_centred, zero_centred_norm
from specla_kernels import ops


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and top layers (EAGLE-3), in the adapters' numbering; strictly increasing."""
    return tuple(sorted({num_layers // 4, num_layers // 2, num_layers}))


def target_gdn_shape(t: PretrainedConfig) -> dict:
    """The GDN head shapes of a target's (text) config in fla ``GatedDeltaNetConfig`` names: fla's own fields, or a
    hybrid's ``linear_*`` fields (whose GDN layers always have a short conv and an output gate, and beta in (0, 1))."""
    if hasattr(t, "linear_num_key_heads"):
        return dict(num_heads=t.linear_num_key_heads, head_dim=t.linear_key_head_dim,
                    num_v_heads=t.linear_num_value_heads, expand_v=t.linear_value_head_dim / t.linear_key_head_dim,
                    conv_size=t.linear_conv_kernel_dim, use_short_conv=True, use_gate=True, allow_neg_eigval=False,
                    norm_eps=t.rms_norm_eps)
    return dict(num_heads=t.num_heads, head_dim=t.head_dim, num_v_heads=t.num_v_heads, expand_v=t.expand_v,
                conv_size=t.conv_size, use_short_conv=t.use_short_conv, use_gate=t.use_gate,
                allow_neg_eigval=t.allow_neg_eigval, norm_eps=t.norm_eps)


class SpecLADrafterConfig(PretrainedConfig):
    """A ``SpecLADrafter`` and the target it was trained for (its type, width, vocabulary, depth, feature layers).

    ``hidden_size`` and ``vocab_size`` are the target's: the drafter runs in the target's hidden space and reuses its
    embedding and LM head. The remaining fields shape the drafter's one GDN block (fla ``GatedDeltaNetConfig`` names).
    For a vision-language target the target fields are its text decoder's (``target_model_type`` e.g.
    ``"qwen3_5_text"``): the drafter reads only the text decoder.
    """

    model_type = "specla_drafter"

    def __init__(self, hidden_size: int = 384, vocab_size: int = 8192, target_model_type: str = "gated_deltanet",
                 target_num_hidden_layers: int = 4, feature_layers: Sequence[int] | None = None,
                 num_heads: int = 6, head_dim: int = 64, num_v_heads: int | None = None, expand_v: float = 2.0,
                 hidden_ratio: int = 2, intermediate_size: int | None = None, conv_size: int = 4,
                 use_short_conv: bool = True, use_gate: bool = True, allow_neg_eigval: bool = False,
                 norm_eps: float = 1e-6, initializer_range: float = 0.02, draft_temperature_ratio: float = 1.0,
                 **kwargs):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.target_model_type = target_model_type
        self.target_num_hidden_layers = target_num_hidden_layers
        layers = default_feature_layers(target_num_hidden_layers) if feature_layers is None else tuple(feature_layers)
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 \
                or layers[-1] > target_num_hidden_layers:
            raise ValueError(f"feature_layers {list(layers)} must be strictly increasing indices in [0, "
                             f"{target_num_hidden_layers}] (0 = embeddings, i = after target block i)")
        self.feature_layers = list(layers)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_v_heads = num_v_heads
        self.expand_v = expand_v
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.conv_size = conv_size
        self.use_short_conv = use_short_conv
        self.use_gate = use_gate
        self.allow_neg_eigval = allow_neg_eigval
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        # under sampling, the drafter's drawing temperature over the target's: the ratio at which its draws are
        # accepted most often on held-out text (``benchmarks/node_acceptance.py --ratios``)
        self.draft_temperature_ratio = draft_temperature_ratio
        kwargs.setdefault("tie_word_embeddings", False)   # nothing to tie: embedding and head are the target's
        super().__init__(**kwargs)

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, feature_layers: Sequence[int] | None = None,
                   **block_overrides) -> SpecLADrafterConfig:
        """A drafter config fitted to ``target_config`` (fla GDN or a GDN hybrid); the GDN block copies the target's
        GDN head shapes (``target_gdn_shape``)."""
        t = target_config.get_text_config()
        block = {**target_gdn_shape(t), **block_overrides}
        return cls(hidden_size=t.hidden_size, vocab_size=t.vocab_size, target_model_type=t.model_type,
                   target_num_hidden_layers=t.num_hidden_layers, feature_layers=feature_layers,
                   pad_token_id=t.pad_token_id, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, **block)

    def block_config(self) -> GatedDeltaNetConfig:
        """The fla config of the drafter's GDN block (fused norms: the layout ``GDNRunner`` drives)."""
        return GatedDeltaNetConfig(hidden_size=self.hidden_size, num_hidden_layers=1, num_heads=self.num_heads,
                                   head_dim=self.head_dim, num_v_heads=self.num_v_heads, expand_v=self.expand_v,
                                   hidden_ratio=self.hidden_ratio, intermediate_size=self.intermediate_size,
                                   conv_size=self.conv_size, use_short_conv=self.use_short_conv,
                                   use_gate=self.use_gate, allow_neg_eigval=self.allow_neg_eigval,
                                   norm_eps=self.norm_eps, hidden_act="swish", fuse_norm=True,
                                   vocab_size=self.vocab_size)


class SpecLADrafter(PreTrainedModel):
    """The drafter's weights (see module docstring); ``candidate_generator`` turns it into an ``EagleDrafter``.

    Pass it as ``target.generate(ids, assistant_model=drafter)``: ``specla_hf.generation`` recognises
    ``is_specla_drafter`` and calls ``check_target`` then ``candidate_generator``.
    """

    config_class = SpecLADrafterConfig
    base_model_prefix = "specla_drafter"
    _no_split_modules = ["GatedDeltaNetBlock"]
    is_specla_drafter = True

    def __init__(self, config: SpecLADrafterConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * H, H, bias=False)
        self.embed_norm = RMSNorm(H, eps=config.norm_eps)
        self.feature_norm = RMSNorm(H, eps=config.norm_eps)
        self.in_proj = nn.Linear(2 * H, H, bias=False)
        self.block = GatedDeltaNetBlock(config.block_config(), layer_idx=0)
        self.norm = RMSNorm(H, eps=config.norm_eps)
        self.post_init()

    def fuse(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Target features ``[B, T, H]`` per feature layer (HF numbering, see module docstring) -> ``g [B, T, H]``.
        Each is RMS-normalised first: the residual stream's scale grows with depth."""
        return self.fc(torch.cat([F.rms_norm(f, (f.shape[-1],), eps=self.config.norm_eps) for f in features], -1))

    def target_features(self, hidden_states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The feature layers out of a target forward's ``output_hidden_states`` tuple: its entry ``i < L`` is
        the adapters' layer ``i``, its last entry layer ``L`` after the target's final norm (module docstring)."""
        return [hidden_states[i] for i in self.config.feature_layers]

    def block_input(self, fused: torch.Tensor, inputs_embeds: torch.Tensor, *more) -> torch.Tensor:
        """``[embedding of token t+1 ; feature of position t]`` -> the GDN block's input (``more``: what
        ``project_input`` takes beyond the normed rows)."""
        return self.project_input(torch.cat([self.embed_norm(inputs_embeds), self.feature_norm(fused)], -1), *more)

    def project_input(self, normed: torch.Tensor) -> torch.Tensor:
        """``[embed_norm(embedding) ; feature_norm(feature)]`` -> the GDN block's input. Decoding computes the normed
        rows in one kernel (``ops.embed_norm_cat``) and enters here."""
        return self.in_proj(normed)

    def forward(self, fused: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Sequence mode (training): ``fused [B, T, H]`` from ``fuse`` (or the drafter's own outputs, shifted),
        ``inputs_embeds [B, T, H]`` the target's embeddings of the next tokens -> output hidden ``h [B, T, H]``
        (before the final norm; logits are ``target.lm_head(drafter.norm(h))``)."""
        return self.block(self.block_input(fused, inputs_embeds))[0]

    # ---- fitting a target ----
    def check_target(self, target) -> None:
        """Raise ``ValueError`` naming every way ``target`` differs from the model this drafter was trained for."""
        cfg, t = self.config, target.config.get_text_config()
        problems = []
        if t.model_type != cfg.target_model_type:
            problems.append(f"model type: drafter trained for {cfg.target_model_type!r}, target is {t.model_type!r}")
        if t.vocab_size != cfg.vocab_size:
            problems.append(f"vocabulary: drafter trained for {cfg.vocab_size} tokens, target has {t.vocab_size}")
        if t.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size: drafter trained for {cfg.hidden_size}, target has {t.hidden_size}")
        if t.num_hidden_layers != cfg.target_num_hidden_layers:
            problems.append(f"layer count: drafter trained for {cfg.target_num_hidden_layers} layers (features from "
                            f"layers {cfg.feature_layers}), target has {t.num_hidden_layers}")
        if problems:
            raise ValueError("this SpecLA drafter does not fit the target: " + "; ".join(problems) + ". Train one "
                             "for this target with `specla-train-drafter --target ...`.")

    def candidate_generator(self, target, options: DraftOptions) -> EagleDrafter:
        self.check_target(target)
        return EagleDrafter(self, target, options)


class TargetBoundRunner:
    """A drafter's adapter that reads its target's embeddings and LM head: one per drafter and target, kept on the
    drafter (``for_drafter``), so the graphs captured in one generate() call serve the next ones."""

    def _bind_target(self, drafter, target, cuda_graphs: bool | None) -> None:
        """Not the adapter's own ``__init__``: that one checks and walks a whole target model."""
        self.model, self.target = drafter, target
        self.built_for = (drafter.device, drafter.dtype)
        self.embeddings = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self._init_graphs(cuda_graphs, DRAFT_SEQ_TOKENS)

    @classmethod
    def for_drafter(cls, drafter, target):
        runner = drafter.__dict__.get("_specla_runner")
        if runner is None or runner.target is not target or runner.built_for != (drafter.device, drafter.dtype):
            runner = cls(drafter, target)
            drafter.__dict__["_specla_runner"] = runner
        return runner


class _BlockRunner(TargetBoundRunner, GDNRunner):
    """``GDNRunner``'s machinery (tree verification and factors, CUDA graphs, tree buckets) on the drafter's block.

    A call's inputs are ``(fused features [1, T, H], tokens [1, T], *more)`` instead of token ids (``more``: further
    arguments of the drafter's ``project_input``, e.g. ``SpecLADartDrafter``'s slots); its ``logits`` are the
    draft log-probs (fp32) and its one hidden state the drafter's output ``h``.
    """

    def __init__(self, drafter: SpecLADrafter, target, cuda_graphs: bool | None = None):
        self.config = drafter.config
        self.blocks = [drafter.block]
        self.mixers = [drafter.block.attn]
        self._bind_target(drafter, target, cuda_graphs)
        self._fuse_weights()
        self.one_kernel_inputs = plain_norm(drafter.embed_norm) and plain_norm(drafter.feature_norm)
        # tree passes through fused_gemm products (GDNRunner._fused_layer) where the block and head allow them
        self.fused_tree = (fused_block(drafter.block) and plain_norm(drafter.norm)
                           and getattr(self.lm_head, "bias", None) is None)

    def compute(self, inputs, cache, parents, logits_positions, hidden_layers,
                log_probs: bool = True) -> RunnerOutput:
        fused, tokens, *more = inputs                 # more: what the drafter's project_input takes beyond these
        if parents is None:
            cache.check_consumable()
            all_parents = None
        else:
            all_parents = cache.add_nodes(parents)
        x = self.model.project_input(self._normed_inputs(fused, tokens), *more)
        block, norm = self.blocks[0], self.model.norm
        if parents is not None and self.fused_tree and fused_tree_pass(*x.shape[:2]):
            h = self._fused_layer(block, cache.layers[0], x[0], all_parents, cache.ancestors)
            top = h if logits_positions is None else h[logits_positions]
            logits = ops.fused_gemm(self.lm_head.weight, top, norm=(norm.weight, norm.eps))[None]
            h = h[None]
        else:
            y = self._mixer(0, block.attn_norm(x), cache.layers[0], all_parents, cache.ancestors)
            y, residual = block.mlp_norm(y, residual=x, prenorm=True)
            top, h = norm(self._mlp(0, y), residual=residual, prenorm=True)       # the residual add rides on it
            logits = self.lm_head(top if logits_positions is None else top[:, logits_positions])
        # fp32 log-probs, from 16-bit logits in one launch (``log_probs`` False: the logits, for a kernel that
        # normalises them itself)
        return RunnerOutput(ops.log_softmax(logits) if log_probs else logits, (h,))

    def _normed_inputs(self, fused: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[embed_norm(E[tokens]) ; feature_norm(fused)]`` ``[B, T, 2H]``: one kernel where the embedding is a
        ``plain_lookup`` and both norms fla's plain ``RMSNorm``, else the modules."""
        m = self.model
        if not (self.one_kernel_inputs and plain_lookup(self.embeddings)):
            return torch.cat([m.embed_norm(self.embeddings(tokens)), m.feature_norm(fused)], -1)
        return ops.embed_norm_cat(self.embeddings.weight, tokens, fused, m.embed_norm.weight, m.embed_norm.eps,
                                  m.feature_norm.weight, m.feature_norm.eps)


class EagleBuffers(DraftBuffers):
    """The shared tree buffers plus, per slot, the node's input feature, and the root's output hidden state (its
    children's feature; deeper nodes read their parents' from the depth's own pass)."""

    def __init__(self, topk: int, depth: int, device: torch.device, hidden_size: int, dtype: torch.dtype):
        super().__init__(topk, depth, device)
        self.fused = torch.zeros(1, self.capacity, hidden_size, dtype=dtype, device=device)
        self.root_hidden = torch.zeros(1, hidden_size, dtype=dtype, device=device)


class EagleDrafter(DynamicTreeDrafter):
    """Dynamic-tree drafting with a ``SpecLADrafter`` beside a GDN or hybrid target (alignment in the module
    docstring).

    The drafter's committed state has consumed drafter positions ``< consumed``, always with the target's true
    features. ``start`` catches up with buffered features in sequence mode, the root included (its feature is the
    target's too), and returns the root's draft log-probs; ``score`` verifies the draft tree, each node fed its
    parent's output hidden state (``add_nodes``) in place of the target's feature. Nothing stays pending after a step:
    the accepted positions get their true features from the verify pass and are consumed by the next ``start`` (a
    re-run of the one-layer drafter, never of the target).
    """

    def __init__(self, drafter: SpecLADrafter, target, options: DraftOptions):
        super().__init__(options)
        self.temperature_ratio = float(drafter.config.draft_temperature_ratio)
        self._bind(drafter, _BlockRunner.for_drafter(drafter, target), tuple(drafter.config.feature_layers),
                   target.config.get_text_config().num_hidden_layers, text_decoder(target).norm)

    def _bind(self, drafter, runner, feature_layers: tuple[int, ...], top: int, target_norm) -> None:
        """The drafter's weights (``fuse``, hidden size, device, dtype) and adapter (``runner``), and the target
        layers it reads: ``feature_layers`` in the target adapter's numbering, ``top`` of them read after the target's
        final norm ``target_norm`` (module docstring). A drafter of another block on the same alignment binds its own
        (``specla_hf.drafters.mtp``)."""
        self.drafter, self.runner = drafter, runner
        self.feature_layers, self.top, self.target_norm = feature_layers, top, target_norm
        self.cache = runner.new_cache(1)
        self.consumed = 0
        # fused features of target positions consumed..: committed by the target, not yet by the drafter
        self.features = torch.empty(1, 0, drafter.config.hidden_size, dtype=drafter.dtype, device=drafter.device)

    @torch.no_grad()
    def add_features(self, features: tuple[torch.Tensor, ...], positions: list[int] | None = None) -> None:
        if len(features) != len(self.feature_layers):
            raise ValueError(f"expected target features of layers {self.feature_layers}, got {len(features)} tensors")
        fused = None
        if positions is not None and self.runner.graphs is not None and len(positions) <= self.options.depth + 1:
            fused = self._graphed_fuse(features, positions)
        if fused is None:                    # no graphs, a prefill, or a failed capture
            if positions is not None:
                on_path = to_device(torch.tensor(positions), self.features.device)
                features = tuple(f.index_select(1, on_path) for f in features)
            fused = self._fuse(features)
        self.features = torch.cat([self.features, fused], 1)

    def _fuse(self, features: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # the adapters give the top layer before the target's final norm, HF's hidden_states (training) after it
        feats = [self._target_normed(f) if layer == self.top else f for layer, f in zip(self.feature_layers, features)]
        return self.drafter.fuse(feats)

    def _target_normed(self, h: torch.Tensor) -> torch.Tensor:
        """The target's final norm of its top hidden state: one kernel for a hybrid's zero-centred norm, whose module
        takes ~9 launches (every step's catch-up runs it). The scale is read fresh on every eager call (the prefill's
        among them), so the graphed calls see a weight updated between generations."""
        return zero_centred_norm(self.target_norm, h) if zero_centred(self.target_norm) else self.target_norm(h)

    def _graphed_fuse(self, features: tuple[torch.Tensor, ...], positions: list[int]) -> torch.Tensor | None:
        """``_fuse`` of the verify nodes ``positions`` as gathers into static buffers plus one CUDA-graph replay (one
        graph per path length): the fusion's ~10 small kernels cost more host time than GPU time. ``None`` if that
        length's capture failed."""
        n, cap = len(positions), self.options.depth + 1
        graphs = self.runner.graphs
        raw = graphs.static(("fuse inputs", cap), lambda: [f.new_empty(1, cap, f.shape[-1]) for f in features])
        on_path = graphs.static(("fuse path", cap), lambda: [torch.zeros(length, dtype=torch.long,
                                                                          device=self.features.device)
                                                              for length in range(cap + 1)])
        if ("fuse", cap, n) not in graphs.calls:
            # every path length at once (none is then captured mid-generation), reading the gather buffers they share
            for length in range(1, cap + 1):
                graphs.capture(("fuse", cap, length), lambda length=length: self._fuse(tuple(r[:, :length]
                                                                                        for r in raw)),
                               "the drafter's feature fusion")
        static = graphs.calls[("fuse", cap, n)]
        if static is None:
            return None
        copy_in(on_path[n], torch.tensor(positions))
        for r, f in zip(raw, features):
            torch.index_select(f, 1, on_path[n], out=r[:, :n])
        return static.replay()

    def _new_buffers(self) -> EagleBuffers:
        return EagleBuffers(self.options.topk, self.options.depth, self.drafter.device,
                            self.drafter.config.hidden_size, self.drafter.dtype)

    def start(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        committed = input_ids.shape[1] - 1               # target positions in the target's state
        if self.consumed + self.features.shape[1] != committed:
            raise RuntimeError(f"the drafter holds features of {self.consumed + self.features.shape[1]} positions "
                               f"but the target committed {committed}: was one drafter shared by two generations?")
        if not committed:
            # a one-token prompt has no target feature for the root: a zero feature, scored as node 0, never committed
            self.buffers.fused[:, :1].zero_()
            return None
        # positions consumed..committed-1 read tokens consumed+1..committed; the last is the root (position
        # committed-1, reading the pending token): all have their true features, so all are committed here
        n = committed - self.consumed
        if n < 1:
            raise RuntimeError("this sequence's root was consumed by an earlier proposal: a proposal follows a "
                               "verify step that grew the sequence")
        tokens = input_ids[:, self.consumed + 1:committed + 1]      # the runner copies host tokens in, no sync
        out = self.runner.forward((self.features[:, :n], tokens), self.cache, logits_positions=slice(-1, None))
        self.features, self.consumed = self.features[:, n:], committed
        self.buffers.root_hidden[0].copy_(out.hidden_states[0][0, -1])       # what the root's children read
        return out.logits[0, -1]

    def score(self, n: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        out = self.runner.compute((b.fused[:, :n], b.tokens[None, :n]), self.cache, b.parents[None, :n], rows, (),
                                  log_probs=self._warpers is None)
        self.cache.discard()
        return out.logits[0], out.hidden_states[0][0]

    def add_nodes(self, first: int, parents: torch.Tensor, outputs: torch.Tensor | None) -> None:
        b = self.buffers         # each new node's feature: its parent's output hidden state (EAGLE), one gather
        source = b.root_hidden if outputs is None else outputs
        torch.index_select(source, 0, parents, out=b.fused[0, first:first + parents.shape[0]])

    # ---- steps accepted on the device (``speculative_decode``'s device loop) ----
    catches_up_on_device = True

    def catch_up(self, features: tuple[torch.Tensor, ...], accepted) -> None:
        """``add_features`` and ``start`` for a path accepted on the device (``accepted``: a ``DeviceAcceptance``),
        in static shapes: the features of all ``depth + 1`` path slots are fused, and the drafter verifies them as a
        chain of that many nodes from its committed state (slots past the path's end are computed and never
        committed), commits the path's last node and sets the root of the next proposal from it. The chain verify
        replaces ``start``'s sequence-mode catch-up: the same recurrence, up to summation order. The LM head runs on
        the last node's slot only."""
        b = self._buffers()
        b.reset()
        fused = self._fuse(tuple(f.index_select(1, accepted.path) for f in features))
        last = accepted.length - 1
        out = self.runner.compute((fused, accepted.emitted[None]), self.cache, b.chain, last, ())
        self._root_from(accepted, last, out.logits[0, 0])
        b.root_hidden.copy_(out.hidden_states[0][0].index_select(0, last))     # what the root's children read


def register_auto_classes() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load a saved ``SpecLADrafter`` (``import specla_hf`` runs this once
    transformers' Auto classes are imported)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(SpecLADrafterConfig.model_type, SpecLADrafterConfig, exist_ok=True)
    AutoModelForCausalLM.register(SpecLADrafterConfig, SpecLADrafter, exist_ok=True)
