"""Train a multi-token-prediction (MTP) head for a GDN hybrid target that ships none: ``specla-train-drafter --mtp``.

    specla-train-drafter --mtp --target checkpoints/<hybrid> --corpus corpus/ --out runs/mtp --minutes 10
    specla-train-drafter --mtp --cpu-smoke --out /tmp/mtp-smoke      # a tiny random Qwen3.5 hybrid, ~20 s on a CPU

The head is saved as the released Qwen3.5 / Qwen3-Next checkpoints keep theirs (``MTPDrafter.save_pretrained``:
``config.json`` with the target's text-config keys, ``model.safetensors`` of ``mtp.*`` tensors), so
``MTPDrafter.from_pretrained(OUT)`` reads it as it reads a released head, and ``target.generate(ids,
assistant_model=head)`` drafts with it.

1. Sequences: ``--sequences`` prompts of ``--prefix-len`` tokens (corpus windows, read as ``specla_hf.training.
   train_drafter`` reads its corpus; random tokens in the smoke run) continued by the target for ``--gen-len`` tokens:
   the head learns the target's own text.
2. A fresh head starts from the target's last full-attention decoder layer (its ``mtp_block``) and final norm (its
   ``post_norm``): it reads and writes the target's state space from the first step; ``fc`` and the pre-fc norms
   start as their modules initialise them.
3. Each step: the target (no gradient) gives its last hidden states after its final norm and its next-token
   distributions; the head runs ``--passes`` sequence-mode passes. Pass 1 reads the target's hidden state at each
   position (a draft's root, depth 1); pass ``k`` reads pass ``k - 1``'s output one position back (a depth-``k``
   node reads its parent's output) and attends as that node does at decode time: to pass 1's keys up to its root (the
   committed positions) and to its ancestors' keys, one per earlier pass. Position ``t`` of every pass is labelled
   with the target's distribution over token ``t + 2``: cross-entropy against it plus ``--hard-weight`` x against the
   target's greedy token (``train_drafter``'s loss).
4. The end: the head saved in ``--save-dtype`` with ``train_log.json``, then greedy speculative decoding (chain and
   tree) of held-out prompts: acceptance length tau, and the fraction of tokens identical to plain decoding.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from specla_hf.drafters.mtp import MTPDrafter
from specla_hf.models.qwen3_5 import text_decoder
from specla_hf.models.tree_attention import rotary_positions
from specla_hf.training.train_drafter import _label_loss, continue_text, corpus_files, lr_at, read_texts, \
    sample_windows

EVAL_CONFIGS = {"chain": dict(tree=False), "tree": dict(tree=True)}


# ----------------------------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def target_signals(target, x: torch.Tensor, amp) -> dict:
    """The target's side of a step on token rows ``x [B, S]``, for head positions ``0..S-2``: its hidden states after
    the final norm, its embeddings of tokens ``1..S-1``, and its distribution over tokens ``2..S`` (log-probs, probs,
    greedy token, entropy)."""
    with amp:
        hidden = text_decoder(target)(input_ids=x).last_hidden_state
        logp = torch.log_softmax(target.get_output_embeddings()(hidden[:, 1:]).float(), -1)
        embeds = target.get_input_embeddings()(x[:, 1:])
    p = logp.exp()
    return dict(hidden=hidden[:, :-1], embeds=embeds, logp=logp, p=p, greedy=logp.argmax(-1),
                entropy=-(p * logp).sum(-1))


class _PassKeys:
    """``past_key_values`` of the training passes: every pass's keys and values are kept, and a pass attends to all
    those kept so far (``pass_mask`` picks which)."""

    def __init__(self):
        self.keys, self.values = [], []

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, 2), torch.cat(self.values, 2)


def pass_mask(T: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask ``[1, 1, T, k T]`` of pass ``k`` over the keys of passes ``1..k``: position ``t`` (a depth-``k``
    node whose root is at ``t - k + 1``) sees pass 1 at positions ``<= t - k + 1`` and pass ``j`` at ``t - k + j``."""
    t = torch.arange(T, device=device)[:, None]
    s = torch.arange(T, device=device)[None, :]
    seen = torch.cat([s <= t - k + 1] + [s == t - k + j for j in range(2, k + 1)], 1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


def head_passes(mtp: MTPDrafter, rotary_emb, hidden: torch.Tensor, embeds: torch.Tensor,
                passes: int) -> list[torch.Tensor]:
    """The head's outputs ``[B, T, H]`` of passes ``1..passes`` (module docstring, step 3); position ``t`` of pass
    ``k`` is meaningful for ``t >= k - 1``."""
    B, T, _ = hidden.shape
    rotary = rotary_emb(embeds, rotary_positions(rotary_emb, torch.arange(T, device=embeds.device).expand(B, T)))
    keys, outputs = _PassKeys(), []
    for k in range(1, passes + 1):
        if k > 1:            # position t reads the previous pass's output at t - 1 (position 0: nothing to read)
            hidden = torch.cat([torch.zeros_like(outputs[-1][:, :1]), outputs[-1][:, :-1]], 1)
        outputs.append(mtp(embeds, hidden, rotary, pass_mask(T, k, embeds.dtype, embeds.device), keys))
    return outputs


def mtp_loss(mtp: MTPDrafter, target, x: torch.Tensor, passes: int, hard_weight: float,
             amp) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    sig = target_signals(target, x, amp)
    lm_head = target.get_output_embeddings()
    total, metrics = 0.0, {}
    with amp:
        outputs = head_passes(mtp, text_decoder(target).rotary_emb, sig["hidden"], sig["embeds"], passes)
        for k, out in enumerate(outputs, start=1):
            logq = torch.log_softmax(lm_head(out[:, k - 1:]).float(), -1)
            loss, metrics[f"kl{k}"], metrics[f"acc{k}"] = _label_loss(logq, sig, slice(k - 1, None), hard_weight)
            total = total + loss
    return total, metrics


# ----------------------------------------------------------------------------------------------------------------
# the head, the smoke target, the evaluation
# ----------------------------------------------------------------------------------------------------------------
def fresh_head(target) -> MTPDrafter:
    """A head for ``target`` starting from its last full-attention decoder layer and its final norm (step 2)."""
    decoder = text_decoder(target)
    mtp = MTPDrafter(decoder.config).to(target.device)
    last = [b for b, kind in zip(decoder.layers, decoder.config.layer_types) if kind == "full_attention"][-1]
    try:
        mtp.layer.mtp_block.load_state_dict(last.state_dict())
    except RuntimeError as e:
        raise ValueError(f"the MTP layer cannot start from the target's last attention layer (a dense MLP where the "
                         f"MTP layer has experts?): {str(e).splitlines()[0]}") from None
    mtp.layer.post_norm.load_state_dict(decoder.norm.state_dict())
    return mtp


def smoke_target(vocab_size: int, seed: int) -> Qwen3_5ForCausalLM:
    """A tiny random Qwen3.5 hybrid (three GDN layers, then an attention layer) whose next-token distributions are
    peaked enough to be worth learning."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 3.0 / config.hidden_size ** 0.5)
    return model.eval()


@torch.no_grad()
def evaluate(target, mtp: MTPDrafter, prompts: torch.Tensor, new_tokens: int, drafting: dict) -> dict:
    """Greedy speculative decoding of every prompt with the head: tau, draft nodes per step, and the fraction of
    prompts decoded exactly as plain greedy decoding decodes them (1.0 unless decoding is broken)."""
    head = copy.deepcopy(mtp).to(target.dtype).eval()
    steps = accepted = nodes = same = 0
    for prompt in prompts:
        ids = prompt[None].to(target.device)
        plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        spec = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=head,
                               confidence_threshold=0.0, autoregressive_fallback=False, **drafting)
        same += int(torch.equal(spec, plain))
        stats = target.specla_stats
        steps, accepted, nodes = steps + stats.steps, accepted + sum(stats.accepted), nodes + sum(stats.draft_nodes)
    return {"tau": (accepted + steps) / max(steps, 1), "nodes_per_step": nodes / max(steps, 1),
            "identical": same / len(prompts), "steps": steps}


# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtp", action="store_true", help="train an MTP head (what sends specla-train-drafter here)")
    ap.add_argument("--target", type=Path, help="local Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint (with its "
                    "tokenizer)")
    ap.add_argument("--corpus", type=Path, nargs="+", help=".jsonl / .jsonl.xz files or folders (train_drafter's "
                    "format)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the training loop")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: budget only)")
    ap.add_argument("--sequences", type=int, default=4096, help="target-written training sequences")
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=192)
    ap.add_argument("--gen-temperature", type=float, default=0.7, help="0 = greedy continuations")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2, help="draft depths trained (1 = the root only)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--hard-weight", type=float, default=0.5, help="weight of the greedy-token cross-entropy")
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny random hybrid target and random-token prompts, "
                    "small everything, on the CPU")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    if args.cpu_smoke:
        args.sequences, args.gen_batch, args.prefix_len, args.gen_len = 64, 64, 16, 48
        args.batch_size, args.lr, args.warmup, args.steps = 8, 3e-3, 3, args.steps or 200
        args.eval_prompts, args.eval_new_tokens, args.save_dtype = 2, 24, "float32"
    elif args.target is None or not args.corpus:
        ap.error("--target and --corpus are required (or --cpu-smoke)")
    return args


def prompts_and_target(args: argparse.Namespace, device: torch.device, rng: random.Random):
    """(target, training prompts, held-out prompts): the smoke run's random target and random tokens, else the
    checkpoint and windows of the corpus (its ``valid*`` files, or its last 5% of documents, held out)."""
    if args.cpu_smoke:
        target = smoke_target(256, args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        draw = lambda n: torch.randint(0, 256, (n, args.prefix_len), generator=gen)   # noqa: E731
        return target, draw(args.sequences), draw(args.eval_prompts)
    target = AutoModelForCausalLM.from_pretrained(args.target, attn_implementation="sdpa",
                                                  dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    train_files, held_out = corpus_files(args.corpus)
    texts = read_texts(train_files)
    if held_out:
        eval_texts = read_texts(held_out)
    else:
        cut = max(1, len(texts) // 20)
        texts, eval_texts = texts[:-cut], texts[-cut:]
    return (target, sample_windows(texts, tokenizer, args.sequences, args.prefix_len, rng),
            sample_windows(eval_texts, tokenizer, args.eval_prompts, args.prefix_len, random.Random(args.seed + 1),
                           from_start=True))


def main(argv: list[str] | None = None) -> None:
    t_start = time.time()
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    target, prompts, eval_prompts = prompts_and_target(args, device, rng)
    target = target.to(device).eval().requires_grad_(False)
    config = text_decoder(target).config
    print(f"target: {type(target).__name__}, {sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters, "
          f"{config.num_hidden_layers} layers, hidden {config.hidden_size} on {device}")

    # the target's own text
    gen = torch.Generator(device).manual_seed(args.seed)
    rows = [continue_text(target, prompts[i:i + args.gen_batch].to(device), args.gen_len, args.gen_temperature, gen)
            for i in tqdm(range(0, len(prompts), args.gen_batch), desc="target writes", unit="batch")]
    sequences = torch.cat(rows)
    print(f"target wrote {len(sequences)} sequences of {sequences.shape[1]} tokens")

    mtp = fresh_head(target).float().train()
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"MTP head: {n_params / 1e6:.2f} M parameters, {args.passes} passes per step")
    decay = [p for p in mtp.parameters() if p.ndim >= 2]
    no_decay = [p for p in mtp.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    deadline, history, window, since_log, step = time.time() + args.minutes * 60, [], {}, 0, 0
    t_train0 = time.time()
    bar = tqdm(desc="train", unit="step", total=args.steps, mininterval=5)
    while time.time() < deadline and (args.steps is None or step < args.steps):
        idx = torch.randint(0, len(sequences), (args.batch_size,), generator=torch.Generator().manual_seed(
            args.seed + step))
        progress = max((time.time() - t_train0) / (deadline - t_train0), step / args.steps if args.steps else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args.lr, args.warmup)
        loss, metrics = mtp_loss(mtp, target, sequences[idx.to(device)], args.passes, args.hard_weight, amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, since_log = step + 1, since_log + 1
        for k, v in {"loss": loss.detach(), **metrics}.items():
            window[k] = window.get(k, 0.0) + v
        if since_log == 10 or step == 1:                 # reading values syncs the GPU
            entry = {"step": step, "elapsed_s": round(time.time() - t_start, 1),
                     **{k: round(float(v) / since_log, 4) for k, v in window.items()}}
            history.append(entry)
            bar.set_postfix(loss=entry["loss"], acc1=entry["acc1"])
            window, since_log = {}, 0
        bar.update()
    bar.close()
    if not history:
        raise SystemExit(f"no training step fitted in --minutes {args.minutes:g}")

    mtp.eval()
    copy.deepcopy(mtp).to(getattr(torch, args.save_dtype)).save_pretrained(args.out)
    final = {name: evaluate(target, mtp, eval_prompts, args.eval_new_tokens, drafting)
             for name, drafting in EVAL_CONFIGS.items()}
    print(f"\nloss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} over {step} steps")
    for name, r in final.items():
        print(f"{name:<6} tau {r['tau']:.2f}, {r['nodes_per_step']:.1f} draft nodes per step, identical "
              f"{r['identical']:.3f}")
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "parameters": n_params,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "target": str(args.target) if args.target else "random smoke target",
           "sequences": list(sequences.shape), "steps": step, "initial_loss": history[0]["loss"],
           "final_loss": history[-1]["loss"], "history": history, "final_eval": final,
           "total_seconds": round(time.time() - t_start, 1)}
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved the MTP head to {args.out} in {time.time() - t_start:.0f} s total")
