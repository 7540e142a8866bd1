"""The inflated model computes the small model's function (and SpecLA decodes it losslessly too)."""
import torch
from fla.models import GatedDeltaNetConfig

from conftest import tiny_gdn
from specla_hf.inflate import inflate_gdn


def test_inflated_model_matches_small_model():
    small = tiny_gdn(seed=12, hidden=64, layers=2, heads=2, head_dim=16)
    cfg = GatedDeltaNetConfig(hidden_size=160, num_hidden_layers=5, num_heads=3, head_dim=32, expand_v=2,
                              hidden_ratio=2, vocab_size=97, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    big = inflate_gdn(small, cfg)
    assert sum(p.numel() for p in big.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    ids = torch.randint(0, 97, (2, 19))
    torch.testing.assert_close(big(ids).logits, small(ids).logits, rtol=1e-4, atol=2e-5)
    prompt = ids[:1, :7]
    plain_small = small.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(big.generate(prompt, max_new_tokens=20, do_sample=False), plain_small)
    assert torch.equal(big.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=small, tree=True,
                                    confidence_threshold=0.0), plain_small)
