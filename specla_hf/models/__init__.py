"""Model adapters, one file per family: which adapter drives a given model (``adapter_for``).

Classes are matched by module and name along the model's MRO, so nothing here imports a model library before the
user's model does.
"""
from __future__ import annotations

import importlib

# (module of the model class, class name) -> "module:class" of its adapter
ADAPTERS: dict[tuple[str, str], str] = {
    ("fla.models.gated_deltanet.modeling_gated_deltanet", "GatedDeltaNetForCausalLM"):
        "specla_hf.models.fla_gdn:GDNRunner",
    **{cls: "specla_hf.models.qwen3_5:HybridRunner" for cls in (
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM"),
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForConditionalGeneration"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
        ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextForCausalLM"),
    )},
}


def adapter_class(model) -> type | None:
    """The adapter class for ``model``'s class or its nearest registered base, else ``None``."""
    for cls in type(model).__mro__:
        target = ADAPTERS.get((cls.__module__, cls.__name__))
        if target is not None:
            module, name = target.split(":")
            return getattr(importlib.import_module(module), name)
    return None


def adapter_for(model, role: str = "target"):
    """The adapter driving ``model`` as ``role`` ("target" or "drafter"), kept on the model across calls."""
    cls = adapter_class(model)
    if cls is None:
        supported = ", ".join(sorted(name for _, name in ADAPTERS))
        raise TypeError(f"SpecLA cannot drive a {type(model).__name__} as the {role}; supported models: "
                        f"{supported}")
    return cls.for_model(model, role)
