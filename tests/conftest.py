"""Small random GDN models for CPU tests."""
from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import torch

import specla_hf  # noqa: F401  (installs the CPU torch path and generate(assistant_model=...))

# batch-1 decoding is thousands of tiny ops: one intra-op thread is fastest, and on a busy 2-core machine two
# threads spin-wait on each other for ~0.1 s per op
torch.set_num_threads(1)
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from transformers.generation.streamers import BaseStreamer


class CollectStreamer(BaseStreamer):
    """What ``generate`` streams: the chunks it put (the prompt first), and whether it ended the stream."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]


COMMON_WORDS = "the of and to in is that for it as with was on be by at this from".split()


def write_word_corpus(path: Path, gen: torch.Generator, docs: int = 40) -> Path:
    """``docs`` documents of 300 common words drawn with ``gen`` as JSON lines with a "text" field (xz-compressed for
    a ``.xz`` path): the corpus the drafter-training smoke runs read."""
    with (lzma.open if path.suffix == ".xz" else open)(path, "wt") as f:
        for _ in range(docs):
            idx = torch.randint(0, len(COMMON_WORDS), (300,), generator=gen)
            f.write(json.dumps({"text": " ".join(COMMON_WORDS[i] for i in idx)}) + "\n")
    return path


# model variants every runner test covers (``tiny_gdn`` keyword arguments)
VARIANTS = {
    "base": {},
    "gva": dict(heads=2, v_heads=4),
    "no_conv": dict(conv=False),
    "no_gate": dict(gate=False),
    "neg_eig": dict(neg_eig=True),
}


def tiny_gdn(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2, head_dim: int = 16,
             v_heads: int | None = None, vocab: int = 97, conv: bool = True, gate: bool = True,
             neg_eig: bool = False, fuse_norm: bool = True, dtype=torch.float32) -> GatedDeltaNetForCausalLM:
    torch.manual_seed(seed)
    cfg = GatedDeltaNetConfig(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, head_dim=head_dim,
                              num_v_heads=v_heads, vocab_size=vocab, expand_v=2, hidden_ratio=2,
                              use_short_conv=conv, use_gate=gate, allow_neg_eigval=neg_eig, fuse_norm=fuse_norm,
                              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = GatedDeltaNetForCausalLM(cfg).to(dtype).eval()
    # fla initialises A_log/dt_bias so that decay is near 1; spread them so gating matters in tests
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.A_log.uniform_(-1.0, 1.0)
            block.attn.dt_bias.uniform_(-2.0, 1.0)
    return model


def record_calls(obj, name: str) -> list:
    """Wrap the method ``obj.name`` so that each call appends ``obj`` to the returned list, then runs it."""
    calls, real = [], getattr(obj, name)
    setattr(obj, name, lambda *args, **kwargs: calls.append(obj) or real(*args, **kwargs))
    return calls


@pytest.fixture(scope="session")
def target():
    return tiny_gdn(seed=0)


@pytest.fixture(scope="session")
def bad_drafter():
    return tiny_gdn(seed=1, hidden=32, layers=1, heads=2, head_dim=8)


@pytest.fixture(autouse=True)
def _speculate_to_the_end(monkeypatch):
    """Tests check speculative decoding itself: no fallback to autoregressive decoding, whose timing-based decision
    would make step counts vary between runs (tests/test_fallback.py tests the fallback)."""
    import specla_hf.generation
    monkeypatch.setattr(specla_hf.generation, "AUTOREGRESSIVE_FALLBACK", False)
