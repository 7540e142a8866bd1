"""One prompt through plain ``generate`` and through SpecLA, timed the same way, for the CLI and the demo."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specla_hf.loop.stats import SpecLAStats
from specla_hf.app.loading import Models
from specla_hf.drafters.base import DraftOptions, DraftTree
from specla_hf.generation import draft_options, make_drafter


@dataclass
class DecodeSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0                  # 0: greedy
    tree: bool = False                        # False: a chain of drafts, generate()'s default
    tree_budget: int | None = None            # None: the library defaults (specla_hf.generation)
    confidence_threshold: float | None = None
    draft_depth: int | None = None

    def generate_kwargs(self) -> dict:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        sampling = dict(do_sample=True, temperature=self.temperature) if self.temperature > 0 else dict(do_sample=False)
        return dict(max_new_tokens=self.max_new_tokens, **sampling)

    def draft_options(self) -> DraftOptions:
        return draft_options(tree=self.tree, tree_budget=self.tree_budget if self.tree else None,
                             draft_depth=self.draft_depth, confidence_threshold=self.confidence_threshold)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Run:
    tokens: list[int]                     # generated tokens, prompt excluded
    seconds: float                        # wall time of the generate() call
    stats: SpecLAStats | None = None      # SpecLA runs only
    tree: DraftTree | None = None         # the last draft tree the target verified (SpecLA runs only)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


def encode(models: Models, prompt: str) -> torch.LongTensor:
    ids = models.tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenization")
    return ids.to(models.target.device)


def run_plain(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer=None) -> Run:
    return _timed(models, input_ids, settings, streamer)


def run_specla(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer=None) -> Run:
    # build the drafter wrapper here rather than in generate() so that its last verified tree stays reachable
    drafter = make_drafter(models.target, models.drafter, settings.draft_options())
    run = _timed(models, input_ids, settings, streamer, assistant_model=drafter)
    run.stats, run.tree = models.target.specla_stats, drafter.last_tree
    return run


def warm_up(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings) -> None:
    """A few tokens of each, so that one-time costs (allocator, lazy init) do not land in either timing."""
    short = DecodeSettings(4, settings.temperature, settings.tree, settings.tree_budget,
                           settings.confidence_threshold, settings.draft_depth)
    run_plain(models, input_ids, short)
    run_specla(models, input_ids, short)


def _timed(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer, **extra) -> Run:
    tok = models.tokenizer
    kwargs = settings.generate_kwargs()
    start = time.perf_counter()
    out = models.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                                 **kwargs, **extra)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    return Run(out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start)
