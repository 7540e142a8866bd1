"""Tiny random GDN checkpoints with a character-level tokenizer, saved like real ones, for the CLI and demo tests."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_gdn

EOS = "<|endoftext|>"
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
VOCAB = [EOS, "<unk>"] + CHARS            # 99 tokens: one per printable ASCII character


def char_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token="<unk>")


def save_tiny_checkpoints(root: Path) -> dict[str, Path]:
    """Under ``root``: ``target`` (2 blocks), ``drafter`` (the target with its weights perturbed: it agrees with the
    target often, not always) and ``other-vocab-drafter`` (a vocabulary of 50). The models are random, so their
    distributions are flat: pass a confidence threshold of 0, or every draft is pruned."""
    paths = {name: root / name for name in ("target", "drafter", "other-vocab-drafter")}
    tokenizer = char_tokenizer()
    target = tiny_gdn(seed=0, vocab=len(VOCAB))
    drafter = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    for name, model in (("target", target), ("drafter", drafter),
                        ("other-vocab-drafter", tiny_gdn(seed=2, vocab=50, layers=1))):
        # no EOS: a random model would stop at a random point; runs go to max_new_tokens
        model.config.pad_token_id = model.generation_config.pad_token_id = 0
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def greedy_text(path: Path, prompt: str, n: int) -> str:
    """Plain greedy continuation of ``prompt`` by the checkpoint at ``path`` (the reference text CLI/demo must match)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(prompt, return_tensors="pt").input_ids
    return tok.decode(model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:],
                      skip_special_tokens=True)


def hub_snapshot(cache: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The snapshot folder of ``repo_id`` in a Hugging Face Hub cache at ``cache``, with its ``main`` ref pointing to
    it (the layout huggingface_hub reads without the network); the caller writes the snapshot's files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def run_offline(code: str, cache: Path, home: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (huggingface_hub reads its environment at import) with HF_HUB_OFFLINE=1 and
    ``cache`` as its Hub cache."""
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
