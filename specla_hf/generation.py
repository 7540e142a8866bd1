"""``model.generate(..., assistant_model=drafter)`` runs SpecLA speculative decoding.

transformers refuses assisted generation for every stateful model. ``patch_generate`` gives a supported model class
(fla's ``GatedDeltaNetForCausalLM``; transformers' Qwen3.5, Qwen3.5-MoE and Qwen3-Next) a ``generate`` that, when an
``assistant_model`` is passed, hands transformers our decoding loop as a ``custom_generate`` callable: transformers
still prepares the ``GenerationConfig``, the logits processors (temperature, top-k/p, repetition penalty, ...) and
the stopping criteria (max length, EOS, stop strings), exactly as for plain decoding, and our loop applies them. The
assistant goes to our loop under its own keyword, so transformers sees no assisted generation and does not refuse
stateful models. Without an assistant the stock ``generate`` runs, unless ``specla=True`` asks for SpecLA's
autoregressive loop (CUDA graphs, the fused one-token step) with the same options.

Extra ``generate`` keywords: ``tree`` (bool), ``tree_budget``, ``tree_topk``, ``draft_depth``,
``confidence_threshold``, ``adaptive_drafting``, ``sampled_drafts`` (default on: under sampling the drafter draws
its children and the acceptance is recursive rejection sampling, ``loop.acceptance``), ``draft_temperature_ratio``
(the drafter draws at the target's temperature times this; default: the drafter's calibrated ratio, its config's
``draft_temperature_ratio``, else 1), ``autoregressive_fallback``
(default on: decode autoregressively once speculation costs more per token than an autoregressive step on this
device), ``specla``. After the call
``model.specla_stats`` holds a ``SpecLAStats`` (its ``mode`` says whether speculation ran to the end, and why not);
with ``return_dict_in_generate=True`` the output carries it as ``specla_stats`` too.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.generation import GenerationMixin, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from specla_hf.drafters.base import DynamicTreeDrafter
from specla_hf.drafters.options import CHAIN_DEFAULTS, TREE_DEFAULTS, DraftOptions
from specla_hf.drafters.small_model import GDNDrafter
from specla_hf.loop.decode import speculative_decode
from specla_hf.loop.stats import SpecLAStats
from specla_hf.models import adapter_class, adapter_for

AUTOREGRESSIVE_FALLBACK = True      # generate()'s default for ``autoregressive_fallback``


# generate() inputs other than token ids, by the kind of input they carry (transformers 5.23 encodes images and
# videos before the decoding method runs and hands them on as mm_encoder_outputs, keyed by kind)
NON_TEXT_INPUTS = {"pixel_values": "image", "image_grid_thw": "image", "pixel_values_videos": "video",
                   "video_grid_thw": "video", "inputs_embeds": "inputs_embeds"}


@dataclass
class SpecLAGenerateOutput(GenerateDecoderOnlyOutput):
    specla_stats: SpecLAStats | None = None


def draft_options(tree: bool | None = None, tree_budget: int | None = None, tree_topk: int | None = None,
                  draft_depth: int | None = None, confidence_threshold: float | None = None,
                  adaptive_drafting: bool | None = None, sampled_drafts: bool | None = None,
                  draft_temperature_ratio: float | None = None) -> DraftOptions:
    base = TREE_DEFAULTS if tree else CHAIN_DEFAULTS
    depth = draft_depth if draft_depth is not None else base.depth
    topk = (tree_topk if tree_topk is not None else base.topk) if tree else 1
    budget = (tree_budget if tree_budget is not None else base.budget) if tree else depth
    if not tree and (tree_budget is not None or tree_topk is not None):
        raise ValueError("tree_budget / tree_topk shape a draft tree: pass tree=True with them")
    return DraftOptions(depth=depth, topk=topk, budget=budget,
                        threshold=base.threshold if confidence_threshold is None else confidence_threshold,
                        adaptive=base.adaptive if adaptive_drafting is None else adaptive_drafting,
                        sampled=base.sampled if sampled_drafts is None else sampled_drafts,
                        temperature_ratio=draft_temperature_ratio)


def make_drafter(target, assistant, options: DraftOptions) -> DynamicTreeDrafter:
    """Wrap what the user passed as ``assistant_model`` into a tree drafter, checking it fits the target."""
    if isinstance(assistant, DynamicTreeDrafter):
        return assistant
    if not isinstance(assistant, torch.nn.Module):
        raise TypeError(f"assistant_model must be a drafter model or a SpecLA DynamicTreeDrafter, got "
                        f"{type(assistant).__name__}")
    # a vision-language model keeps its vocabulary in its text config
    t_vocab, d_vocab = (m.config.get_text_config().vocab_size for m in (target, assistant))
    # a target-aligned drafter (specla_hf.drafters.eagle) reads the target's hidden features: it checks the fit itself
    aligned = getattr(assistant, "is_specla_drafter", False)
    if aligned:
        assistant.check_target(target)
    elif t_vocab != d_vocab:
        raise ValueError(f"drafter vocabulary ({d_vocab}) differs from the target's ({t_vocab}); SpecLA needs a "
                         "drafter trained with the target's tokenizer")
    t_param, d_param = next(target.parameters()), next(assistant.parameters())
    if d_param.device != t_param.device:
        raise ValueError(f"drafter is on {d_param.device} but the target is on {t_param.device}; move it with "
                         f"assistant_model.to({str(t_param.device)!r})")
    if d_param.dtype != t_param.dtype:
        raise ValueError(f"drafter dtype {d_param.dtype} differs from the target's {t_param.dtype}; cast it with "
                         f"assistant_model.to({t_param.dtype})")
    if aligned:
        return assistant.candidate_generator(target, options)
    if adapter_class(assistant) is not None:
        return GDNDrafter(assistant, options)
    raise TypeError(f"unsupported assistant_model {type(assistant).__name__}: pass a draft model SpecLA can drive "
                    "(a GatedDeltaNetForCausalLM, or a model of the target's family) or a specla_hf SpecLADrafter")


def _check_inputs(model, input_ids: torch.Tensor) -> None:
    """Prompt ids a SpecLA loop can start from: a non-empty integer ``[1, T]`` tensor of ids in the vocabulary (an id
    out of range would end in a device-side assert on CUDA, which takes the whole CUDA context down)."""
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; tokenize the prompt "
                        "(tokenizer(text, return_tensors='pt').input_ids)")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: SpecLA needs at least one prompt token "
                         "(shape [1, T], T >= 1); start from the BOS token if there is no prompt")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the model's vocabulary of "
                         f"{vocab}; was the prompt tokenized with this model's tokenizer?")


def _check_generation(model, input_ids, generation_config, model_kwargs) -> None:
    _check_inputs(model, input_ids)
    cfg = generation_config
    if cfg.num_beams != 1:
        raise ValueError(f"num_beams={cfg.num_beams}: beam search cannot be combined with assistant_model")
    if cfg.num_return_sequences != 1:
        raise ValueError(f"num_return_sequences={cfg.num_return_sequences}: assisted generation returns one sequence")
    if input_ids.shape[0] != 1:
        raise ValueError(f"SpecLA speculative decoding runs one sequence at a time (batch size 1); got batch size "
                         f"{input_ids.shape[0]}. Loop over the prompts, or drop assistant_model for batched decoding.")
    if cfg.output_attentions or cfg.output_hidden_states:
        raise ValueError("output_attentions / output_hidden_states are not available with SpecLA decoding (the "
                         "target runs tree passes); use output_scores / output_logits")
    if cfg.use_cache is False:
        raise ValueError("use_cache=False: speculative decoding needs the recurrent cache")
    if getattr(cfg, "prompt_lookup_num_tokens", None) or getattr(cfg, "assistant_early_exit", None):
        raise ValueError("prompt_lookup_num_tokens / assistant_early_exit pick other candidate generators; pass only "
                         "assistant_model to use SpecLA")
    other = {kind for key, kind in NON_TEXT_INPUTS.items() if model_kwargs.get(key) is not None}
    other |= {kind for kind, encoded in (model_kwargs.get("mm_encoder_outputs") or {}).items() if encoded is not None}
    if other:
        raise ValueError(f"SpecLA decodes a text prompt given as token ids, got {' and '.join(sorted(other))} "
                         "inputs: pass input_ids only, or drop assistant_model to generate from images, videos or "
                         "embeddings")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("attention_mask has padding; SpecLA decodes one unpadded sequence")
    if model_kwargs.get("past_key_values") is not None and model_kwargs["past_key_values"].get_seq_length() > 0:
        raise ValueError("a pre-filled past_key_values cannot be continued by SpecLA; pass the full prompt")


def _specla_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                     specla_assistant=None, specla_streamer=None, tree: bool | None = None,
                     tree_budget: int | None = None, tree_topk: int | None = None, draft_depth: int | None = None,
                     confidence_threshold: float | None = None, adaptive_drafting: bool | None = None,
                     sampled_drafts: bool | None = None, draft_temperature_ratio: float | None = None,
                     autoregressive_fallback: bool | None = None, **model_kwargs):
    """transformers ``custom_generate`` callable: the SpecLA loop under transformers' own generation setup (without
    an assistant: its autoregressive loop)."""
    _check_generation(model, input_ids, generation_config, model_kwargs)
    target = adapter_for(model)
    drafter = None
    if specla_assistant is not None:
        options = draft_options(tree, tree_budget, tree_topk, draft_depth, confidence_threshold, adaptive_drafting,
                                sampled_drafts, draft_temperature_ratio)
        drafter = make_drafter(model, specla_assistant, options)
    fallback = AUTOREGRESSIVE_FALLBACK if autoregressive_fallback is None else autoregressive_fallback
    if specla_streamer is not None:
        specla_streamer.put(input_ids.cpu())
    cfg = generation_config
    keep = bool(cfg.return_dict_in_generate and (cfg.output_scores or cfg.output_logits))
    sequences, stats, scores, logits = speculative_decode(
        target, drafter, input_ids, logits_processor, stopping_criteria, do_sample=bool(cfg.do_sample),
        max_length=cfg.max_length, streamer=specla_streamer, keep_scores=keep, fallback=fallback)
    if specla_streamer is not None:
        specla_streamer.end()
    model.specla_stats = stats
    if not cfg.return_dict_in_generate:
        return sequences
    past_key_values = (_plain_decoding_cache(target, sequences, stats.committed_positions)
                       if hasattr(target, "transformers_cache") else None)
    return SpecLAGenerateOutput(sequences=sequences, scores=tuple(scores) if cfg.output_scores else None,
                                logits=tuple(logits) if cfg.output_logits else None,
                                past_key_values=past_key_values, specla_stats=stats)


def _plain_decoding_cache(target, sequences: torch.LongTensor, committed: int):
    """The transformers cache plain decoding leaves after ``sequences``: every token but the last consumed. Built from
    the loop's committed state (``target.last_cache``, ``committed`` positions) when it holds exactly those; when a
    stopping criterion cut an accepted block short, the state has run past the cut and cannot be rolled back, so the
    kept tokens are consumed into a fresh cache instead (one prefill pass)."""
    cache = target.last_cache
    if committed != sequences.shape[1] - 1:
        cache = target.new_cache(1, sequences.shape[1])
        target.forward(sequences[:, :-1].to(target.device), cache, logits_positions=slice(0, 0))
    return target.transformers_cache(cache)


def patch_generate(model_class) -> None:
    """Give ``model_class`` a ``generate`` that runs SpecLA when an ``assistant_model`` is passed or ``specla=True``
    (module docstring); otherwise the class's own ``generate`` runs. Idempotent."""
    stock = model_class.generate
    if getattr(stock, "specla", False):
        return

    def generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                 prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None, streamer=None, specla=False,
                 **kwargs):
        if assistant_model is None and not specla:
            return stock(self, inputs, generation_config, logits_processor, stopping_criteria,
                         prefix_allowed_tokens_fn, synced_gpus, streamer=streamer, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("custom_generate cannot be combined with SpecLA decoding (assistant_model / specla)")
        stopping_criteria = _with_stop_strings(self, generation_config, stopping_criteria, kwargs)
        generation_config = kwargs.pop("generation_config", generation_config)
        return GenerationMixin.generate(
            self, inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
            synced_gpus, custom_generate=_specla_decoding, specla_assistant=assistant_model,
            specla_streamer=streamer, **kwargs)

    generate.specla = True
    generate.__doc__ = stock.__doc__
    model_class.generate = generate


def _with_stop_strings(model, generation_config, stopping_criteria, kwargs: dict):
    """``stopping_criteria`` plus the stop-string criterion plain ``generate`` would build. transformers keeps only a
    ``custom_generate`` callable's own keywords for its call and drops ``tokenizer`` on the way, then fails to build
    the criterion: it is built here, and ``stop_strings`` / ``tokenizer`` are taken out of what transformers sees."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = generation_config if generation_config is not None else model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if not stop_strings:
        return stopping_criteria
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate()")
    if getattr(config, "stop_strings", None):
        config = copy.deepcopy(config)
        config.stop_strings = None
        kwargs["generation_config"] = config
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    return StoppingCriteriaList([*(stopping_criteria or []), criterion])


def install() -> None:
    """Patch fla's GatedDeltaNetForCausalLM (see ``patch_generate``)."""
    from fla.models import GatedDeltaNetForCausalLM

    patch_generate(GatedDeltaNetForCausalLM)
