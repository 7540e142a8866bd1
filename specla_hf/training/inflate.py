"""Function-preserving inflation of a trained small GDN into a larger GDN shape (e.g. fla's 1.3B default config).

Weights of a 1.3B GDN cannot be downloaded here, but its *cost* can be reproduced exactly: pad hidden, key and value
dims with zeros (RMSNorm weights rescaled so the RMS over the wider width is unchanged), and add blocks whose output
projections are zero. The inflated model computes the small model's function at the large model's cost.

Exactness, up to rounding: hidden-size norms see ``mean(x^2)`` shrink by ``h_small / h_big``, so their weights are
scaled by its square root and ``norm_eps`` by the ratio. The per-head output norm sees its input scaled by
``sqrt(K_small / K_big)`` (the attention scale ``K**-0.5``; q and k are l2-normalised) and its width grow from
``V_small`` to ``V_big``: its epsilon is set on the module accordingly (the inflated model lives in memory only, so
the per-module value need not survive a config round trip).
"""
from __future__ import annotations

import math

import torch
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM


def _pad_rows_per_head(w: torch.Tensor, heads: int, small: int, big: int, big_heads: int) -> torch.Tensor:
    """[heads*small, ...] -> [big_heads*big, ...]: head h's rows go to h*big .. h*big+small, zeros elsewhere."""
    out = w.new_zeros(big_heads, big, *w.shape[1:])
    out[:heads, :small] = w.view(heads, small, *w.shape[1:])
    return out.view(big_heads * big, *w.shape[1:])


@torch.no_grad()
def inflate_gdn(small: GatedDeltaNetForCausalLM, config: GatedDeltaNetConfig,
                device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> GatedDeltaNetForCausalLM:
    s_cfg = small.config
    c = config
    checks = [("hidden_size", c.hidden_size >= s_cfg.hidden_size), ("num_heads", c.num_heads >= s_cfg.num_heads),
              ("head_dim", c.head_dim >= s_cfg.head_dim), ("expand_v", c.expand_v == s_cfg.expand_v),
              ("num_hidden_layers", c.num_hidden_layers >= s_cfg.num_hidden_layers),
              ("vocab_size", c.vocab_size == s_cfg.vocab_size), ("num_v_heads", not s_cfg.num_v_heads),
              ("use_gate/use_short_conv/conv_size", (c.use_gate, c.use_short_conv, c.conv_size) ==
               (s_cfg.use_gate, s_cfg.use_short_conv, s_cfg.conv_size)),
              ("fuse_norm", c.fuse_norm == s_cfg.fuse_norm)]
    bad = [name for name, ok in checks if not ok]
    if bad:
        raise ValueError(f"cannot inflate {s_cfg.model_type} into this config: {', '.join(bad)} incompatible "
                         "(the large shape must be at least as wide/deep, with the same vocabulary and layer options)")
    h_s, h_b = s_cfg.hidden_size, c.hidden_size
    c.norm_eps = s_cfg.norm_eps * h_s / h_b                 # mean(x^2) over the padded width shrinks by h_s/h_b
    device = device or small.device
    dtype = dtype or small.dtype
    with torch.device(device):
        big = GatedDeltaNetForCausalLM(c).to(dtype)
    r_h = math.sqrt(h_s / h_b)
    _put(big.model.embeddings.weight, small.model.embeddings.weight)
    _put(big.lm_head.weight, small.lm_head.weight)
    _put(big.model.norm.weight, small.model.norm.weight * r_h)
    for i, b_block in enumerate(big.model.layers):
        if i >= s_cfg.num_hidden_layers:                     # extra block: full cost, zero contribution
            b_block.attn.o_proj.weight.zero_()
            b_block.mlp.down_proj.weight.zero_()
        else:
            _inflate_block(small.model.layers[i], b_block, r_h)
    return big.eval()


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Zero ``dst`` and write ``src`` into its leading corner."""
    dst.zero_()
    dst[tuple(slice(0, n) for n in src.shape)] = src.to(dst)


def _inflate_block(s_block, b_block, r_h: float) -> None:
    """One fla ``GatedDeltaNetBlock`` into a wider one (hidden-size norms scaled by ``r_h``, heads padded)."""
    _put(b_block.attn_norm.weight, s_block.attn_norm.weight * r_h)
    _put(b_block.mlp_norm.weight, s_block.mlp_norm.weight * r_h)
    for name in ("gate_proj", "up_proj"):
        _put(getattr(b_block.mlp, name).weight, getattr(s_block.mlp, name).weight)
    _put(b_block.mlp.down_proj.weight, s_block.mlp.down_proj.weight)
    sa, ba = s_block.attn, b_block.attn
    H, Hb = sa.num_heads, ba.num_heads
    K, Kb, V, Vb = sa.head_k_dim, ba.head_k_dim, sa.head_v_dim, ba.head_v_dim
    for name, small_dim, big_dim in (("q", K, Kb), ("k", K, Kb), ("v", V, Vb)):
        _put(getattr(ba, f"{name}_proj").weight,
            _pad_rows_per_head(getattr(sa, f"{name}_proj").weight, H, small_dim, big_dim, Hb))
        if sa.use_short_conv:
            _put(getattr(ba, f"{name}_conv1d").weight,
                _pad_rows_per_head(getattr(sa, f"{name}_conv1d").weight, H, small_dim, big_dim, Hb))
    if sa.use_gate:
        _put(ba.g_proj.weight, _pad_rows_per_head(sa.g_proj.weight, H, V, Vb, Hb))
    for name in ("a_proj", "b_proj"):
        _put(getattr(ba, name).weight, getattr(sa, name).weight)
    ba.A_log[:H] = sa.A_log.to(ba.A_log)
    ba.dt_bias[:H] = sa.dt_bias.to(ba.dt_bias)
    _put(ba.o_norm.weight, sa.o_norm.weight * math.sqrt(V / Vb))
    ba.o_norm.eps = sa.o_norm.eps * (K / Kb) * (V / Vb)
    h_s, h_b = sa.o_proj.weight.shape[0], ba.o_proj.weight.shape[0]
    o = sa.o_proj.weight.view(h_s, H, V)
    ba.o_proj.weight.zero_()
    ba.o_proj.weight.view(h_b, Hb, Vb)[:h_s, :H, :V] = o.to(ba.o_proj.weight)


@torch.no_grad()
def inflate_drafter(drafter, small_target: GatedDeltaNetForCausalLM, big_target: GatedDeltaNetForCausalLM):
    """A ``SpecLADrafter`` (or ``SpecLADartDrafter``) trained for ``small_target``, widened for
    ``inflate_gdn(small_target, ...)``.

    The inflated target's hidden states are the small target's padded with zeros, and its top layer (after the extra,
    zero-output blocks) equals the small target's; so the drafter is widened the same way (its block like a target
    block, its feature and input projections padded, norms rescaled) and reads the top feature from the inflated
    target's top layer. It then drafts exactly what the small drafter drafts, at the cost of a drafter of the large
    target's width (one block of the large shape plus the large target's LM head).
    """
    from specla_hf.drafters.dart import SpecLADartDrafter

    drafter.check_target(small_target)
    s_cfg, L_s, L_b = drafter.config, small_target.config.num_hidden_layers, big_target.config.num_hidden_layers
    layers = [L_b if i == L_s else i for i in s_cfg.feature_layers]
    dart = isinstance(drafter, SpecLADartDrafter)
    extra = {k: getattr(s_cfg, k) for k in ("draft_slots", "ngram_topk", "ngram_weight", "ngram_candidates")} \
        if dart else {}
    cfg = type(s_cfg).for_target(big_target.config, feature_layers=layers, hidden_ratio=s_cfg.hidden_ratio,
                                 draft_temperature_ratio=s_cfg.draft_temperature_ratio, **extra)
    h_s, h_b = s_cfg.hidden_size, cfg.hidden_size
    cfg.norm_eps = s_cfg.norm_eps * h_s / h_b          # every hidden-size norm sees mean(x^2) shrink by h_s/h_b
    with torch.device(big_target.device):
        big = type(drafter)(cfg).to(big_target.dtype)
    r_h = math.sqrt(h_s / h_b)
    # fuse() RMS-normalises each padded feature over the wide width: its output grows by 1 / r_h, so fc shrinks
    fc = big.fc.weight.view(h_b, len(layers), h_b)
    fc.zero_()
    fc[:h_s, :, :h_s] = drafter.fc.weight.view(h_s, len(layers), h_s).to(fc) * r_h
    w = big.in_proj.weight.view(h_b, 2, h_b)          # [embedding ; feature] halves
    w.zero_()
    w[:h_s, :, :h_s] = drafter.in_proj.weight.view(h_s, 2, h_s).to(w)
    for name in ("embed_norm", "feature_norm", "norm"):
        _put(getattr(big, name).weight, getattr(drafter, name).weight * r_h)
    _inflate_block(drafter.block, big.block, r_h)
    if dart:       # the slots are block inputs, padded with zeros like the in_proj outputs; the bigram is the same
        _put(big.slot_inputs, drafter.slot_inputs)
        big.set_bigram((drafter.ngram_next, drafter.ngram_logp, drafter.ngram_floor))
    return big.eval()


def default_gdn_shape(small: GatedDeltaNetForCausalLM) -> GatedDeltaNetConfig:
    """fla's default GDN config (its 1.3B shape, the paper's model size) with ``small``'s vocabulary and special
    tokens."""
    c = small.config
    return GatedDeltaNetConfig(vocab_size=c.vocab_size, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                               pad_token_id=c.pad_token_id)


def inflate_pair(small: GatedDeltaNetForCausalLM, drafter, config: GatedDeltaNetConfig | None = None,
                 dtype: torch.dtype | None = None):
    """``small`` inflated (to fla's default shape unless ``config``) and the drafter to use beside it: an aligned
    ``SpecLADrafter`` is inflated with it (``inflate_drafter``), a token-only drafter serves the inflated model as is
    (it computes the small model's function)."""
    big = inflate_gdn(small, config or default_gdn_shape(small), dtype=dtype)
    big_drafter = inflate_drafter(drafter, small, big) if getattr(drafter, "is_specla_drafter", False) else drafter
    return big, big_drafter
