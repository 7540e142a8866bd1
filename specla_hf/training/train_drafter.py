"""Train a ``SpecLADrafter`` for a GDN target on text the target itself writes (target-aligned EAGLE training).

    specla-train-drafter --target checkpoints/specla-gdn-tiny --corpus corpus/ --out runs/drafter --minutes 6
    specla-train-drafter --cpu-smoke --corpus some.jsonl --out /tmp/smoke      # tiny random target, ~1 min on CPU
    specla-train-drafter --cpu-smoke --family qwen3_5 --corpus some.jsonl --out /tmp/smoke   # a random hybrid

Targets: fla's ``GatedDeltaNetForCausalLM`` and transformers' GDN hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; any
checkpoint ``AutoModelForCausalLM`` loads and ``specla_hf.models.adapter_for`` drives).

1. Prompts: random windows of ``--prefix-len`` tokens from the corpus (JSON lines with a "text" field, .jsonl or
   .jsonl.xz; a folder means its ``*.jsonl*`` files, ``valid*`` held out for evaluation).
2. The target continues each prompt for ``--gen-len`` tokens (``--gen-temperature``; 0 = greedy), batched on the
   model's own cache: the drafter learns from the target's own text, not the corpus'.
3. Each step runs the target (its stock forward with ``output_hidden_states``: Triton on the GPU) for features and
   soft labels, then the drafter twice (EAGLE-3's "training-time test"): pass 1 with the target's fused features,
   pass 2 with pass 1's outputs shifted in as features, as deeper draft nodes see them. Loss on both passes:
   cross-entropy against the target's distribution (= KL + its entropy) plus ``--hard-weight`` x cross-entropy
   against the target's greedy token.
4. Every ``--eval-every-s``: acceptance length tau of real speculative decoding (``specla_hf.speculative_decode``,
   greedy) on held-out prompts. Checkpoints every ``--save-every-s`` (``--resume`` continues one). The drafter is
   saved in ``--save-dtype`` with ``train_log.json``; the final evaluation compares chain, tree and pruned tree.

``--dart-slots N`` trains a DART parallel drafter instead (``specla_hf.drafters.dart``: the root as pass 1 above, then ``N``
mask slots after random branch points, each against the target's distribution further on; its tree's bigram is
counted from the training sequences and ``--bigram-docs`` corpus documents); ``--init-from`` an EAGLE drafter starts
it from those weights.

Stages: ``--steps 0`` only writes the sequences (into the checkpoint); ``--sequences-from`` trains on those of one or
more such runs instead of writing new ones (the target's text written on a CPU, trained on a GPU), and
``--init-from`` starts from a trained drafter rather than a fresh one.

Hugging Face's ``hidden_states[i]`` is the input of block ``i`` (= the adapter's layer ``i``, ``GDNRunner`` and
``HybridRunner`` alike) for ``i < L``; its last entry is the top block's output after the final norm, which
``EagleDrafter`` reproduces at decode time by applying the target's norm to the adapter's layer ``L`` (see
``specla_hf.drafters.eagle``).

On the GPU the drafter's gated delta rule runs through ``specla_kernels.chunk`` (``use_backend(delta_rule="torch")``):
fla's chunk backward is refused on Hopper with Triton 3.6. The target's forward (no gradient) stays on fla's kernels.
"""
from __future__ import annotations

import argparse
import copy
import json
import lzma
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import (AutoModelForCausalLM, LogitsProcessorList, MaxLengthCriteria, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig, StoppingCriteriaList)

from specla_hf.models.fla_backend import use_backend
from specla_hf.loop.decode import speculative_decode
from specla_hf.drafters.dart import SpecLADartConfig, SpecLADartDrafter
from specla_hf.drafters.eagle import SpecLADrafter, SpecLADrafterConfig
from specla_hf.drafters.ngram import bigram_table
from specla_hf.models import adapter_for
from specla_hf.generation import draft_options

from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SMOKE_TOKENIZER = ROOT / "checkpoints" / "specla-gdn-tiny"
# (name, generate() drafting keywords) of the final comparison
EVAL_CONFIGS = [("chain", dict(tree=False, confidence_threshold=0.0)),
                ("tree", dict(tree=True, confidence_threshold=0.0)),
                ("tree+pruning", dict(tree=True, confidence_threshold=0.05))]


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------
def corpus_files(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files found beside them): a folder contributes its ``*.jsonl`` / ``*.jsonl.xz``,
    those named ``valid*`` as held-out."""
    train, held_out = [], []
    for path in paths:
        if path.is_dir():
            files = sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl.xz")])
            train += [f for f in files if not f.name.startswith("valid")]
            held_out += [f for f in files if f.name.startswith("valid")]
        elif path.is_file():
            train.append(path)
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
    if not train:
        raise FileNotFoundError(f"no .jsonl / .jsonl.xz training files in {[str(p) for p in paths]}")
    return train, held_out


def read_texts(files: list[Path]) -> list[str]:
    """The "text" field of every JSON line: through ``datasets`` when it is installed, else ``lzma`` + ``json``."""
    try:
        import datasets
    except ImportError:
        texts = []
        for f in files:
            with (lzma.open(f, "rt", encoding="utf-8") if f.suffix == ".xz" else open(f, encoding="utf-8")) as fh:
                texts += [json.loads(line)["text"] for line in fh if line.strip()]
        return texts
    return list(datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")["text"])


def sample_windows(texts: list[str], tokenizer: PreTrainedTokenizerFast, n: int, length: int, rng: random.Random,
                   from_start: bool = False) -> torch.Tensor:
    """``n`` windows of ``length`` tokens ``[n, length]``: at random character offsets of random documents (the
    first token, likely a word cut in two, dropped), or at document starts after ``<|endoftext|>`` as the target
    saw them in training."""
    rows: list[list[int]] = []
    long_docs = [t for t in texts if len(t) > 2 * length]   # ~2+ characters per token on this corpus
    if not long_docs:
        raise ValueError(f"no document of the corpus is long enough for {length}-token windows")
    for _ in range(100):
        batch = []
        for _ in range(2 * (n - len(rows))):
            doc = rng.choice(long_docs)
            start = 0 if from_start else rng.randrange(len(doc) - length)
            batch.append(doc[start:start + 12 * length])
        for enc in tokenizer(batch, add_special_tokens=from_start)["input_ids"]:
            ids = enc if from_start else enc[1:]
            if len(ids) >= length and len(rows) < n:
                rows.append(ids[:length])
        if len(rows) == n:
            return torch.tensor(rows, dtype=torch.long)
    raise ValueError(f"could not cut {n} windows of {length} tokens from the corpus")


@torch.no_grad()
def continue_text(target: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, temperature: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The target's own continuations ``[B, P + new_tokens]`` (greedy at temperature 0), on the model's own cache;
    no EOS handling: every row gets ``new_tokens`` tokens, each predicted by the target from the row so far."""
    out = target(input_ids=prompts, use_cache=True)
    cache, logits, rows = out.past_key_values, out.logits[:, -1], [prompts]
    for _ in range(new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        rows.append(nxt)
        out = target(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat(rows, 1)


# ----------------------------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------------------------
def target_signals(drafter: SpecLADrafter, target: PreTrainedModel, x: torch.Tensor, amp) -> dict:
    """The target's side of a training step on token rows ``x [B, T]``, for drafter positions ``0..T-2``: the
    feature layers and the embeddings of tokens ``1..T-1`` the drafter reads, and its labels, the target's
    distribution at positions ``1..T-1`` (log-probs, probs, greedy token, entropy)."""
    # the stock forward, no gradient. fla's: on CUDA under no_grad, in the fused_recurrent mode main() sets (the
    # kernel the target's generation compiled and autotuned already; fla's chunk kernels would autotune for ~2 minutes
    # on a cold machine); on the CPU in grad mode with nothing requiring grad, so the backend takes its chunked delta
    # rule rather than a token-by-token loop (a hybrid's forward chunks whatever the grad mode)
    with torch.set_grad_enabled(x.device.type != "cuda"), amp:
        out = target(input_ids=x, output_hidden_states=True, use_cache=False)
        features = [f[:, :-1] for f in drafter.target_features(out.hidden_states)]
        embeds = out.hidden_states[0][:, 1:]                      # the target's embeddings of tokens 1..T-1
        logp = torch.log_softmax(out.logits[:, 1:].float(), -1)
    p = logp.exp()
    return dict(features=features, embeds=embeds, logp=logp, p=p, greedy=logp.argmax(-1),
                entropy=-(p * logp).sum(-1))


def _label_loss(logq: torch.Tensor, sig: dict, rows: slice, hard_weight: float) -> tuple[torch.Tensor, ...]:
    """Cross-entropy of draft log-probs ``logq [B, n, V]`` against the target's distributions ``rows`` (soft) plus
    ``hard_weight`` x against its greedy tokens; also the KL and the greedy accuracy (detached)."""
    soft = -(sig["p"][:, rows] * logq).sum(-1)
    greedy = sig["greedy"][:, rows]
    hard = F.nll_loss(logq.flatten(0, 1), greedy.flatten())
    kl = (soft - sig["entropy"][:, rows]).mean().detach()
    return soft.mean() + hard_weight * hard, kl, (logq.argmax(-1) == greedy).float().mean().detach()


def drafter_loss(drafter: SpecLADrafter, target: PreTrainedModel, x: torch.Tensor, hard_weight: float,
                 amp) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two-pass (training-time test) loss on token rows ``x [B, T]`` (module docstring, step 3).

    Drafter position ``t`` (``0..T-2``) reads the target's feature of position ``t`` and token ``t+1``; its label is
    the target's distribution at position ``t+1`` (over token ``t+2``).
    """
    sig = target_signals(drafter, target, x, amp)
    lm_head = target.get_output_embeddings()
    metrics, total = {}, 0.0
    # fla's chunk backward is refused on Hopper (Triton 3.6), so the drafter's delta rule goes through torch
    # autograd; its norms, conv and MLP too: for one small layer the eager torch path costs little, while fla's
    # backward kernels spend minutes autotuning on a cold machine (docs/target-model.md)
    with use_backend(modules="torch", delta_rule="torch"), amp:
        fused = drafter.fuse(sig["features"])
        h1 = drafter(fused, sig["embeds"])
        # pass 2: position t reads the drafter's own output at t-1 in place of the target's feature of position t
        h2 = drafter(torch.cat([fused[:, :1], h1[:, :-1]], 1), sig["embeds"])
        for name, h, first in (("1", h1, 0), ("2", h2, 1)):   # pass 2's position 0 repeats pass 1's
            logq = torch.log_softmax(lm_head(drafter.norm(h[:, first:])).float(), -1)
            loss, metrics[f"kl{name}"], metrics[f"acc{name}"] = _label_loss(logq, sig, slice(first, None),
                                                                            hard_weight)
            total = total + loss
    return total, metrics


def dart_loss(drafter: SpecLADartDrafter, target: PreTrainedModel, x: torch.Tensor, hard_weight: float,
              amp, branches: int, rng: random.Random) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DART drafter's loss on token rows ``x [B, T]`` (``specla_hf.drafters.dart``): sequence-mode passes over drafter
    positions ``0..t`` followed by the mask slots, at ``branches`` branch points ``t`` (the last possible one and
    random others). Positions ``0..t`` of the longest pass are trained as EAGLE's first pass (the root's depth-1
    distribution); slot ``j`` after position ``t`` against the target's distribution at position ``t + 1 + j``
    (``j`` tokens past the root's label). Metrics ``kl1`` / ``acc1``: the root; ``kl2`` / ``acc2``: the first slot
    (depth 2); ``acc_slots``: every slot."""
    sig = target_signals(drafter, target, x, amp)
    S, n = drafter.config.draft_slots, sig["embeds"].shape[1]
    last = n - 1 - S                                   # the slots of a branch at t read labels up to t + S
    if last < 0:
        raise ValueError(f"training rows of {x.shape[1]} tokens are too short for {S} draft slots: at least "
                         f"{S + 2} tokens are needed")
    points = [last] + rng.sample(range(last), min(branches - 1, last))
    lm_head = target.get_output_embeddings()
    total, slot_loss, metrics, slot_acc = 0.0, 0.0, {}, []
    with use_backend(modules="torch", delta_rule="torch"), amp:
        fused = drafter.fuse(sig["features"])
        for t in points:
            h = drafter.forward_slots(fused, sig["embeds"], t)
            if t == last:             # the shorter passes repeat these rows
                logq = torch.log_softmax(lm_head(drafter.norm(h[:, :t + 1])).float(), -1)
                total, metrics["kl1"], metrics["acc1"] = _label_loss(logq, sig, slice(0, t + 1), hard_weight)
            logq = torch.log_softmax(lm_head(drafter.norm(h[:, t + 1:])).float(), -1)
            for j in range(S):
                loss, kl, acc = _label_loss(logq[:, j:j + 1], sig, slice(t + 1 + j, t + 2 + j), hard_weight)
                slot_loss = slot_loss + loss / (S * len(points))
                slot_acc.append(acc)
                if j == 0:
                    metrics["kl2"] = metrics.get("kl2", 0.0) + kl / len(points)
                    metrics["acc2"] = metrics.get("acc2", 0.0) + acc / len(points)
    metrics["acc_slots"] = torch.stack(slot_acc).mean()
    return total + slot_loss, metrics


def text_bigram(sequences: torch.Tensor, tokenizer: PreTrainedTokenizerFast, texts: list[str],
                config: SpecLADartConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DART tree's bigram (``specla_hf.drafters.ngram.bigram_table``) of the target-written ``sequences`` and the corpus
    documents ``texts``: the target's own text, as the drafter's labels are, and enough corpus text that the
    successors of rarer tokens are counted at all."""
    docs = [torch.tensor(ids) for i in range(0, len(texts), 256) for ids in tokenizer(texts[i:i + 256])["input_ids"]]
    return bigram_table([*sequences.cpu(), *docs], config.vocab_size, config.ngram_topk)


def dart_from_eagle(eagle: SpecLADrafter, **dart) -> SpecLADartDrafter:
    """A DART drafter starting from a trained EAGLE drafter's weights (its first pass is the DART root's job) with
    fresh slots."""
    fields = {k: v for k, v in eagle.config.to_dict().items() if k not in ("model_type", "architectures")}
    cfg = SpecLADartConfig(**{**fields, **dart})
    model = SpecLADartDrafter(cfg).to(eagle.dtype)
    missing, unexpected = model.load_state_dict(eagle.state_dict(), strict=False)
    if unexpected or set(missing) != {"slot_inputs", "ngram_next", "ngram_logp", "ngram_floor"}:
        raise ValueError(f"cannot start a DART drafter from this drafter: missing {missing}, unexpected {unexpected}")
    return model


# ----------------------------------------------------------------------------------------------------------------
# evaluation: real speculative decoding
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_tau(target: PreTrainedModel, drafter: SpecLADrafter, prompts: torch.Tensor, new_tokens: int,
                 drafting: dict, time_limit_s: float = float("inf")) -> dict:
    """Greedy speculative decoding of every prompt (until ``time_limit_s``): tau, tree statistics, and the fraction
    of emitted tokens identical to plain greedy decoding (1.0 unless the decoding path is broken: a wrong verify
    can inflate tau)."""
    d = copy.deepcopy(drafter).to(target.dtype).eval()
    runner = adapter_for(target)
    options = draft_options(**drafting)
    steps = accepted = nodes = done = same = 0
    draft_s = verify_s = 0.0
    t0 = time.time()
    for prompt in prompts:
        ids = prompt[None].to(target.device)
        n = ids.shape[1] + new_tokens
        seq, stats, _, _ = speculative_decode(runner, d.candidate_generator(target, options), ids,
                                              LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(n)]),
                                              do_sample=False, max_length=n)
        plain = continue_text(target, ids, new_tokens, 0.0, None)
        same += int((seq[0, ids.shape[1]:] == plain[0, ids.shape[1]:]).sum())
        steps, accepted, nodes = steps + stats.steps, accepted + sum(stats.accepted), nodes + sum(stats.draft_nodes)
        draft_s, verify_s, done = draft_s + stats.draft_time, verify_s + stats.verify_time, done + 1
        if time.time() - t0 > time_limit_s:
            break
    return {"tau": (accepted + steps) / max(steps, 1), "nodes_per_step": nodes / max(steps, 1),
            "rejected_per_step": (nodes - accepted) / max(steps, 1), "identical": same / (done * new_tokens),
            "steps": steps, "prompts": done, "draft_s": draft_s, "verify_s": verify_s, "options": vars(options)}


# ----------------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, drafter: SpecLADrafter, opt: torch.optim.Optimizer, state: dict,
                    sequences: torch.Tensor) -> None:
    path.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(path)
    if not (path / "sequences.pt").exists():
        torch.save(sequences.cpu(), path / "sequences.pt")
    torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), **state}, path / "trainer_state.pt")


def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over steps, then cosine to ``min_ratio * peak`` over the fraction of the budget used."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


SMOKE_FAMILIES = ("gated_deltanet", "qwen3_5")


def smoke_target(vocab_size: int, seed: int, family: str = "gated_deltanet") -> PreTrainedModel:
    """A tiny random target of ``family`` (``SMOKE_FAMILIES``: fla's GDN, or a Qwen3.5 hybrid of 3 GDN layers and a
    full-attention layer) whose next-token distributions are peaked enough to be worth learning."""
    torch.manual_seed(seed)
    if family == "gated_deltanet":
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
            hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=2, hidden_ratio=2,
            vocab_size=vocab_size, tie_word_embeddings=False, fuse_cross_entropy=False))
    elif family == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=vocab_size, tie_word_embeddings=False))
        model.config._attn_implementation = "sdpa"
    else:
        raise ValueError(f"no smoke target of family {family!r}; one of {SMOKE_FAMILIES}")
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 3.0 / model.config.hidden_size ** 0.5)
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="local checkpoint (with its tokenizer) of a GatedDeltaNetForCausalLM "
                    "or a GDN hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)")
    ap.add_argument("--corpus", type=Path, nargs="+", required=True, help=".jsonl / .jsonl.xz files or folders")
    ap.add_argument("--eval-corpus", type=Path, nargs="*", help="held-out text (default: valid* beside the corpus, "
                    "else the last 5%% of its documents)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    ap.add_argument("--init-from", type=Path, help="start from this trained drafter (a folder or hub id) instead of "
                    "a fresh one: a second stage on new data")
    ap.add_argument("--sequences-from", type=Path, nargs="+", help="checkpoint folders of earlier runs: train on "
                    "their target-written sequences.pt (e.g. written on the CPU with --steps 0) instead of new ones")
    ap.add_argument("--checkpoint-dir", type=Path, help="default: OUT/checkpoint")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the whole script")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: budget only)")
    ap.add_argument("--sequences", type=int, default=8192, help="target-written training sequences")
    ap.add_argument("--gen-seconds", type=float, default=None, help="stop writing sequences after this long")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=192)
    ap.add_argument("--gen-temperature", type=float, default=0.7, help="0 = greedy continuations")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--hard-weight", type=float, default=0.5, help="weight of the greedy-token cross-entropy")
    ap.add_argument("--hidden-ratio", type=int, default=2, help="drafter MLP width / hidden size")
    ap.add_argument("--feature-layers", type=int, nargs="+", help="0 = embeddings, i = after target block i "
                    "(default: low, mid, top)")
    ap.add_argument("--dart-slots", type=int, default=0, help="train a DART parallel drafter (specla_hf.drafters.dart) with "
                    "this many mask slots (depths 2 .. slots + 1 from one pass); 0: the EAGLE drafter")
    ap.add_argument("--branches", type=int, default=4, help="DART: slot branch points per training row and step")
    ap.add_argument("--ngram-weight", type=float, default=0.25, help="DART: weight of the bigram in the tree")
    ap.add_argument("--bigram-docs", type=int, default=4096, help="DART: corpus documents the bigram counts "
                    "beside the target-written sequences")
    ap.add_argument("--eval-every-s", type=float, default=90.0)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-prompt-len", type=int, default=32)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--final-eval-s", type=float, default=60.0, help="time kept for the final comparison")
    ap.add_argument("--save-every-s", type=float, default=120.0)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny random target, small everything, on the CPU")
    ap.add_argument("--family", choices=SMOKE_FAMILIES, default="gated_deltanet",
                    help="the --cpu-smoke target's family (a --target checkpoint's is in its config)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.sequences, args.gen_batch, args.prefix_len, args.gen_len = 48, 48, 16, 48
        args.batch_size, args.lr, args.warmup, args.steps = 8, 3e-3, 3, args.steps or 60
        args.eval_every_s, args.eval_prompts, args.eval_prompt_len, args.eval_new_tokens = 20.0, 2, 16, 16
        args.final_eval_s, args.save_every_s = 10.0, 30.0
    elif args.target is None:
        ap.error("--target is required (or --cpu-smoke)")
    return args


def write_sequences(target: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, texts: list[str],
                    args: argparse.Namespace, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    """``--sequences`` corpus windows continued by the target (``continue_text``) in batches of ``--gen-batch``,
    stopping early after ``--gen-seconds``: ``[n, prefix_len + gen_len]`` int32."""
    t0 = t_warm = time.time()
    rows, bar = [], tqdm(total=args.sequences, desc="target writes", unit="seq")
    while sum(len(r) for r in rows) < args.sequences:
        n = min(args.gen_batch, args.sequences - sum(len(r) for r in rows))
        prompts = sample_windows(texts, tokenizer, n, args.prefix_len, rng).to(target.device)
        rows.append(continue_text(target, prompts, args.gen_len, args.gen_temperature, gen).to(torch.int32))
        bar.update(n)
        if len(rows) == 1:
            t_warm = time.time()      # the first batch pays for kernel compilation: not held against the cap
        elif args.gen_seconds is not None and time.time() - t_warm > args.gen_seconds:
            break
    bar.close()
    sequences = torch.cat(rows)
    print(f"target wrote {len(sequences)} sequences of {sequences.shape[1]} tokens in {time.time() - t0:.1f} s "
          f"({time.time() - t_warm:.1f} s after the first batch)")
    return sequences


def load_sequences(folders: list[Path]) -> torch.Tensor:
    """The target-written ``sequences.pt`` of earlier runs' checkpoint folders, concatenated (one width)."""
    parts = [torch.load(folder / "sequences.pt") for folder in folders]
    widths = {p.shape[1] for p in parts}
    if len(widths) > 1:
        raise ValueError(f"--sequences-from folders hold sequences of different lengths {sorted(widths)}: "
                         "pass runs made with the same --prefix-len + --gen-len")
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--mtp" in argv:            # an MTP head for a GDN hybrid target: its own trainer
        from specla_hf.training import train_mtp
        return train_mtp.main(argv)
    t_start = time.time()
    args = parse_args(argv)
    if args.resume and (args.init_from or args.sequences_from):
        raise ValueError("--resume continues a checkpoint with its own weights and sequences: drop --init-from / "
                         "--sequences-from")
    deadline = t_start + args.minutes * 60
    ckpt_dir = args.checkpoint_dir or args.out / "checkpoint"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator(device).manual_seed(args.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    # target and tokenizer
    if args.cpu_smoke:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(SMOKE_TOKENIZER)
        target = smoke_target(len(tokenizer), args.seed, args.family)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(
            args.target, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    adapter_for(target)                   # a model SpecLA cannot drive is refused before any work
    target = target.to(device).eval().requires_grad_(False)
    if device.type == "cuda" and isinstance(target, GatedDeltaNetForCausalLM):
        for block in target.model.layers:   # see drafter_loss: no new kernels to autotune for the feature forward
            block.attn.mode = "fused_recurrent"
    text = target.config.get_text_config()
    print(f"target: {type(target).__name__}, {sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters, "
          f"{text.num_hidden_layers} layers, hidden {text.hidden_size} on {device}")

    # text
    train_files, held_out = corpus_files(args.corpus)
    texts = read_texts(train_files)
    if args.eval_corpus:
        eval_texts = read_texts(args.eval_corpus)
    elif held_out:
        eval_texts = read_texts(held_out)
    else:
        cut = max(1, len(texts) // 20)
        texts, eval_texts = texts[:-cut], texts[-cut:]
    eval_prompts = sample_windows(eval_texts, tokenizer, args.eval_prompts, args.eval_prompt_len,
                                  random.Random(args.seed + 1), from_start=True)
    print(f"corpus: {len(texts)} training / {len(eval_texts)} held-out documents")

    # drafter, optimizer, training sequences: fresh, from earlier runs (--init-from, --sequences-from) or from the
    # checkpoint (--resume: both, and the optimizer)
    state = {"step": 0, "cursor": 0, "perm": [], "history": [], "evals": []}
    trained = ckpt_dir if args.resume else args.init_from
    dart = dict(draft_slots=args.dart_slots, ngram_weight=args.ngram_weight) if args.dart_slots else None
    if trained:
        drafter = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)   # EAGLE or DART
        if not isinstance(drafter, SpecLADrafter):
            raise ValueError(f"{trained} holds a {type(drafter).__name__}, not a SpecLA drafter")
        drafter.check_target(target)
        if dart and not isinstance(drafter, SpecLADartDrafter):
            drafter = dart_from_eagle(drafter, **dart)
        elif not dart and isinstance(drafter, SpecLADartDrafter):
            raise ValueError(f"{trained} is a DART drafter: pass --dart-slots {drafter.config.draft_slots}")
    else:
        overrides = dict(num_heads=2, head_dim=16) if args.cpu_smoke else {}
        cfg = (SpecLADartConfig if dart else SpecLADrafterConfig).for_target(
            target.config, feature_layers=args.feature_layers, hidden_ratio=args.hidden_ratio, **overrides,
            **(dart or {}))
        drafter = (SpecLADartDrafter if dart else SpecLADrafter)(cfg)
    written = [ckpt_dir] if args.resume else args.sequences_from
    if written:
        sequences = load_sequences(written)
        print(f"training on {len(sequences)} sequences of {sequences.shape[1]} tokens written earlier")
    else:
        sequences = write_sequences(target, tokenizer, texts, args, rng, gen)
    if args.resume:
        saved = torch.load(ckpt_dir / "trainer_state.pt", weights_only=False)
        print(f"resumed from {ckpt_dir} at step {saved['step']}")
    elif dart:
        drafter.set_bigram(text_bigram(sequences, tokenizer, texts[:args.bigram_docs], drafter.config))
    drafter = drafter.to(device).train()
    sequences = sequences.to(device)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n_params / 1e6:.2f} M parameters, feature layers {drafter.config.feature_layers}")
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    if args.resume:
        opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        state = {k: saved[k] for k in state}

    def checkpoint() -> None:
        save_checkpoint(ckpt_dir, drafter, opt, state, sequences)

    def run_eval(label: str, limit_s: float) -> None:
        drafter.eval()
        try:
            result = evaluate_tau(target, drafter, eval_prompts, args.eval_new_tokens, EVAL_CONFIGS[0][1], limit_s)
            state["evals"].append({"step": state["step"], "label": label, **result})
            print(f"\n[{label}] step {state['step']}: chain tau {result['tau']:.2f} over {result['steps']} verify "
                  f"steps ({result['prompts']} prompts)")
        except Exception as e:  # an evaluation failure must not lose the training run
            state["evals"].append({"step": state["step"], "label": label, "error": f"{type(e).__name__}: {e}"})
            print(f"\n[{label}] evaluation failed: {type(e).__name__}: {e}")
        drafter.train()

    # training
    stop_at = deadline - args.final_eval_s - 15.0
    t_train0, error = time.time(), None
    next_eval, next_save = t_train0 + args.eval_every_s, t_train0 + args.save_every_s
    first_step = state["step"]
    bar = tqdm(desc="train", unit="step", initial=first_step, total=args.steps, mininterval=5)
    window: dict[str, torch.Tensor] = {}
    since_log = 0

    def log_window() -> None:
        nonlocal window, since_log
        entry = {"step": state["step"], "elapsed_s": round(time.time() - t_start, 1),
                 **{k: round(float(v) / since_log, 4) for k, v in window.items()}}
        state["history"].append(entry)
        bar.set_postfix(loss=entry["loss"], kl1=entry["kl1"], acc1=entry["acc1"], acc2=entry["acc2"])
        window, since_log = {}, 0

    try:
        while time.time() < stop_at and (args.steps is None or state["step"] < args.steps):
            if time.time() >= next_eval:
                run_eval("periodic", args.eval_every_s / 6)
                next_eval = time.time() + args.eval_every_s
            if state["cursor"] + args.batch_size > len(sequences):
                state["cursor"] = 0
            if state["cursor"] == 0:   # a new epoch: a new order (seeded by the epoch, so resuming agrees)
                state["perm"] = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(
                    args.seed + state["step"])).tolist()
            idx = state["perm"][state["cursor"]:state["cursor"] + args.batch_size]
            state["cursor"] += args.batch_size
            x = sequences[idx].long()
            progress = max((time.time() - t_train0) / max(stop_at - t_train0, 1e-9),
                           (state["step"] - first_step) / args.steps if args.steps else 0.0)
            for group in opt.param_groups:
                group["lr"] = lr_at(state["step"], progress, args.lr, args.warmup)
            if dart:
                loss, metrics = dart_loss(drafter, target, x, args.hard_weight, amp, args.branches, rng)
            else:
                loss, metrics = drafter_loss(drafter, target, x, args.hard_weight, amp)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            since_log += 1
            for k, v in {"loss": loss.detach(), **metrics}.items():
                window[k] = window.get(k, 0.0) + v
            if since_log == 10 or state["step"] == first_step + 1:   # reading values syncs the GPU
                log_window()
            bar.update()
            if time.time() >= next_save:
                checkpoint()
                next_save = time.time() + args.save_every_s
    except Exception as e:  # keep what was trained: save, evaluate and report the error
        error = f"{type(e).__name__}: {str(e)[:1000]}"
        print(f"training stopped by {error}")
    if since_log:
        log_window()
    bar.close()
    checkpoint()
    if state["step"] == first_step and error is None and (args.steps is None or first_step < args.steps):
        # the clock, not --steps (0: a writing stage), ended training before its first step; saving the unchanged
        # weights as a trained drafter would pass for a result
        raise SystemExit(f"no training step fitted in --minutes {args.minutes:g}: {t_train0 - t_start:.0f} s went to "
                         f"loading and the target's text (cold kernel compiles on a fresh GPU), and the last "
                         f"{deadline - stop_at:.0f} s are kept for the final evaluation. Give more --minutes, "
                         f"or reuse the {len(sequences)} sequences written with --sequences-from {ckpt_dir}")

    # save, then compare chain / tree / pruned tree on the held-out prompts
    drafter.eval()
    save_dtype = getattr(torch, args.save_dtype)
    copy.deepcopy(drafter).to(save_dtype).save_pretrained(args.out)
    final = {}
    per_config_s = max(args.final_eval_s, 5.0) / len(EVAL_CONFIGS)
    for name, drafting in EVAL_CONFIGS:
        try:
            final[name] = evaluate_tau(target, drafter, eval_prompts, args.eval_new_tokens, drafting, per_config_s)
        except Exception as e:
            final[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"\n{'drafting':<14}{'tau':>6}{'nodes/step':>12}{'rejected/step':>15}{'identical':>11}{'prompts':>9}")
    for name, r in final.items():
        if "error" in r:
            print(f"{name:<14} failed: {r['error']}")
        else:
            print(f"{name:<14}{r['tau']:>6.2f}{r['nodes_per_step']:>12.1f}{r['rejected_per_step']:>15.1f}"
                  f"{r['identical']:>11.3f}{r['prompts']:>9}")
    history = state["history"]
    log = {
        "args": {k: str(v) for k, v in vars(args).items()}, "config": drafter.config.to_dict(),
        "parameters": n_params, "device": torch.cuda.get_device_name() if device.type == "cuda"
        else platform.processor() or "cpu", "torch": torch.__version__,
        "target": str(args.target) if args.target else "random smoke target",
        "sequences": list(sequences.shape), "steps": state["step"], "error": error,
        "initial_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "history": history, "evals": state["evals"], "final_eval": final,
        "total_seconds": round(time.time() - t_start, 1),
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved the drafter to {args.out} in {time.time() - t_start:.0f} s total")


if __name__ == "__main__":
    main()
