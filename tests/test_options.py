"""Every generation option the README promises, with an assistant, against plain decoding of the same call.

The embedded target and its aligned drafter (real text, so stop strings and EOS are hit); chain and tree drafting.
Sampling options are checked for equality where they are deterministic (top_k=1 samples the argmax); their
distributions are checked by the chi-square tests in test_generate.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import specla_hf  # noqa: F401
from conftest import CollectStreamer

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def models():
    target = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "specla-gdn-tiny", dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "specla-gdn-tiny-drafter",
                                                   dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "specla-gdn-tiny")
    return target, drafter, tok


def _options(tok):
    newline = tok("\n").input_ids[-1]
    banned = tok(" the").input_ids[-1]
    return {
        "stop_strings": dict(stop_strings=["\n\n", "return"], tokenizer=tok),
        "eos_token_id": dict(eos_token_id=newline, pad_token_id=newline),
        "min_new_tokens": dict(eos_token_id=newline, pad_token_id=newline, min_new_tokens=12),
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=3),
        "bad_words_ids": dict(bad_words_ids=[[banned]]),
        "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda batch, ids: [t for t in range(500)
                                                                                     if t != banned]),
        "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=30, do_sample=False,
                                                                     repetition_penalty=1.2)),
        "top_k_1_sampling": dict(do_sample=True, top_k=1, temperature=0.7),
        "max_length": dict(max_length=25, max_new_tokens=None),
    }


@pytest.mark.parametrize("tree", [False, True])
def test_every_option_equals_plain_decoding(models, tree):
    target, drafter, tok = models
    ids = tok(PROMPT, return_tensors="pt")
    for name, kwargs in _options(tok).items():
        call = dict(max_new_tokens=40, do_sample=False)
        call.update(kwargs)
        call = {k: v for k, v in call.items() if v is not None}
        if "generation_config" in call:
            call.pop("max_new_tokens"), call.pop("do_sample")
        plain = target.generate(**ids, **call)
        spec = target.generate(**ids, **call, assistant_model=drafter, tree=tree)
        assert torch.equal(spec, plain), name
    # the options took effect: stop strings cut the text, max_length bounds it
    stopped = target.generate(**ids, max_new_tokens=40, do_sample=False, assistant_model=drafter, tree=tree,
                              **_options(tok)["stop_strings"])
    assert stopped.shape[1] < ids.input_ids.shape[1] + 40
    assert any(stop in tok.decode(stopped[0, -3:]) for stop in ("\n\n", "return"))


def test_scores_logits_and_streamer_equal_plain(models):
    target, drafter, tok = models
    ids = tok(PROMPT, return_tensors="pt")
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    plain, plain_stream = target.generate(**ids, **kwargs, streamer=(a := CollectStreamer())), a
    spec, spec_stream = target.generate(**ids, **kwargs, assistant_model=drafter, tree=True,
                                        streamer=(b := CollectStreamer())), b
    assert torch.equal(spec.sequences, plain.sequences) and target.specla_stats.steps < 24
    for got, want in ((spec.scores, plain.scores), (spec.logits, plain.logits)):
        assert len(got) == len(want) == 24
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert spec_stream.tokens == plain_stream.tokens
