"""One prompt through SpecLA and through plain ``generate``, timed the same way for the CLI, the demo and its API.

``compare`` is the only place where the two are timed: after the same warm-up, one after the other (never both at
once), in the caller's thread settings, wall-clock around each ``generate()`` call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specla_hf.drafters.base import DraftTree
from specla_hf.generation import draft_options, make_drafter
from specla_hf.loop.stats import SpecLAStats
from specla_hf.drafters.options import MAX_TREE_BUDGET, DraftOptions

if TYPE_CHECKING:
    from specla_hf.app.loading import Models

WARM_UP_TOKENS = 4


@dataclass
class DecodeSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0                  # 0: greedy; above 0: sampling at this temperature
    top_k: int | None = None                  # sampling only; None: the model's generation config
    top_p: float | None = None
    seed: int | None = None                   # seeds torch before each timed run: sampled runs repeat
    tree: bool = False                        # False: a chain of drafts, generate()'s default
    fallback: bool = True                     # decode autoregressively once speculation does not pay, as generate()
    tree_budget: int | None = None            # None: the library defaults (specla_hf.generation)
    confidence_threshold: float | None = None
    draft_depth: int | None = None
    fixed_shape: bool = False                 # draft the configured depth and budget every step (no shape policy)

    def check(self) -> None:
        """ValueError naming the first setting out of range (the demo's API takes any value)."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.greedy and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k / top_p shape sampling: set a temperature above 0")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.tree_budget is not None and not 1 <= self.tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree budget must be between 1 and {MAX_TREE_BUDGET} (draft nodes one verify pass "
                             f"takes besides the root), got {self.tree_budget}")
        self.draft_options()

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return dict(max_new_tokens=self.max_new_tokens, do_sample=False)
        shaping = {k: v for k, v in (("top_k", self.top_k), ("top_p", self.top_p)) if v is not None}
        return dict(max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature, **shaping)

    def draft_options(self) -> DraftOptions:
        return draft_options(tree=self.tree, tree_budget=self.tree_budget if self.tree else None,
                             draft_depth=self.draft_depth, confidence_threshold=self.confidence_threshold,
                             adaptive_drafting=not self.fixed_shape)

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


@dataclass
class Comparison:
    specla: Run
    plain: Run

    @property
    def speedup(self) -> float:
        """SpecLA's tokens/s over plain decoding's: below 1 SpecLA was slower."""
        plain = self.plain.tokens_per_second
        return self.specla.tokens_per_second / plain if plain else float("nan")

    @property
    def pace(self) -> str:
        """"slower", "level" or "faster", judged on the speedup as the apps print it (two decimals), so a 0.997x
        never reads "1.00x, slower"."""
        shown = round(self.speedup, 2)
        return "slower" if shown < 1 else "level" if shown == 1 else "faster"

    @property
    def identical(self) -> bool:
        return self.specla.tokens == self.plain.tokens


def encode(models: Models, prompt: str) -> torch.LongTensor:
    ids = models.tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenization")
    return ids.to(models.target.device)


def compare(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, specla_streamer=None,
            plain_streamer=None) -> Comparison:
    """A few tokens of each first, so that one-time costs (allocator, lazy init, graph capture) land in neither
    timing; then SpecLA, then plain decoding of the same prompt."""
    warm_up = replace(settings, max_new_tokens=WARM_UP_TOKENS)
    run_specla(models, input_ids, warm_up)
    run_plain(models, input_ids, warm_up)
    return Comparison(run_specla(models, input_ids, settings, specla_streamer),
                      run_plain(models, input_ids, settings, plain_streamer))


def run_plain(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer=None) -> Run:
    return _timed(models, input_ids, settings, streamer)


def run_specla(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer=None) -> Run:
    # build the drafter wrapper here rather than in generate() so that its last verified tree stays reachable
    drafter = make_drafter(models.target, models.drafter, settings.draft_options())
    run = _timed(models, input_ids, settings, streamer, assistant_model=drafter,
                 autoregressive_fallback=settings.fallback)
    run.stats, run.tree = models.target.specla_stats, drafter.last_tree
    return run


def _timed(models: Models, input_ids: torch.LongTensor, settings: DecodeSettings, streamer, **extra) -> Run:
    tok = models.tokenizer
    kwargs = settings.generate_kwargs()
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    start = time.perf_counter()
    out = models.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                                 **kwargs, **extra)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    return Run(out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start)
