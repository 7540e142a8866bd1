"""The inflated model computes the small model's function (and SpecLA decodes it losslessly too)."""
import pytest
import torch
from fla.models import GatedDeltaNetConfig

from conftest import tiny_gdn
from specla_hf.training.inflate import inflate_gdn


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


@pytest.mark.parametrize("kind", ["eagle", "dart"])
def test_inflated_drafter_drafts_what_the_small_drafter_drafts(kind):
    from specla_hf import SpecLADartConfig, SpecLADartDrafter, SpecLADrafter, SpecLADrafterConfig
    from specla_hf.training.inflate import inflate_pair
    from specla_hf.drafters.ngram import bigram_table
    small = tiny_gdn(seed=13, hidden=64, layers=3, heads=2, head_dim=16)
    torch.manual_seed(3)
    if kind == "dart":
        drafter = SpecLADartDrafter(SpecLADartConfig.for_target(small.config, num_heads=2, head_dim=16,
                                                                draft_slots=3)).eval()
        drafter.set_bigram(bigram_table([torch.randint(0, 97, (300,)) % 11], 97, drafter.config.ngram_topk))
    else:
        drafter = SpecLADrafter(SpecLADrafterConfig.for_target(small.config, num_heads=2, head_dim=16)).eval()
    drafter.config.draft_temperature_ratio = 1.25           # the calibration goes with the drafter
    with torch.no_grad():                       # peaked draft distributions: top-k choices are not near-ties
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    cfg = GatedDeltaNetConfig(hidden_size=160, num_hidden_layers=6, num_heads=3, head_dim=32, expand_v=2,
                              hidden_ratio=2, vocab_size=97, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    big, big_drafter = inflate_pair(small, drafter, cfg)           # the aligned drafter is inflated with it
    assert big_drafter.config.feature_layers == [0, 1, 6]        # small top layer 3 -> inflated top layer 6
    assert big_drafter.config.hidden_size == 160 and type(big_drafter) is type(drafter)
    assert big_drafter.config.draft_temperature_ratio == 1.25
    with pytest.raises(ValueError, match="does not fit"):
        big_drafter.check_target(small)

    prompt = torch.randint(0, 97, (1, 9))
    # fixed shapes: the shape policy's choices follow timings, which differ between the two models
    kw = dict(max_new_tokens=24, do_sample=False, tree=True, confidence_threshold=0.0, adaptive_drafting=False)
    out_small = small.generate(prompt, assistant_model=drafter, **kw)
    stats_small = small.specla_stats
    out_big = big.generate(prompt, assistant_model=big_drafter, **kw)
    assert torch.equal(out_big, out_small)
    assert torch.equal(out_small, small.generate(prompt, max_new_tokens=24, do_sample=False))
    assert big.specla_stats.draft_nodes == stats_small.draft_nodes
    assert big.specla_stats.accepted == stats_small.accepted
