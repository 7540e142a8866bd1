"""Drafters for transformers' GDN hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the EAGLE-style SpecLADrafter (config
from the hybrid's GDN fields, decode-time features equal to training's, lossless greedy decoding, the CPU smoke
training) and the layer-skip drafter."""
import copy
import json

import pytest
import torch

from conftest import tiny_gdn, write_word_corpus
from hybrid_models import FAMILIES, tiny_hybrid, tiny_qwen3_5_vl

# a small vocabulary, so that even random drafters get some drafts accepted
VOCAB = 16
from specla_hf import DraftOptions, SpecLADrafter, SpecLADrafterConfig
from specla_hf.app.loading import layer_skip_drafter
from specla_hf.models.qwen3_5 import HybridRunner, text_decoder


def make_drafter(target, seed: int = 5) -> SpecLADrafter:
    torch.manual_seed(seed)
    return SpecLADrafter(SpecLADrafterConfig.for_target(target.config)).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    target = tiny_hybrid(request.param, seed=0, vocab=VOCAB)
    return target, make_drafter(target)


def test_config_takes_the_hybrids_gdn_shapes_and_text_decoder():
    """Head shapes from the ``linear_*`` fields (value heads 2x key heads here), width, depth and vocabulary from the
    text config; a vision-language model's text decoder fits a drafter made for the text model of its shape, while a
    drafter for fla's GDN does not fit a hybrid."""
    target = tiny_hybrid("qwen3_5")
    cfg = SpecLADrafterConfig.for_target(target.config)
    t = target.config
    assert (cfg.target_model_type, cfg.hidden_size, cfg.vocab_size, cfg.target_num_hidden_layers) == \
        ("qwen3_5_text", t.hidden_size, t.vocab_size, 4)
    assert (cfg.num_heads, cfg.head_dim, cfg.num_v_heads, cfg.expand_v, cfg.conv_size, cfg.use_gate) == \
        (t.linear_num_key_heads, t.linear_key_head_dim, t.linear_num_value_heads, 1.0, 4, True)
    assert cfg.feature_layers == [1, 2, 4]
    drafter = SpecLADrafter(cfg)
    block = drafter.block.attn
    assert (block.num_heads, block.num_v_heads, block.head_k_dim, block.head_v_dim) == (2, 4, 16, 16)
    drafter.check_target(tiny_qwen3_5_vl())
    with pytest.raises(ValueError, match="model type: drafter trained for 'gated_deltanet', target is 'qwen3_5_text'"):
        make_drafter(tiny_gdn(hidden=64)).check_target(target)
    with pytest.raises(ValueError, match="layer count: drafter trained for 4 layers"):
        drafter.check_target(tiny_hybrid("qwen3_5", layers=8))


def test_decode_time_features_and_positions_match_training(pair):
    """Training reads HF ``output_hidden_states`` of the hybrid; decoding reads ``HybridRunner``'s layers (0 =
    embeddings, i = after block i, the top one before the final norm). The runner's layers are HF's entries below
    the top and the top one before the norm; the drafter's distributions at the root, at a depth-2 node and after a
    verified chain equal the sequence-mode forward on HF's features."""
    target, drafter = pair
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    lm_head = target.get_output_embeddings()
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, use_cache=False)
        fused = drafter.fuse(drafter.target_features(out.hidden_states))
        embeds = out.hidden_states[0]
        h_seq = drafter(fused[:, :-1], embeds[:, 1:])
        logp_seq = torch.log_softmax(lm_head(drafter.norm(h_seq)), -1)[0]
        h_deep = drafter(torch.cat([fused[:, :7], h_seq[:, 6:7]], 1), embeds[:, 1:9])
        logp_deep = torch.log_softmax(lm_head(drafter.norm(h_deep[:, 7])), -1)[0]

    tol = dict(rtol=1e-4, atol=1e-4)
    runner = HybridRunner(target)
    layers = runner.forward(ids, runner.new_cache(), hidden_layers=(0, 1, 2, 3, 4)).hidden_states
    for i in range(4):
        torch.testing.assert_close(layers[i], out.hidden_states[i], **tol)
    torch.testing.assert_close(text_decoder(target).norm(layers[4]), out.hidden_states[4], **tol)

    cache = runner.new_cache()
    eagle = drafter.candidate_generator(target, DraftOptions())
    assert eagle.feature_layers == (1, 2, 4)
    prefill = runner.forward(ids[:, :7], cache, logits_positions=slice(0, 0), hidden_layers=eagle.feature_layers)
    eagle.add_features(prefill.hidden_states)
    buf = eagle.buffers = eagle._buffers()
    buf.reset()
    buf.tokens[0] = ids[0, 7]                                    # root: the pending token
    torch.testing.assert_close(eagle.start(ids[:, :8]), logp_seq[6], **tol)
    buf.tokens[1], buf.parents[1] = ids[0, 8], -1
    eagle.add_nodes(1, torch.tensor([0]), None)
    torch.testing.assert_close(eagle.score(2)[0][1], logp_deep, **tol)
    verify = runner.forward(ids[:, 7:11], cache, parents=torch.tensor([[-1, 0, 1, 2]]),
                            hidden_layers=eagle.feature_layers)
    runner.commit(cache, [0, 1, 2, 3])
    eagle.add_features(verify.hidden_states)
    buf.reset()
    buf.tokens[0] = ids[0, -1]
    torch.testing.assert_close(eagle.start(ids), logp_seq[10], **tol)
    assert eagle.consumed == 11


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_identical_to_plain(pair, tree):
    """Chain and tree, selected on the device (no threshold: the device loop's acceptance and catch-up) or pruned on
    the host (a threshold), one-token prompts included; drafts get accepted (on a vocabulary of 16)."""
    target, drafter = pair
    gen = torch.Generator().manual_seed(17)
    accepted = 0
    for n_prompt, n_new, threshold in ((1, 12, 0.0), (9, 24, 0.0), (6, 16, 0.05), (4, 1, 0.0)):
        ids = torch.randint(0, VOCAB, (1, n_prompt), generator=gen)
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=drafter, tree=tree,
                               confidence_threshold=threshold)
        assert torch.equal(spec, plain), (n_prompt, n_new, threshold)
        accepted += sum(target.specla_stats.accepted)
    assert accepted > 0


def test_cpu_smoke_training_for_a_hybrid_target(tmp_path):
    """``specla-train-drafter --cpu-smoke --family qwen3_5``: a random Qwen3.5 target writes the text, the loss
    falls, and the saved drafter drafts for that target losslessly, chain and tree."""
    from specla_hf.training import train_drafter
    gen = torch.Generator().manual_seed(0)
    corpus = write_word_corpus(tmp_path / "corpus.jsonl.xz", gen)
    out = tmp_path / "out"
    train_drafter.main(["--cpu-smoke", "--family", "qwen3_5", "--corpus", str(corpus),
                        "--out", str(out), "--steps", "15", "--eval-every-s", "1000", "--final-eval-s", "1"])
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 15 and log["error"] is None
    assert log["final_loss"] < 0.8 * log["initial_loss"]
    assert all(r["identical"] == 1.0 for r in log["final_eval"].values())

    target = train_drafter.smoke_target(8192, seed=0, family="qwen3_5")
    drafter = SpecLADrafter.from_pretrained(out, dtype=torch.float32)
    assert drafter.config.target_model_type == "qwen3_5_text"
    ids = torch.randint(0, 8192, (1, 8), generator=gen)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    for tree in (False, True):
        spec = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter, tree=tree)
        assert torch.equal(spec, plain)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_vl"])
def test_layer_skip_drafter_of_a_hybrid(family):
    """The target's first block (a GDN layer) as a one-layer model of its class: the truncated target's logits,
    weights and rotary buffers shared with the target, and lossless drafting, chain and tree."""
    target = tiny_qwen3_5_vl() if family == "qwen3_5_vl" else tiny_hybrid(family)
    drafter = layer_skip_drafter(target)
    assert type(drafter) is type(target)
    assert text_decoder(drafter).config.layer_types == ["linear_attention"]
    assert drafter.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert text_decoder(drafter).rotary_emb.inv_freq.data_ptr() == text_decoder(target).rotary_emb.inv_freq.data_ptr()
    truncated = copy.deepcopy(target)
    text_decoder(truncated).layers = text_decoder(truncated).layers[:1]
    text_decoder(truncated).config.num_hidden_layers = 1
    ids = torch.randint(0, VOCAB - 4, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # use_cache=False: the stock forward cannot size a cache of GDN layers only (no attention layer to ask)
        torch.testing.assert_close(drafter(ids, use_cache=False).logits, truncated(ids, use_cache=False).logits)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    for tree in (False, True):
        assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                                           tree=tree), plain)
