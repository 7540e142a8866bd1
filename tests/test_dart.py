"""The DART parallel drafter: the bigram table, serialization, one pass for every depth, the tree's scores,
losslessness, and its training mode."""
import json
import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_gdn, write_word_corpus
from specla_hf import DraftOptions, SpecLADartConfig, SpecLADartDrafter, SpecLADrafter, SpecLADrafterConfig
from specla_hf.drafters.ngram import bigram_logp, bigram_table


def make_dart(target, seed: int = 7, slots: int = 4, **overrides) -> SpecLADartDrafter:
    torch.manual_seed(seed)
    cfg = SpecLADartConfig.for_target(target.config, **{"num_heads": 2, "head_dim": 16, "draft_slots": slots,
                                                        **overrides})
    dart = SpecLADartDrafter(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    dart.set_bigram(bigram_table([torch.randint(0, cfg.vocab_size, (400,), generator=gen) % 13],
                                 cfg.vocab_size, cfg.ngram_topk))
    return dart


@pytest.fixture(scope="module")
def dart(target):
    return make_dart(target)


# ---------------------------------------------------------------------------------------------------------------
# the bigram
# ---------------------------------------------------------------------------------------------------------------
def test_bigram_table_counts_and_lookup():
    gen = torch.Generator().manual_seed(0)
    V, k, alpha = 11, 3, 0.25
    rows = [torch.randint(0, 6, (n,), generator=gen) for n in (40, 1, 17, 0, 25)]      # tokens 6..10 never seen
    nxt, logp, floor = bigram_table(rows, V, topk=k, smoothing=alpha)
    pairs = Counter((int(a), int(b)) for r in rows for a, b in zip(r[:-1], r[1:]))
    for a in range(V):
        succ = sorted(((c, b) for (x, b), c in pairs.items() if x == a), key=lambda cb: (-cb[0], cb[1]))[:k]
        total = sum(c for (x, _), c in pairs.items() if x == a)
        assert nxt[a].tolist() == [b for _, b in succ] + [-1] * (k - len(succ))
        want = [math.log((c + alpha) / (total + alpha * V)) for c, _ in succ]
        torch.testing.assert_close(logp[a, :len(succ)], torch.tensor(want), rtol=1e-6, atol=1e-6)
        assert floor[a].item() == pytest.approx(math.log(alpha / (total + alpha * V)), rel=1e-6)
    prev, cand = torch.tensor([0, 3, 7]), torch.arange(V)
    got = bigram_logp(nxt, logp, floor, prev, cand)
    for f, a in enumerate(prev.tolist()):
        for b in range(V):
            hit = (nxt[a] == b).nonzero()
            assert got[f, b] == (logp[a, hit[0, 0]] if len(hit) else floor[a])
    with pytest.raises(ValueError, match="token ids"):
        bigram_table([torch.tensor([1, V])], V)


# ---------------------------------------------------------------------------------------------------------------
# config, serialization
# ---------------------------------------------------------------------------------------------------------------
def test_save_pretrained_round_trip_keeps_slots_and_bigram(dart, target, tmp_path):
    dart.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "specla_dart"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is SpecLADartDrafter and loaded.config.draft_slots == 4
    sa, sb = dart.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and {"slot_inputs", "ngram_next", "ngram_logp", "ngram_floor"} <= sa.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="vocabulary: drafter trained for 97 tokens"):
        tiny_gdn(seed=2, vocab=101).generate(torch.tensor([[1, 2]]), max_new_tokens=2, assistant_model=loaded)
    with pytest.raises(ValueError, match="does not fit vocabulary"):
        loaded.set_bigram(bigram_table([torch.tensor([1, 2])], 50, loaded.config.ngram_topk))
    with pytest.raises(ValueError, match="draft_slots"):
        SpecLADartConfig(draft_slots=0)


# ---------------------------------------------------------------------------------------------------------------
# one pass drafts every depth; the tree's scores
# ---------------------------------------------------------------------------------------------------------------
def _sequence_mode(target, dart, ids: torch.Tensor) -> torch.Tensor:
    """Training's view of a proposal after ``ids`` (the last one pending): the drafter over positions ``0..L-2``
    then the slots, in sequence mode -> draft log-probs of depths 1 .. slots + 1."""
    with torch.no_grad():
        if ids.shape[1] == 1:      # the root has no target feature: a zero one
            fused = torch.zeros(1, 1, dart.config.hidden_size)
        else:
            out = target(ids[:, :-1], output_hidden_states=True)
            fused = dart.fuse(dart.target_features(out.hidden_states))
        embeds = target.get_input_embeddings()(ids[:, 1:] if ids.shape[1] > 1 else ids)
        t = fused.shape[1] - 1
        h = dart.forward_slots(fused, embeds, t)[0, t:]
        return torch.log_softmax(target.lm_head(dart.norm(h)), -1)


@pytest.mark.parametrize("length", [1, 9])
def test_one_pass_gives_every_depth_as_training_sees_it(target, dart, length):
    """After ``start`` the proposal's slot pass (a chain of pending nodes from the drafter's committed state, or the
    root and the slots for a one-token prompt) gives each depth's distribution as training's sequence mode does, and
    leaves nothing pending."""
    ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(length))
    options = DraftOptions(depth=5, topk=2, budget=8)
    drafter = dart.candidate_generator(target, options)
    if length > 1:
        from specla_hf import GDNRunner
        prefill = GDNRunner(target).forward(ids[:, :-1], GDNRunner(target).new_cache(1), logits_positions=slice(0, 0),
                                            hidden_layers=drafter.feature_layers)
        drafter.add_features(prefill.hidden_states)
    drafter.propose(ids)
    torch.testing.assert_close(drafter.buffers.depth_logp, _sequence_mode(target, dart, ids), rtol=1e-4, atol=1e-4)
    assert drafter.cache.num_pending == 0 and drafter.consumed == length - 1
    with pytest.raises(ValueError, match="depth"):
        DraftOptions(depth=0)
    assert dart.candidate_generator(target, DraftOptions(depth=12)).options.depth == 5   # slots + 1


@pytest.mark.parametrize("weight", [0.0, 0.7])
def test_tree_nodes_score_the_depth_marginal_times_the_bigram(target, weight):
    """Every drafted node's log-probability step is ``log q(x | parent token, depth)`` of ``specla_hf.drafters.dart`` over
    the ``ngram_candidates`` best tokens of its depth's distribution (with weight 0: that distribution itself)."""
    dart = make_dart(target, seed=11, slots=3, ngram_weight=weight, ngram_candidates=6)
    drafter = dart.candidate_generator(target, DraftOptions(depth=4, topk=3, budget=20))
    tree = drafter.propose(torch.tensor([[4]]))
    depth_logp = drafter.buffers.depth_logp
    depth = [0] * len(tree)
    nxt, lp_ng, floor = dart.ngram_next, dart.ngram_logp, dart.ngram_floor
    for i in range(1, len(tree)):
        p = int(tree.parents[i])
        depth[i] = depth[p] + 1
        lp, cand = torch.topk(depth_logp[depth[i] - 1], 6)
        x = int(tree.tokens[i])
        assert x in cand.tolist()
        score = lp + weight * bigram_logp(nxt, lp_ng, floor, tree.tokens[p:p + 1], cand)[0]
        q = torch.log_softmax(score, -1) + torch.logsumexp(lp, 0)
        step = float(tree.log_probs[i] - tree.log_probs[p])
        assert step == pytest.approx(float(q[cand.tolist().index(x)]), abs=1e-4)
    assert max(depth) >= 2 and len(tree) == 21          # the global top 20 of 3 + 3 x 9 candidates


# ---------------------------------------------------------------------------------------------------------------
# losslessness
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_identical_to_plain(target, dart, tree):
    gen = torch.Generator().manual_seed(23)
    for trial in range(6):
        ids = torch.randint(0, 97, (1, 1 if trial == 0 else int(torch.randint(2, 20, (), generator=gen))),
                            generator=gen)
        n_new = int(torch.randint(1, 30, (), generator=gen))
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=dart, tree=tree,
                               confidence_threshold=0.0 if trial % 2 else 0.05)
        assert torch.equal(spec, plain), (trial, tree)


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------
def test_cpu_smoke_training_lowers_the_loss_and_starts_from_an_eagle_drafter(tmp_path):
    from specla_hf.training import train_drafter
    corpus = write_word_corpus(tmp_path / "corpus.jsonl", torch.Generator().manual_seed(0), docs=30)
    common = ["--cpu-smoke", "--corpus", str(corpus), "--sequences", "16", "--gen-len", "32",
              "--eval-every-s", "1000", "--final-eval-s", "1", "--dart-slots", "3"]
    train_drafter.main(common + ["--out", str(tmp_path / "dart"), "--steps", "12"])
    log = json.loads((tmp_path / "dart" / "train_log.json").read_text())
    assert log["steps"] == 12 and log["error"] is None and log["config"]["model_type"] == "specla_dart"
    assert log["final_loss"] < 0.9 * log["initial_loss"]
    assert all(r["identical"] == 1.0 for r in log["final_eval"].values())
    dart = AutoModelForCausalLM.from_pretrained(tmp_path / "dart", dtype=torch.float32)
    assert type(dart) is SpecLADartDrafter and (dart.ngram_next >= 0).any()       # the bigram of the sequences
    # a DART drafter started from an EAGLE drafter's weights (fresh slots)
    smoke = train_drafter.smoke_target(8192, seed=0)
    eagle = SpecLADrafter(SpecLADrafterConfig.for_target(smoke.config, num_heads=2, head_dim=16))
    eagle.save_pretrained(tmp_path / "eagle")
    train_drafter.main(common + ["--out", str(tmp_path / "from_eagle"), "--steps", "2", "--init-from",
                                 str(tmp_path / "eagle")])
    started = AutoModelForCausalLM.from_pretrained(tmp_path / "from_eagle", dtype=torch.float32)
    assert type(started) is SpecLADartDrafter and started.config.draft_slots == 3
    with pytest.raises(SystemExit, match="no training step fitted in --minutes 0.01"):   # no silent untrained save
        train_drafter.main(common + ["--out", str(tmp_path / "none"), "--minutes", "0.01"])
    assert not (tmp_path / "none" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="is a DART drafter"):
        train_drafter.main([a for a in common if a not in ("--dart-slots", "3")]
                           + ["--out", str(tmp_path / "x"), "--steps", "1", "--init-from", str(tmp_path / "dart")])

