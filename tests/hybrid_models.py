"""Small random GDN hybrids of transformers (Qwen3.5 dense and MoE, Qwen3-Next) for CPU tests."""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
VOCAB = 97


def _shape(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, k_heads: int, v_heads: int,
           vocab: int, attention_every: int) -> dict:
    """Config keywords every family shares: every ``attention_every``-th layer full attention, the others GDN
    (value heads a multiple of the key heads), half the attention head dim rotated."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["full_attention" if (i + 1) % attention_every == 0 else "linear_attention"
                             for i in range(layers)],
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
                eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _moe(experts: int = 4) -> dict:
    return dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)


def tiny_config(family: str, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                k_heads: int = 2, v_heads: int = 4, vocab: int = VOCAB, attention_every: int = 4):
    shape = _shape(layers, hidden, heads, kv_heads, head_dim, k_heads, v_heads, vocab, attention_every)
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**shape)
    if family == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**shape, **_moe())
    if family == "qwen3_next":
        return Qwen3NextConfig(**shape, **_moe(), norm_topk_prob=True, decoder_sparse_step=1)
    raise ValueError(family)


MODEL_CLASSES = {"qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM,
                 "qwen3_next": Qwen3NextForCausalLM}


def spread_weights_(model: nn.Module, seed: int) -> None:
    """Random weights large enough that every part matters and argmaxes are not near-ties: transformers' init gives
    near-uniform logits, and decays near 1 (GDN gates that barely gate)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-2.0, 1.0, generator=gen))
            elif "norm" in name:                # zero-centred RMSNorms (1 + w) and the gated norm (w)
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in ** 0.5))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def tiny_hybrid(family: str = "qwen3_5", seed: int = 0, attn_implementation: str = "sdpa", **shape) -> nn.Module:
    """A small random ``family`` causal LM (fp32, eval)."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](tiny_config(family, **shape))
    model.config._attn_implementation = attn_implementation
    spread_weights_(model, seed)
    return model.eval()


def tiny_qwen3_5_vl(seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """A small random Qwen3.5 vision-language model: the text decoder of ``tiny_hybrid("qwen3_5")`` with a one-block
    vision tower."""
    torch.manual_seed(seed)
    text = tiny_config("qwen3_5").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                           video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4)
    model = Qwen3_5ForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    spread_weights_(model, seed)
    return model.eval()
