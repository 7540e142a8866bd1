"""Train an embedded target on the project corpus: a small fla ``GatedDeltaNetForCausalLM`` (``--family
gated_deltanet``, the default) or a small transformers ``Qwen3_5ForCausalLM`` hybrid (``--family qwen3_5``).

On the H200, the fla model (see docs/target-model.md for the exact commands of both):

    python benchmarks/train_target.py --corpus .device/corpus --minutes 8 --out $OUT/specla-gdn-tiny

On a CPU, one thread, the hybrid:

    OMP_NUM_THREADS=1 python benchmarks/train_target.py --family qwen3_5 --minutes 50 --seq-len 512 --batch-size 8 \
        --lr 3e-3 --warmup 100 --out checkpoints/specla-qwen35-tiny

``--minutes`` is the wall-clock budget of the whole script (tokenization, kernel compilation, training, final
evaluation, saving), so a device command with a hard limit can plan on it. ``--cpu-smoke`` trains a tiny model of the
family for ~30 s on the CPU to exercise the same code.

fla's model trains with fla's Triton norms, convolution, MLP and cross-entropy on the GPU, but its gated delta rule
runs through ``specla_kernels.chunk`` (``use_backend(delta_rule="torch")``), because fla's chunk backward is refused
on Hopper with Triton 3.6. The hybrid trains through transformers' own torch functions (``import specla_hf`` routes
them to torch on a CPU, ``specla_hf.models.transformers_backend``), the whole model under ``torch.compile``.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

import specla_hf  # noqa: F401  (installs the torch/fla dispatch)
import specla_kernels.chunk as chunk_mod
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from specla_hf.models.fla_backend import use_backend
from train_tokenizer import DEFAULT_CORPUS, iter_texts, save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "The history of", "int main(void)"]
# (model, --cpu-smoke model) per family. The hybrid: 3 GDN layers to 1 gated full-attention layer (``layer_types``'
# default), GDN value heads twice the key heads as in Qwen3.5's releases, 4.1 M parameters of which 2.1 M are the
# tied embedding, so that it and its aligned drafter stay under ~10 MB in bf16
SHAPES = {
    "gated_deltanet": (
        dict(hidden_size=384, num_hidden_layers=4, num_heads=6, head_dim=64, expand_v=2, hidden_ratio=4),
        dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=2, hidden_ratio=2)),
    "qwen3_5": (
        dict(hidden_size=256, num_hidden_layers=4, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64),
        dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
             linear_value_head_dim=32)),
}


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------
def tokenize_shards(paths: list[Path], tokenizer: Tokenizer, max_docs: int | None = None) -> np.ndarray:
    """One packed uint16 token stream: every document preceded by <|endoftext|> (the tokenizer's template adds it)."""
    parts = []
    for path in paths:
        texts = []
        for text in iter_texts(path):
            texts.append(text)
            if max_docs is not None and len(texts) >= max_docs:
                break
        # encode_batch runs on all cores (Rust threads)
        parts += [np.asarray(e.ids, dtype=np.uint16) for e in tokenizer.encode_batch(texts, add_special_tokens=True)]
    return np.concatenate(parts)


def to_rows(stream: np.ndarray, seq_len: int, device: torch.device) -> torch.Tensor:
    """Non-overlapping rows of ``seq_len`` tokens (the tail is dropped), int32 on the device."""
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].astype(np.int32)).view(n, seq_len).to(device)


# ----------------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------------
def build_model(family: str, shape: dict, tokenizer: PreTrainedTokenizerFast, seq_len: int,
                device: torch.device) -> PreTrainedModel:
    """A fresh ``family`` model of ``shape`` with the tokenizer's vocabulary and special tokens, tied embeddings."""
    common = dict(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=seq_len,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if family == "gated_deltanet":
        return GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**shape, **common, fuse_linear_cross_entropy=False,
                                                            fuse_cross_entropy=device.type == "cuda"))
    # a quarter of each attention head rotated, as in Qwen3.5's releases
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape, **common, rope_parameters=rope))
    model.config._attn_implementation = "sdpa"      # what HybridRunner drives (a tree needs an explicit mask)
    return model


# ----------------------------------------------------------------------------------------------------------------
# compiled if it compiles
# ----------------------------------------------------------------------------------------------------------------
def compile_model(model: PreTrainedModel, x: torch.Tensor, amp: torch.autocast
                  ) -> tuple[torch.nn.Module, str, str]:
    """``torch.compile(model)`` if it compiles and its loss on ``x`` matches eager's, else ``model``; returns (the
    module to train, ``"compiled"`` or ``"eager"``, note). For the hybrid on a CPU: transformers' torch delta rule is
    many small ops, which compiling fuses (1.8x the eager training throughput at the shipped shape)."""
    t0 = time.time()
    try:
        compiled = torch.compile(model)
        with amp:
            got = compiled(input_ids=x, labels=x, use_cache=False).loss
            want = model(input_ids=x, labels=x, use_cache=False).loss
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    except Exception as e:  # any compiler failure: train eagerly rather than not at all
        return model, "eager", f"torch.compile failed: {type(e).__name__}: {str(e)[:500]}"
    return compiled, "compiled", f"compiled and checked in {time.time() - t0:.0f} s"


def compile_delta_rule(batch: int, seq_len: int, cfg: GatedDeltaNetConfig, device: torch.device) -> tuple[str, str]:
    """Swap in ``torch.compile(chunk_gated_delta_rule_torch)`` if it compiles and matches eager at training shapes.

    The backend imports the function from ``specla_kernels.chunk`` at each call, so replacing the module attribute
    is what routes the model's layers through the compiled version. Returns (``"compiled"`` or ``"eager"``, note).
    """
    eager = chunk_mod.chunk_gated_delta_rule_torch
    if device.type != "cuda":
        return "eager", "no GPU"
    H, K = cfg.num_heads, cfg.head_dim
    HV = cfg.num_v_heads or H
    V = int(K * cfg.expand_v)
    gen = torch.Generator(device).manual_seed(0)
    q, k = (torch.randn(batch, seq_len, H, K, device=device, generator=gen, dtype=torch.bfloat16) for _ in "qk")
    v = torch.randn(batch, seq_len, HV, V, device=device, generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(batch, seq_len, HV, device=device, generator=gen) * 0.1
    beta = torch.rand(batch, seq_len, HV, device=device, generator=gen)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    t0 = time.time()
    try:
        compiled = torch.compile(eager, dynamic=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o, S = compiled(*inputs, initial_state=None, scale=None)
            (o.float().square().mean() + S.square().mean()).backward()
            o_ref, S_ref = eager(*inputs, initial_state=None, scale=None)
        torch.testing.assert_close(S, S_ref, rtol=1e-2, atol=1e-2)
    except Exception as e:  # any compiler failure: train eagerly rather than not at all
        return "eager", f"torch.compile failed: {type(e).__name__}: {str(e)[:500]}"
    chunk_mod.chunk_gated_delta_rule_torch = compiled
    return "compiled", f"compiled and checked in {time.time() - t0:.0f} s"


# ----------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------
def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over steps, then cosine to ``min_ratio * peak`` over ``progress``, the fraction of the
    training time budget used."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (embeddings included); not norms, biases, nor fla's A_log / dt_bias."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def evaluate(model: torch.nn.Module, rows: torch.Tensor, batch: int, max_batches: int | None,
             amp: torch.autocast) -> float:
    """Mean next-token loss over full batches of ``rows``.

    Grad stays enabled (nothing is backpropagated): the backend sends only grad-enabled calls to the chunk form, and
    its no-grad path is the token-by-token loop, 1024 steps per layer.
    """
    n = len(rows) // batch if max_batches is None else min(max_batches, len(rows) // batch)
    model.eval()
    total = torch.zeros((), device=rows.device)
    with torch.enable_grad(), amp:
        for i in range(n):
            x = rows[i * batch:(i + 1) * batch].long()
            total += model(input_ids=x, labels=x, use_cache=False).loss.detach().float()
    model.train()
    return total.item() / n


@torch.no_grad()
def greedy_samples(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, max_new_tokens: int
                   ) -> list[dict]:
    """Greedy continuations of PROMPTS, on the torch path everywhere so no new Triton kernels compile at the end.

    A plain cached loop rather than ``generate``: transformers 5.17's ``generate`` passes an all-ones attention mask,
    which fla turns into packed (cu_seqlens) inputs that the torch path does not take.
    """
    model.eval()
    samples = []
    with use_backend(modules="torch", delta_rule="torch"):
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
            out = model(input_ids=ids, use_cache=True)
            new = []
            for _ in range(max_new_tokens):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                new.append(nxt.item())
                out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            samples.append({"prompt": prompt, "completion": tokenizer.decode(new)})
    return samples


def main(argv: list[str] | None = None) -> None:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="train-*.jsonl.xz and valid.jsonl.xz")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "checkpoints" / "specla-gdn-tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole script")
    ap.add_argument("--reserve-s", type=float, default=20.0, help="kept for saving and sampling after the final eval")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200, help="warmup steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--eval-batches", type=int, default=4, help="batches per periodic eval (the final one uses all)")
    ap.add_argument("--max-docs", type=int, default=None, help="documents per training shard (default: all)")
    ap.add_argument("--val-docs", type=int, default=None, help="validation documents (default: all)")
    ap.add_argument("--compile", choices=["auto", "off"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(SHAPES), default="gated_deltanet",
                    help="fla's GatedDeltaNetForCausalLM or transformers' Qwen3_5ForCausalLM hybrid")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, short sequences, ~30 s on the CPU")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.batch_size, args.seq_len, args.lr, args.warmup = 8, 64, 1e-2, 3
        args.compile = "off"        # compiling takes longer than the whole smoke run
        args.eval_every_s, args.eval_batches, args.reserve_s = 10.0, 2, 10.0
        args.max_docs, args.val_docs = args.max_docs or 40, args.val_docs or 10
    deadline = t_start + args.minutes * 60

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    torch.set_float32_matmul_precision("high")  # TF32 for the fp32 chunk matmuls
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    # data
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    train_paths = sorted(args.corpus.glob("train-*.jsonl.xz"))
    if not train_paths:
        raise SystemExit(f"no train-*.jsonl.xz under {args.corpus}")
    t0 = time.time()
    train_rows = to_rows(tokenize_shards(train_paths, tok, args.max_docs), args.seq_len, device)
    val_rows = to_rows(tokenize_shards([args.corpus / "valid.jsonl.xz"], tok, args.val_docs), args.seq_len, device)
    print(f"tokenized {len(train_paths)} shards in {time.time() - t0:.1f} s: {train_rows.numel() / 1e6:.1f} M train, "
          f"{val_rows.numel() / 1e6:.2f} M valid tokens")

    # model
    model = build_model(args.family, SHAPES[args.family][args.cpu_smoke], hf_tokenizer, args.seq_len, device)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.family}, {n_params / 1e6:.2f} M parameters on {device}")
    # ``forward`` is what trains: the model, or the model compiled. Evaluation runs ``model``: switching a compiled
    # module to eval mode would compile it again (minutes on a CPU), and an eval costs little next to training
    forward = model
    compiles = "delta rule" if args.family == "gated_deltanet" else "model"
    if args.compile == "off":
        impl, impl_note = "eager", "--compile off"
    elif args.family == "gated_deltanet":
        impl, impl_note = compile_delta_rule(args.batch_size, args.seq_len, model.config, device)
    else:
        forward, impl, impl_note = compile_model(model, train_rows[:args.batch_size].long(), amp)
    print(f"{compiles}: {impl} ({impl_note})")

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    tokens_per_step = args.batch_size * args.seq_len
    history: list[dict] = []
    step, tokens, eval_s, error = 0, 0, 0.0, None
    losses = torch.zeros((), device=device)
    last_train_loss = float("nan")
    with use_backend(delta_rule="torch"):
        val0 = evaluate(model, val_rows, args.batch_size, args.eval_batches, amp)
        history.append({"step": 0, "tokens": 0, "val_loss": val0, "elapsed_s": time.time() - t_start})
        print(f"step 0: val loss {val0:.3f}")
        t_train0 = t_sched0 = time.time()
        stop_at = deadline - args.reserve_s
        next_eval = time.time() + args.eval_every_s
        # measured at each periodic eval (the first eval's time is mostly kernel compilation): leaves the final,
        # full validation pass its share of the budget
        eval_s_per_batch = 0.0
        last = {"tokens": 0, "train_s": 0.0}
        perm = torch.randperm(len(train_rows), device=device)
        cursor, since_log = 0, 0
        bar = tqdm(desc="train", unit="step", mininterval=10)
        try:
            while time.time() + eval_s_per_batch * (len(val_rows) // args.batch_size) < stop_at:
                if cursor + args.batch_size > len(perm):
                    perm, cursor = torch.randperm(len(train_rows), device=device), 0
                x = train_rows[perm[cursor:cursor + args.batch_size]].long()
                cursor += args.batch_size
                progress = (time.time() - t_sched0) / max(stop_at - t_sched0, 1e-9)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, progress, args.lr, args.warmup)
                with amp:
                    loss = forward(input_ids=x, labels=x).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses += loss.detach().float()
                step, since_log, tokens = step + 1, since_log + 1, tokens + tokens_per_step
                if since_log == 10 or step == 1:  # reading the loss syncs the GPU: do it every 10 steps
                    last_train_loss = losses.item() / since_log
                    if step == 1:  # the first step autotunes fla's backward kernels (minutes on a fresh GPU)
                        t_sched0 = time.time()
                    losses.zero_()
                    since_log = 0
                    bar.set_postfix(loss=f"{last_train_loss:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}",
                                    tok_s=f"{tokens / max(time.time() - t_train0 - eval_s, 1e-9):.0f}")
                bar.update()
                if time.time() >= next_eval:
                    t_eval = time.time()
                    train_s = t_eval - t_train0 - eval_s
                    val = evaluate(model, val_rows, args.batch_size, args.eval_batches, amp)
                    eval_s += time.time() - t_eval
                    eval_s_per_batch = (time.time() - t_eval) / args.eval_batches
                    interval_tps = (tokens - last["tokens"]) / (train_s - last["train_s"])
                    last = {"tokens": tokens, "train_s": train_s}
                    history.append({"step": step, "tokens": tokens, "train_loss": last_train_loss, "val_loss": val,
                                    "tokens_per_s": interval_tps, "elapsed_s": time.time() - t_start})
                    print(f"\nstep {step}: train {last_train_loss:.3f} val {val:.3f} "
                          f"{interval_tps:.0f} tok/s, {time.time() - t_start:.0f} s elapsed")
                    next_eval = time.time() + args.eval_every_s
        except Exception as e:  # keep what was trained: evaluate, save and report the error
            error = f"{type(e).__name__}: {str(e)[:1000]}"
            print(f"training stopped by {error}")
        bar.close()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.time() - t_train0 - eval_s
        if since_log:
            last_train_loss = losses.item() / since_log
        val_final = evaluate(model, val_rows, args.batch_size, None, amp)
    print(f"final: {step} steps, {tokens / 1e6:.1f} M tokens, train {last_train_loss:.3f}, val {val_final:.3f}")

    model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size="15MB", safe_serialization=True)
    save_tokenizer(hf_tokenizer, args.out)
    model.float()  # bf16-rounded weights, as a float32 load of the checkpoint sees them
    try:  # the checkpoint is saved already; a generation failure must not lose the log
        samples = greedy_samples(model, hf_tokenizer, 16 if args.cpu_smoke else 64)
    except Exception as e:
        samples, error = [], (error or "") + f" sampling: {type(e).__name__}: {str(e)[:1000]}"
    for s in samples:
        print(f"--- {s['prompt']!r}\n{s['prompt']}{s['completion']}")
    log = {
        "command": " ".join([Path(sys.executable).name, sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "family": args.family,
        "config": model.config.to_dict(), "parameters": n_params, "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "compile": f"{compiles}: {impl}", "compile_note": impl_note,
        "steps": step, "tokens_seen": tokens, "train_tokens": train_rows.numel(), "val_tokens": val_rows.numel(),
        "train_seconds": train_s, "tokens_per_s": tokens / max(train_s, 1e-9),
        "steady_tokens_per_s": history[-1].get("tokens_per_s") if len(history) > 2 else None,
        "final_train_loss": last_train_loss, "initial_val_loss": val0, "final_val_loss": val_final,
        "history": history, "samples": samples, "error": error, "total_seconds": time.time() - t_start,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved to {args.out} in {time.time() - t_start:.0f} s total")


if __name__ == "__main__":
    main()
