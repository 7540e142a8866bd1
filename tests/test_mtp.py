"""The checkpoint's own MTP head as the drafter of a GDN hybrid (``specla_hf.MTPDrafter``): loading the ``mtp.*``
tensors (sharded, offline Hub cache, per-expert MoE tensors), clear errors, lossless greedy and sampled decoding,
drafts that are what the MTP layer computes, and ``specla-train-drafter --mtp``'s CPU smoke run."""
import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (DynamicCache, LogitsProcessorList, MaxLengthCriteria, Qwen3_5ForCausalLM,
                          StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper)

from conftest import record_calls, tiny_gdn
from tiny_checkpoints import hub_snapshot, run_offline
from hybrid_models import VOCAB, spread_weights_, tiny_hybrid, tiny_qwen3_5_vl
from test_generate import _chisq_pvalue, _exact_first_two, _sample_counts
from test_hybrid import emulate_hybrid_graphs
from specla_hf import MTPDrafter, frequent_tokens, speculative_decode
from specla_hf.drafters import mtp_checkpoint
from specla_hf.drafters.mtp import _MTPRunner
from specla_hf.generation import draft_options
from specla_hf.models.graphed import DRAFT_SEQ_TOKENS, ForwardGraphs
from specla_hf.models.qwen3_5 import HybridRunner, text_decoder
from specla_hf.models.tree_attention import rotary_positions
from specla_hf.training import train_drafter, train_mtp

# MtpLayer name -> the released checkpoints' name, written out here rather than taken from the library
CHECKPOINT_NAMES = {"eh_proj.": "mtp.fc.", "enorm.": "mtp.pre_fc_norm_embedding.",
                    "hnorm.": "mtp.pre_fc_norm_hidden.", "mtp_block.": "mtp.layers.0.", "post_norm.": "mtp.norm."}


def random_head(target, seed: int) -> MTPDrafter:
    head = MTPDrafter(text_decoder(target).config)
    spread_weights_(head, seed)
    return head.eval()


def checkpoint_tensors(head: MTPDrafter) -> dict[str, torch.Tensor]:
    """``head``'s weights under the released checkpoints' ``mtp.*`` names."""
    out = {}
    for name, tensor in head.layer.state_dict().items():
        (module, saved), = [(m, s) for m, s in CHECKPOINT_NAMES.items() if name.startswith(m)]
        out[saved + name[len(module):]] = tensor.clone()
    return out


def write_checkpoint(folder, target, mtp_tensors: dict[str, torch.Tensor], config_changes: dict = None) -> list[str]:
    """A transformers checkpoint of ``target`` plus ``mtp_tensors`` in three shards with an index, as the released
    ones: shard 1 holds model tensors only, shard 2 the rest of them and the first MTP tensors, shard 3 the other MTP
    tensors. Returns the shard names."""
    config = copy.deepcopy(target.config)
    config.mtp_num_hidden_layers = 1
    for key, value in (config_changes or {}).items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    model = {k: v.contiguous() for k, v in target.state_dict().items()}
    names, extra = sorted(model), sorted(mtp_tensors)
    parts = [names[:len(names) // 2], names[len(names) // 2:] + extra[:len(extra) // 2], extra[len(extra) // 2:]]
    files = [f"model-0000{i + 1}-of-00003.safetensors" for i in range(3)]
    weight_map = {}
    for file, part in zip(files, parts):
        save_file({k: model[k] if k in model else mtp_tensors[k] for k in part}, str(folder / file),
                  metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


@pytest.fixture(scope="module")
def hybrid():
    return tiny_hybrid("qwen3_5", seed=0)


@pytest.fixture(scope="module")
def released(hybrid, tmp_path_factory):
    """A tiny Qwen3.5 checkpoint with a random MTP head, as the released ones are laid out."""
    folder = tmp_path_factory.mktemp("qwen3_5_with_mtp")
    head = random_head(hybrid, seed=4)
    tensors = checkpoint_tensors(head)
    files = write_checkpoint(folder, hybrid, tensors)
    return folder, head, tensors, files


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``specla-train-drafter --mtp --cpu-smoke``: its log, and its smoke target with the head it saved."""
    out = tmp_path_factory.mktemp("mtp_smoke")
    train_drafter.main(["--mtp", "--cpu-smoke", "--steps", "60", "--out", str(out)])
    log = json.loads((out / "train_log.json").read_text())
    return out, log, train_mtp.smoke_target(256, seed=0), MTPDrafter.from_pretrained(out)


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------
def test_loads_the_mtp_tensors_of_a_sharded_checkpoint(hybrid, released, monkeypatch):
    """Only the shards holding ``mtp.*`` are opened; the drafter's weights are the checkpoint's tensors; the folder is
    a checkpoint transformers loads (it ignores ``mtp.*``)."""
    folder, head, tensors, files = released
    opened = []
    real_open = mtp_checkpoint.safe_open
    monkeypatch.setattr(mtp_checkpoint, "safe_open", lambda path, **kw: opened.append(path) or real_open(path, **kw))
    mtp = MTPDrafter.from_pretrained(folder)
    assert sorted(os.path.basename(p) for p in opened) == files[1:]
    state = mtp.layer.state_dict()
    assert len(state) == len(tensors)
    for name, tensor in state.items():
        (module, saved), = [(m, s) for m, s in CHECKPOINT_NAMES.items() if name.startswith(m)]
        assert torch.equal(tensor, tensors[saved + name[len(module):]]), name
    assert torch.equal(mtp.layer.eh_proj.weight, tensors["mtp.fc.weight"])
    assert torch.equal(mtp.layer.mtp_block.self_attn.q_proj.weight, tensors["mtp.layers.0.self_attn.q_proj.weight"])
    assert mtp.dtype == torch.float32 and mtp.device.type == "cpu" and not mtp.training
    stock = Qwen3_5ForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), hybrid.state_dict().values()))
    assert MTPDrafter.from_pretrained(folder, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_loads_by_repo_id_from_an_offline_hub_cache(released, tmp_path):
    """``from_pretrained("org/name")`` with HF_HUB_OFFLINE=1 reads the Hub cache's snapshot (huggingface_hub reads its
    environment at import: a fresh interpreter)."""
    folder, head, _, _ = released
    cache = tmp_path / "hub"
    shutil.copytree(folder, hub_snapshot(cache, "qwen/tiny-hybrid"))
    code = ("import specla_hf\n"
            "m = specla_hf.MTPDrafter.from_pretrained('qwen/tiny-hybrid')\n"
            "print(sum(float(p.double().sum()) for p in m.parameters()))\n")
    run = run_offline(code, cache, tmp_path / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    checksum = sum(float(p.detach().double().sum()) for p in head.parameters())
    assert float(run.stdout.split()[-1]) == pytest.approx(checksum, rel=1e-12)


def test_public_names_import_in_a_fresh_interpreter_whatever_comes_first():
    """``specla_hf.MTPDrafter`` imports transformers' ``modeling_layers``, and a user's first transformers import may
    be a model class: whichever module imports transformers' Auto classes first, the drafters' Auto-class registration
    waits until fla and transformers are done importing (registering mid-import re-entered a half-imported module)."""
    check = ("\nfrom transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
             "assert 'specla_drafter' in CONFIG_MAPPING and 'specla_dart' in CONFIG_MAPPING\n")
    flows = ["import specla_hf\nfrom transformers import Qwen3_5ForCausalLM\nspecla_hf.MTPDrafter",
             "import specla_hf\nspecla_hf.SpecLADrafter"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", flow + check], env=env, stderr=subprocess.PIPE, text=True)
             for flow in flows]
    for flow, proc in zip(flows, procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (flow, err[-2000:])


def test_per_expert_moe_tensors_load_fused(tmp_path):
    """A Qwen3-Next head stored one tensor per expert (as its checkpoints are) loads into transformers' fused expert
    tensors: each expert's gate rows, then its up rows."""
    target = tiny_hybrid("qwen3_next", seed=1)
    head = random_head(target, seed=6)
    tensors = checkpoint_tensors(head)
    experts = head.layer.mtp_block.mlp.experts
    I = experts.down_proj.shape[-1]
    del tensors["mtp.layers.0.mlp.experts.gate_up_proj"], tensors["mtp.layers.0.mlp.experts.down_proj"]
    for e in range(experts.gate_up_proj.shape[0]):
        for name, t in (("gate_proj", experts.gate_up_proj[e, :I]), ("up_proj", experts.gate_up_proj[e, I:]),
                        ("down_proj", experts.down_proj[e])):
            tensors[f"mtp.layers.0.mlp.experts.{e}.{name}.weight"] = t.clone()
    write_checkpoint(tmp_path, target, tensors)
    mtp = MTPDrafter.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(mtp.state_dict().values(), head.state_dict().values()))


def test_clear_errors(hybrid, released, tmp_path):
    """No ``mtp.*`` tensors, another model, a structure it does not run, a head of another target: one-line errors."""
    def one_line(error):
        assert "\n" not in str(error.value)

    plain = tmp_path / "plain"
    hybrid.save_pretrained(plain)
    with pytest.raises(ValueError, match=r"holds no mtp\.\* tensors") as e:
        MTPDrafter.from_pretrained(plain)
    one_line(e)
    fla = tmp_path / "fla"
    tiny_gdn().save_pretrained(fla)
    with pytest.raises(ValueError, match="MTPDrafter reads the MTP heads of Qwen3.5") as e:
        MTPDrafter.from_pretrained(fla)
    one_line(e)
    _, head, tensors, _ = released
    cases = [("two_layers", tensors, dict(mtp_num_hidden_layers=2), "mtp_num_hidden_layers=2"),
             ("own_embeddings", tensors, dict(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings"),
             ("second_layer", {**tensors, "mtp.layers.1.input_layernorm.weight": torch.zeros(64)}, {},
              r"mtp\.layers\.1\.input_layernorm"),
             ("no_norm", {k: v for k, v in tensors.items() if k != "mtp.norm.weight"}, {}, r"missing \['post_norm")]
    for name, mtp_tensors, changes, message in cases:
        (tmp_path / name).mkdir()
        write_checkpoint(tmp_path / name, hybrid, mtp_tensors, changes)
        with pytest.raises(ValueError, match="unsupported MTP structure.*" + message) as e:
            MTPDrafter.from_pretrained(tmp_path / name)
        one_line(e)
    other = tiny_hybrid("qwen3_5", hidden=32, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="does not fit the target: hidden size: head of 64, target has 32"):
        other.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, assistant_model=head)


# ---------------------------------------------------------------------------------------------------------------
# drafting
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree, threshold", [(False, 0.0), (True, 0.0), (True, 0.05)],
                         ids=["chain", "tree", "pruned-tree-host-loop"])
def test_greedy_identical_to_plain(trained, tree, threshold):
    """The trained smoke head on its target (long accepted paths, partial acceptance): greedy decoding equals plain
    decoding, in the device loop (its catch-up) and the host loop (a confidence threshold)."""
    _, _, target, head = trained
    gen = torch.Generator().manual_seed(13)
    accepted, drafted, longest = 0, 0, 0
    for n_prompt, n_new in ((1, 24), (6, 40), (17, 33)):
        ids = torch.randint(0, 256, (1, n_prompt), generator=gen)
        plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        # the configured shape: the long paths asserted below, which the shape policy may not draft on a CPU
        spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=head, tree=tree,
                               confidence_threshold=threshold, adaptive_drafting=False)
        assert torch.equal(spec, plain), (n_prompt, n_new)
        stats = target.specla_stats
        accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.draft_nodes)
        longest = max(longest, *stats.accepted)
    assert 0 < accepted < drafted and longest >= 3


def test_draft_vocabulary_drafts_its_tokens_only(trained, tmp_path):
    """A restricted draft vocabulary: decoding stays plain decoding's; the whole vocabulary as the restriction drafts
    and accepts exactly what the unrestricted head does; the continuation's most frequent tokens still get drafts
    accepted, and a vocabulary without any of the continuation's tokens none (a draft index read as a token id would
    draft ids 0.. and hit some); bad ids are a clear error; the vocabulary is saved with the head."""
    out, _, target, _ = trained
    head = MTPDrafter.from_pretrained(out)
    gen = torch.Generator().manual_seed(29)
    cases = [(torch.randint(0, 256, (1, n_prompt), generator=gen), n_new) for n_prompt, n_new in ((1, 30), (9, 40))]
    plains = [target.generate(ids, max_new_tokens=n, do_sample=False) for ids, n in cases]
    emitted = torch.cat([p[0, ids.shape[1]:] for p, (ids, _) in zip(plains, cases)])
    frequent = frequent_tokens([emitted], 256, 24)
    assert frequent.tolist() == sorted(frequent.tolist()) and len(frequent) == 24
    assert torch.bincount(emitted, minlength=256)[frequent].min() >= torch.bincount(emitted, minlength=256).sort(
        descending=True).values[23]

    def run(vocab, tree):
        head.restrict_vocabulary(vocab)
        accepted, nodes = [], []
        for (ids, n), plain in zip(cases, plains):
            spec = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=head, tree=tree,
                                   confidence_threshold=0.0, adaptive_drafting=False)      # fixed shapes: comparable
            assert torch.equal(spec, plain), (vocab is None, tree)
            accepted, nodes = accepted + target.specla_stats.accepted, nodes + target.specla_stats.draft_nodes
        return accepted, nodes
    for tree in (False, True):
        full = run(None, tree)
        assert run(torch.arange(256).flip(0), tree) == full
        assert sum(run(frequent, tree)[0]) > 0
        unseen = torch.tensor(sorted(set(range(256)) - set(emitted.tolist())))
        assert sum(run(unseen, tree)[0]) == 0
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\); got 2 ids from 3 to 256"):
        head.restrict_vocabulary([3, 256])
    head.restrict_vocabulary(frequent).save_pretrained(tmp_path)             # saved with the head, read back
    assert torch.equal(MTPDrafter.from_pretrained(tmp_path).draft_vocab, frequent)
    head.restrict_vocabulary(None).save_pretrained(tmp_path)
    assert MTPDrafter.from_pretrained(tmp_path).draft_vocab is None


@pytest.mark.parametrize("model", ["qwen3_5_moe", "qwen3_next", "qwen3_5_vl"])
def test_greedy_identical_on_moe_and_vision_language_targets(model):
    target = tiny_qwen3_5_vl() if model == "qwen3_5_vl" else tiny_hybrid(model, seed=2)
    head = random_head(target, seed=7)
    ids = torch.randint(0, VOCAB - 4, (1, 7), generator=torch.Generator().manual_seed(3))
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    for tree in (False, True):
        spec = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=head, tree=tree,
                               confidence_threshold=0.0)
        assert torch.equal(spec, plain)


def graphed_mtp(target, head: MTPDrafter) -> _MTPRunner:
    """``head``'s runner for ``target`` with (emulated) CUDA graphs, as on a GPU."""
    runner = _MTPRunner.for_drafter(head, target)
    runner.graphs = ForwardGraphs(runner, emulate=True, max_seq_tokens=DRAFT_SEQ_TOKENS)
    runner.bucket_trees = True
    return runner


def test_graphed_drafting_equals_eager(trained):
    """With (emulated) CUDA graphs on the target and the head: chains and trees, in the device loop and the host loop
    (a threshold), after a one-token prompt and one consumed as chains, draft, accept and emit exactly what eager
    drafting does (trees padded to buckets, a fixed-capacity cache), and a second generate() replays the first one's
    graphs: the head's catch-up, depths and fusion, and the device loop's acceptance tail."""
    out, _, _, _ = trained
    target, head = train_mtp.smoke_target(256, seed=0), MTPDrafter.from_pretrained(out)
    gen = torch.Generator().manual_seed(17)
    cases = [(torch.randint(0, 256, (1, n_prompt), generator=gen), n_new) for n_prompt, n_new in ((1, 20), (70, 24))]
    settings = [(False, 0.0), (True, 0.0), (True, 0.05)]

    def run():
        runs = []
        for ids, n_new in cases:
            for tree, threshold in settings:
                seq = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=head, tree=tree,
                                      confidence_threshold=threshold, adaptive_drafting=False)   # fixed shapes
                stats = target.specla_stats
                runs.append((seq, stats.draft_nodes, stats.accepted))
        return runs
    eager = run()
    assert _MTPRunner.for_drafter(head, target).graphs is None             # a CPU runs the head eagerly
    target_runner = emulate_hybrid_graphs(target)
    runner = graphed_mtp(target, head)
    for trial in range(2):
        for (seq, nodes, accepted), (want, want_nodes, want_accepted) in zip(run(), eager):
            assert torch.equal(seq, want) and nodes == want_nodes and accepted == want_accepted, trial
    assert _MTPRunner.for_drafter(head, target) is runner
    keys = list(runner.graphs.forwards)
    assert any(k[1] is None and k[0] > 1 for k in keys)                    # catch-up sequences
    assert any(k[:2] == (64, 0) for k in keys)                             # a prompt consumed as chains
    assert all(v is not None for v in runner.graphs.forwards.values())
    calls = runner.graphs.calls
    assert any(k[0] == "fuse" and v is not None for k, v in calls.items())
    assert any(k[1] == "depth" and v is not None for k, v in calls.items())
    assert all(l.fixed for l in runner.last_cache.others)
    tails = target_runner.graphs.store(owner=runner)
    assert tails and all(k[0] == "step tail" and v is not None for k, v in tails.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_greedy_identical_to_plain_on_cuda_with_graphs(trained, monkeypatch):
    """On a GPU in fp32, with CUDA graphs on the target and the head (on by default there) and without: the trained
    smoke head's chains and trees, in the device loop and the host loop, give plain greedy decoding's tokens; with
    graphs every call of the head was captured and the device loop's acceptance tail replayed graphs. (TF32 off for
    cuDNN: plain decoding's short convolution would otherwise not be fp32.)"""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    out, _, _, _ = trained
    target = train_mtp.smoke_target(256, seed=0).cuda()
    gen = torch.Generator().manual_seed(13)
    cases = [(torch.randint(0, 256, (1, n_prompt), generator=gen).cuda(), n_new)
             for n_prompt, n_new in ((1, 24), (6, 40), (70, 33))]
    for graphed in (True, False):
        head = MTPDrafter.from_pretrained(out, device="cuda")
        target.__dict__["_specla_runner_target"] = HybridRunner(target, cuda_graphs=graphed)
        runner = _MTPRunner(head, target, cuda_graphs=graphed)
        head.__dict__["_specla_runner"] = runner                  # what candidate_generator's for_drafter finds
        accepted = 0
        for ids, n_new in cases:
            plain = target.generate(ids, max_new_tokens=n_new, do_sample=False)
            for tree, threshold in ((False, 0.0), (True, 0.0), (True, 0.05)):
                spec = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=head, tree=tree,
                                       confidence_threshold=threshold)
                assert torch.equal(spec, plain), (graphed, ids.shape[1], tree, threshold)
                accepted += sum(target.specla_stats.accepted)
        assert accepted > 0
        if not graphed:
            continue
        captured = {k: v is not None for k, v in runner.graphs.calls.items()}
        print(f"captured {sum(captured.values())} of {len(captured)} MTP calls: {captured}")
        assert captured and all(captured.values()), captured
        assert runner.graphs.forwards and all(g is not None for g in runner.graphs.forwards.values())
        tails = target.__dict__["_specla_runner_target"].graphs.store(owner=runner)
        assert tails and all(v is not None for v in tails.values())


@torch.no_grad()
def mtp_reference(target, head: MTPDrafter, context: torch.Tensor, path: list[int]) -> float:
    """The cumulative draft log-probability of ``path`` (draft tokens) after ``context`` (its last token the root),
    from a plain run of the MTP layer on transformers' ``DynamicCache``: position ``t < len(context) - 1`` reads the
    target's hidden state at ``t`` after its final norm (``last_hidden_state``) and token ``t + 1``; each draft token
    reads the output before it."""
    decoder, embed, lm_head = text_decoder(target), target.get_input_embeddings(), target.get_output_embeddings()
    hidden = decoder(context).last_hidden_state
    cache = DynamicCache()

    def run(h, tokens, start):
        e = embed(tokens)
        positions = torch.arange(start, start + tokens.shape[1])[None]
        return head.layer(e, h, decoder.rotary_emb(e, rotary_positions(decoder.rotary_emb, positions)), None, None,
                          cache)

    L = context.shape[1]
    out = run(hidden[:, :L - 1], context[:, 1:], 0)[:, -1:]           # the root's output
    total = 0.0
    for depth, token in enumerate(path):
        total += float(torch.log_softmax(lm_head(out[0, -1]).float(), -1)[token])
        out = run(out, torch.tensor([[token]]), L - 1 + depth)
    return total


@pytest.mark.parametrize("threshold", [0.0, 0.01], ids=["device-loop", "host-loop"])
def test_tree_nodes_score_what_the_mtp_layer_computes(trained, threshold):
    """After a generation whose steps accepted paths of several drafts (the drafter committed them through its
    catch-up), every node of the last verified tree carries the cumulative log-probability a plain run of the MTP
    layer gives its root path."""
    _, _, target, head = trained
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(21))
    # the configured shape every step: the shape policy chooses depths by measured times, and on a loaded machine
    # the last step's tree may be one level deep
    options = draft_options(tree=True, tree_topk=3, tree_budget=16, draft_depth=4, confidence_threshold=threshold,
                            adaptive_drafting=False)
    drafter = head.candidate_generator(target, options)
    # stopped at 40 tokens by the criterion; drafts are not shortened by a length limit (max_length 1000); no
    # gradients, as under generate()
    with torch.no_grad():
        seq, stats, _, _ = speculative_decode(HybridRunner(target), drafter, ids, LogitsProcessorList(),
                                              StoppingCriteriaList([MaxLengthCriteria(40)]), False, 1000)
    assert max(stats.accepted[:-1]) >= 2
    tree = drafter.last_tree
    root = ids.shape[1] - 1 + sum(a + 1 for a in stats.accepted[:-1])
    assert int(tree.tokens[0]) == int(seq[0, root]) and int(tree.parents.max()) > 0     # nodes past depth 1
    parents = tree.parents.tolist()
    for node in range(1, len(tree)):
        path, up = [], node
        while up > 0:
            path.insert(0, int(tree.tokens[up]))
            up = parents[up]
        expected = mtp_reference(target, head, seq[:, :root + 1], path)
        assert float(tree.log_probs[node]) == pytest.approx(expected, abs=1e-4), (node, path)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_sampling_is_lossless(device):
    """2000 draws of (x1, x2) on a vocabulary of 8 through the loop generate() runs, drafting trees of three
    children per node with a random MTP head: the first token and the pair follow the target's exact laws. On CUDA
    the head's children are drawn by the Triton kernels inside its graphs."""
    torch.manual_seed(1234)
    target = tiny_hybrid("qwen3_5", seed=30, vocab=8, hidden=32, heads=2, kv_heads=1, layers=2, attention_every=2)
    head = random_head(target, seed=31)
    target, head = target.to(device), head.to(device)
    ids = torch.tensor([[1, 5, 2]], device=device)
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)])
    p1, p2 = (p.cpu() for p in _exact_first_two(target, ids, procs))
    draws = 2000
    options = draft_options(tree=True, tree_topk=3, confidence_threshold=0.0, adaptive_drafting=False)
    c1, c12, accepted, _ = _sample_counts(HybridRunner(target), lambda: head.candidate_generator(target, options), ids,
                                       draws, procs)
    assert 0 < accepted < draws                  # drafts were accepted and rejected
    assert _chisq_pvalue(c1, p1) > 1e-3
    assert _chisq_pvalue(c12, (p1[:, None] * p2).flatten()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------
def test_cpu_smoke_training_lowers_the_loss_and_saves_a_readable_head(trained):
    """``specla-train-drafter --mtp --cpu-smoke``: the loss falls, the head drafts losslessly with tau > 1, and it is
    saved as a released head is (config keys of the target, ``mtp.*`` tensors only), which ``from_pretrained``
    reads back."""
    out, log, target, head = trained
    assert log["steps"] == 60 and log["final_loss"] < 0.6 * log["initial_loss"]
    assert all(r["identical"] == 1.0 and r["tau"] > 1.3 for r in log["final_eval"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["mtp_num_hidden_layers"] == 1
    assert config["hidden_size"] == text_decoder(target).config.hidden_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        saved = {name: f.get_tensor(name) for name in names}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= names
    assert all(name.startswith("mtp.") for name in names)
    assert torch.equal(head.layer.eh_proj.weight, saved["mtp.fc.weight"])
    assert not torch.equal(head.layer.mtp_block.self_attn.q_proj.weight,       # trained from the target's layer
                           text_decoder(target).layers[3].self_attn.q_proj.weight)


def test_fused_tree_pass_equals_the_general_one(trained):
    """The MTP head's tree passes through ``fused_gemm`` products (``HybridRunner._fused_block``, under
    ``fused_verify_max_nodes``) give the general pass's draft log-probs and output hidden states, and the same
    attention cache once a path is committed."""
    from specla_kernels import tuning
    _, _, target, head = trained
    fused, general = _MTPRunner(head, target, cuda_graphs=False), _MTPRunner(head, target, cuda_graphs=False)
    assert fused.fused_tree
    general.fused_tree = False
    block_calls = [record_calls(runner, "_fused_block") for runner in (fused, general)]
    gen = torch.Generator().manual_seed(23)
    hidden = torch.randn(1, 12, text_decoder(target).config.hidden_size, generator=gen)
    tokens = torch.randint(0, 256, (1, 12), generator=gen)
    outs, caches = [], []
    with tuning.using(fused_verify_max_nodes=16):
        for runner in (fused, general):
            cache = runner.new_cache(1, max_length=32)
            runner.forward((hidden[:, :5], tokens[:, :5]), cache)
            outs.append(runner.forward((hidden[:, 5:], tokens[:, 5:]), cache, parents=torch.tensor(
                [[-1, 0, 0, 1, 1, 3, 2]])))
            cache.commit(5)
            caches.append(cache)
    assert [len(calls) for calls in block_calls] == [1, 0]          # the tree pass, fused in one runner only
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0].hidden_states[0], outs[1].hidden_states[0], rtol=1e-4, atol=1e-4)
    (a,), (b,) = (c.layers for c in caches)
    n = a.committed_length()
    assert n == b.committed_length() == 5 + 4
    for x, y in ((a.key_buffer, b.key_buffer), (a.value_buffer, b.value_buffer)):
        torch.testing.assert_close(x[:, :, :n], y[:, :, :n], rtol=1e-4, atol=1e-4)


def test_target_norm_of_the_features_runs_as_one_kernel(hybrid, monkeypatch):
    """The catch-up normalises the target's top hidden state (every step) with the runners' one-kernel norm, not the
    zero-centred norm module's ~9 launches: on CPU bitwise the module's output."""
    from specla_hf.models import fla_backend
    calls = []
    real = fla_backend.rms_norm_scaled
    monkeypatch.setattr(fla_backend, "rms_norm_scaled", lambda *a, **k: calls.append(1) or real(*a, **k))
    drafter = random_head(hybrid, seed=4).candidate_generator(hybrid, draft_options(tree=True))
    h = torch.randn(1, 3, hybrid.config.hidden_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(drafter._target_normed(h), text_decoder(hybrid).norm(h)) and calls == [1]
