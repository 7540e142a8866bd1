"""Bad input gets a clear error naming what is wrong, never a silent wrong answer."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_gdn
from specla_hf.models.fla_gdn import GDNRunner

IDS = torch.randint(0, 97, (1, 5))


def gen(target, drafter, ids=IDS, **kw):
    return target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter, **kw)


def test_non_gdn_drafter(target):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(TypeError, match="GatedDeltaNetForCausalLM"):
        gen(target, llama)
    with pytest.raises(TypeError, match="GatedDeltaNetForCausalLM as the target"):
        GDNRunner(llama)


def test_hybrid_target_is_refused():
    model = tiny_gdn()
    model.config.attn = {"layers": [1], "num_heads": 2}
    with pytest.raises(NotImplementedError, match="hybrid"):
        GDNRunner(model)


def test_vocabulary_mismatch(target):
    with pytest.raises(ValueError, match=r"vocabulary \(50\) differs from the target's \(97\)"):
        gen(target, tiny_gdn(vocab=50))


def test_batch_size(target, bad_drafter):
    with pytest.raises(ValueError, match="batch size 1"):
        gen(target, bad_drafter, ids=torch.randint(0, 97, (2, 5)))


def test_beam_search(target, bad_drafter):
    with pytest.raises(ValueError, match="num_beams=2"):
        gen(target, bad_drafter, num_beams=2)


def test_drafter_dtype_and_device(target):
    with pytest.raises(ValueError, match="dtype torch.bfloat16 differs"):
        gen(target, tiny_gdn(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="drafter is on meta"):
        gen(target, tiny_gdn().to("meta"))


def test_unsupported_outputs_and_padding(target, bad_drafter):
    with pytest.raises(ValueError, match="output_hidden_states"):
        gen(target, bad_drafter, return_dict_in_generate=True, output_hidden_states=True)
    with pytest.raises(ValueError, match="padding"):
        gen(target, bad_drafter, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))


def test_draft_option_errors(target, bad_drafter):
    with pytest.raises(ValueError, match="pass tree=True"):
        gen(target, bad_drafter, tree_budget=8)
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\), got 1.5"):
        gen(target, bad_drafter, confidence_threshold=1.5)
    with pytest.raises(ValueError, match="tree_topk must be a positive integer, got 0"):
        gen(target, bad_drafter, tree=True, tree_topk=0)
    with pytest.raises(ValueError, match="tree_budget=1000: a verify pass takes at most 128 nodes"):
        gen(target, bad_drafter, tree=True, tree_budget=1000)
    for ratio in (0, -1.0, float("nan"), float("inf"), "1.2"):
        with pytest.raises(ValueError, match="draft_temperature_ratio must be a positive number"):
            gen(target, bad_drafter, draft_temperature_ratio=ratio)


def test_degenerate_prompts(target, bad_drafter):
    """An empty prompt, float ids and ids outside the vocabulary (a device-side assert on CUDA) are named."""
    with pytest.raises(ValueError, match=r"input_ids of shape \(1, 0\): SpecLA needs at least one prompt token"):
        gen(target, bad_drafter, ids=torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype torch.float32"):
        gen(target, bad_drafter, ids=IDS.float())
    for bad in (97, -1):
        with pytest.raises(ValueError, match=f"token id {bad}, outside the model's vocabulary of 97"):
            gen(target, bad_drafter, ids=torch.tensor([[3, bad, 4]]))


def test_plain_generate_untouched(target):
    """Without assistant_model the stock generate runs (and still works on CPU through the torch path)."""
    out = target.generate(IDS, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8) and not hasattr(out, "specla_stats")
