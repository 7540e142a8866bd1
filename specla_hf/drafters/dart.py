"""A DART-style parallel drafter: every draft depth from one drafter pass, the tree guided by a bigram model.

The EAGLE drafter (``specla_hf.drafters.eagle``) runs one drafter pass per depth, each node fed its parent's output. DART
(Liu et al., 2026) instead appends ``draft_slots`` learned mask inputs after the root and reads depth ``d + 1``'s
distribution off slot ``d`` in the same pass. On a GDN drafter the slots are a chain of pending nodes verified from
the committed state (the root already consumed by ``start``): a proposal is ``start`` (catch-up + root: depth 1)
and one chain pass of ``draft_slots`` nodes (depths 2 .. slots + 1), instead of ``start`` and ``depth - 1`` tree
passes. Each depth's distribution is blind to the tokens drafted above it, so the tree couples consecutive levels
with a bigram model of the training text (``specla_hf.drafters.ngram``), stored in the checkpoint:

    q(x | parent a, depth d) = P_M · softmax_{x ∈ top-M of p_d}( log p_d(x) + λ log P_bigram(x | a) )

over the ``ngram_candidates`` (M) most likely tokens of depth ``d``'s distribution ``p_d``, with ``P_M`` their total
mass under ``p_d`` (λ = 0 gives ``p_d`` itself). The tree is then grown exactly as EAGLE-2's (``DynamicTreeDrafter``:
the ``topk`` best frontier nodes by cumulative ``q`` expanded per depth, the global top ``budget`` submitted, pruned
by confidence). The target verifies the tree as any other, so decoding stays lossless whatever the drafts are.

Training (``specla_hf.training.train_drafter --dart-slots``): the root positions are trained as EAGLE's first pass, and at
random branch points ``t`` the slots follow position ``t`` in a sequence-mode pass over ``0..t`` and the slots, each
slot ``j`` against the target's distribution ``j`` positions further on.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from specla_hf.drafters.base import candidate_count
from specla_hf.drafters.options import DraftOptions
from specla_hf.drafters.eagle import EagleBuffers, EagleDrafter, SpecLADrafter, SpecLADrafterConfig
from specla_hf.drafters.ngram import bigram_logp
from specla_kernels import ops


class SpecLADartConfig(SpecLADrafterConfig):
    """A ``SpecLADartDrafter``: a ``SpecLADrafterConfig`` plus the mask slots and the bigram's shape and weight."""

    model_type = "specla_dart"

    def __init__(self, draft_slots: int = 5, ngram_topk: int = 16, ngram_weight: float = 0.25,
                 ngram_candidates: int = 8, **kwargs):
        if draft_slots < 1 or ngram_topk < 1 or ngram_candidates < 1 or ngram_weight < 0:
            raise ValueError(f"draft_slots, ngram_topk and ngram_candidates must be >= 1 and ngram_weight >= 0; got "
                             f"{draft_slots}, {ngram_topk}, {ngram_candidates}, {ngram_weight}")
        self.draft_slots = draft_slots
        self.ngram_topk = ngram_topk
        self.ngram_weight = ngram_weight
        self.ngram_candidates = ngram_candidates
        super().__init__(**kwargs)


class SpecLADartDrafter(SpecLADrafter):
    """The EAGLE drafter's weights plus ``draft_slots`` learned block inputs and the bigram tables (buffers, saved
    with the weights). ``target.generate(ids, assistant_model=dart)`` drafts with a ``DartDrafter``."""

    config_class = SpecLADartConfig
    base_model_prefix = "specla_dart"

    def __init__(self, config: SpecLADartConfig):
        super().__init__(config)
        H, V, S = config.hidden_size, config.vocab_size, config.draft_slots
        self.slot_inputs = nn.Parameter(torch.randn(S, H) * config.initializer_range)
        # an empty bigram (no successors, uniform floor) until ``set_bigram``: λ log P is then a constant per parent
        self.register_buffer("ngram_next", torch.full((V, config.ngram_topk), -1, dtype=torch.int32))
        self.register_buffer("ngram_logp", torch.zeros(V, config.ngram_topk))
        self.register_buffer("ngram_floor", torch.full((V,), -math.log(V)))

    def set_bigram(self, table: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Install a ``specla_hf.drafters.ngram.bigram_table`` of this config's vocabulary and ``ngram_topk``."""
        nxt, logp, floor = table
        if nxt.shape != self.ngram_next.shape or logp.shape != nxt.shape or floor.shape != self.ngram_floor.shape:
            raise ValueError(f"bigram table of shape {tuple(nxt.shape)} does not fit vocabulary "
                             f"{self.config.vocab_size} x ngram_topk {self.config.ngram_topk}")
        self.ngram_next.copy_(nxt)
        self.ngram_logp.copy_(logp)
        self.ngram_floor.copy_(floor)

    def project_input(self, normed: torch.Tensor, n_slots: int = 0) -> torch.Tensor:
        """``SpecLADrafter.project_input``, with the last ``n_slots`` rows' inputs the learned slot inputs instead
        (their features and tokens are not read)."""
        x = super().project_input(normed)
        if not n_slots:
            return x
        slots = self.slot_inputs[:n_slots].to(x.dtype)[None].expand(x.shape[0], -1, -1)
        return torch.cat([x[:, :x.shape[1] - n_slots], slots], 1)

    def forward_slots(self, fused: torch.Tensor, inputs_embeds: torch.Tensor, t: int) -> torch.Tensor:
        """Training: sequence mode over drafter positions ``0..t`` then the slots -> ``h [B, t + 1 + slots, H]``
        (``forward``'s output on the positions; slot ``j``'s row predicts ``j`` tokens past position ``t``'s)."""
        S = self.config.draft_slots
        fused, inputs_embeds = fused[:, :t + 1], inputs_embeds[:, :t + 1]
        pad = lambda x: torch.cat([x, x[:, -1:].expand(-1, S, -1)], 1)     # noqa: E731  (rows the slots replace)
        return self.block(self.block_input(pad(fused), pad(inputs_embeds), S))[0]

    def candidate_generator(self, target, options: DraftOptions) -> DartDrafter:
        self.check_target(target)
        return DartDrafter(self, target, options)


class DartBuffers(EagleBuffers):
    """EAGLE's buffers plus the slot pass's inputs, its chain and every depth's draft log-probs."""

    def __init__(self, topk: int, depth: int, device: torch.device, hidden_size: int, dtype: torch.dtype, slots: int,
                 vocab_size: int):
        super().__init__(topk, depth, device, hidden_size, dtype)
        self.slot_fused = torch.zeros(1, slots + 1, hidden_size, dtype=dtype, device=device)
        self.slot_tokens = torch.zeros(1, slots + 1, dtype=torch.long, device=device)
        self.slot_chain = torch.arange(-1, slots, device=device)[None]
        self.depth_logp = torch.zeros(slots + 1, vocab_size, dtype=torch.float32, device=device)


class DartDrafter(EagleDrafter):
    """``EagleDrafter``'s catch-up and root, then every depth from one slot pass (module docstring). The depth is
    capped at ``draft_slots + 1``; ``topk`` / ``budget`` / ``threshold`` / ``adaptive`` mean what they mean for
    EAGLE."""

    samples_drafts = False       # a node's children come from its n-gram-reranked candidate list, not one distribution

    def __init__(self, drafter: SpecLADartDrafter, target, options: DraftOptions):
        cfg = drafter.config
        options = dataclasses.replace(options, depth=min(options.depth, cfg.draft_slots + 1))
        super().__init__(drafter, target, options)
        self.slots = options.depth - 1               # slots a proposal runs: depths 2 .. depth
        self.weight = cfg.ngram_weight
        self.candidates = max(cfg.ngram_candidates, options.topk)

    def _new_buffers(self) -> DartBuffers:
        return DartBuffers(self.options.topk, self.options.depth, self.drafter.device, self.drafter.config.hidden_size,
                           self.drafter.dtype, self.slots, self.drafter.config.vocab_size)

    def _draft_depths(self, root_consumed: bool) -> None:
        """One pass: the slots as a chain of pending nodes from the committed state (preceded by the root when
        ``start`` could not consume it: a one-token prompt) -> ``depth_logp`` rows ``0..slots``; nothing is kept."""
        b, S = self.buffers, self.slots
        if root_consumed:
            b.depth_logp[0] = b.root_logp
            if S:
                out = self.runner.compute((b.slot_fused[:, :S], b.slot_tokens[:, :S], S), self.cache,
                                           b.slot_chain[:, :S], None, ())
                b.depth_logp[1:] = out.logits[0]
        else:
            b.slot_tokens[:, :1] = b.tokens[:1]       # the root, with the zero feature ``start`` gave it
            out = self.runner.compute((b.slot_fused, b.slot_tokens, S), self.cache, b.slot_chain, None, ())
            b.depth_logp.copy_(out.logits[0])
        self.cache.discard()

    def _depth_step(self, d: int, root_consumed: bool) -> None:
        """``DynamicTreeDrafter._depth_step`` without a drafter pass past depth 1 (and without EAGLE's per-node
        inputs): depth 1 runs the slot pass, every depth expands its frontier from its row of ``depth_logp``."""
        b, K = self.buffers, self.options.topk
        n, F = 1 + K * (d - 1), (1 if d == 1 else K)               # nodes so far; the newest F are the frontier
        if d == 1:
            self._draft_depths(root_consumed)
        top_logp, top_token = self._children(b.depth_logp[d - 1], b.tokens[n - F:n], K)
        ops.expand_frontier(top_logp, top_logp, top_token, b.frontier_score[d - 1, :F], b.frontier_cand[d - 1, :F],
                            b.cand[:, d - 1], b.tokens, b.parents, b.frontier_score[d], b.frontier_cand[d], n,
                            0 if d == 1 else candidate_count(K, d - 1))

    def _children(self, logp: torch.Tensor, parents: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each frontier token's ``k`` best children under ``q`` (module docstring): log-probs and tokens
        ``[F, k]``."""
        lp, cand = torch.topk(logp, self.candidates)                 # [M]
        if self.weight > 0:
            m = self.drafter
            score = lp + self.weight * bigram_logp(m.ngram_next, m.ngram_logp, m.ngram_floor, parents, cand)
            q = torch.log_softmax(score, -1) + torch.logsumexp(lp, 0)
        else:
            q = lp.expand(parents.shape[0], -1)
        top_q, at = torch.topk(q, k, -1)
        return top_q, cand[at]


def register_auto_classes() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load a saved ``SpecLADartDrafter`` (``import specla_hf`` runs this once
    transformers' Auto classes are imported)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(SpecLADartConfig.model_type, SpecLADartConfig, exist_ok=True)
    AutoModelForCausalLM.register(SpecLADartConfig, SpecLADartDrafter, exist_ok=True)
