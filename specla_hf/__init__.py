"""SpecLA-HF: lossless speculative decoding for Gated DeltaNet models in Hugging Face Transformers.

After ``import specla_hf``, ``model.generate(..., assistant_model=drafter)`` runs SpecLA's speculative decoding for
flash-linear-attention's ``GatedDeltaNetForCausalLM`` and transformers' GDN hybrids (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next), and their Triton-only ops take a torch path on a CPU. Nothing heavy is imported here: each model library
is patched when the user's code imports it, and the names below load on first use.
"""
from __future__ import annotations

import importlib
import sys

from specla_hf import _hooks
from specla_hf.models import ADAPTERS

__version__ = "0.1.0"

# public name -> the module defining it
_PUBLIC = {
    "SpecLACache": "specla_hf.cache",
    "SpecLAStats": "specla_hf.loop.stats",
    "speculative_decode": "specla_hf.loop.decode",
    "DraftOptions": "specla_hf.drafters.options",
    "DraftTree": "specla_hf.drafters.base",
    "DynamicTreeDrafter": "specla_hf.drafters.base",
    "GDNDrafter": "specla_hf.drafters.small_model",
    "SpecLADrafter": "specla_hf.drafters.eagle",
    "SpecLADrafterConfig": "specla_hf.drafters.eagle",
    "EagleDrafter": "specla_hf.drafters.eagle",
    "SpecLADartDrafter": "specla_hf.drafters.dart",
    "SpecLADartConfig": "specla_hf.drafters.dart",
    "DartDrafter": "specla_hf.drafters.dart",
    "MTPDrafter": "specla_hf.drafters.mtp",
    "MTPTreeDrafter": "specla_hf.drafters.mtp",
    "frequent_tokens": "specla_hf.drafters.mtp",
    "GDNRunner": "specla_hf.models.fla_gdn",
    "adapter_for": "specla_hf.models",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specla_hf' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def _install_fla(module) -> None:
    from specla_hf import generation
    from specla_hf.models import fla_backend

    fla_backend.install()
    generation.install()
    _register_drafters(module)


_registered = []
# what registering the drafters imports, directly or through fla: while one of these is halfway through its own import
# (fla imports the Auto classes while it loads; transformers.modeling_layers, imported first, imports them too),
# registering would re-enter it and miss names it has not defined yet, so it waits for that import to end
_REGISTRATION_IMPORTS = ("fla", "transformers.modeling_utils", "transformers.modeling_layers",
                         "specla_hf.models.fla_gdn", "specla_hf.drafters.eagle", "specla_hf.drafters.dart")


def _register_drafters(done=None) -> None:
    """Let transformers' Auto classes load saved SpecLA drafters, once the Auto classes are imported and none of
    ``_REGISTRATION_IMPORTS`` is mid-import (``done``: the module whose import just ended, its hooks running). Tried
    again as each of those imports ends. Importing the drafters may import fla, whose hook calls back here: the outer
    call registers."""
    if _registered or "transformers.models.auto.modeling_auto" not in sys.modules:
        return
    for name in _REGISTRATION_IMPORTS:
        module = sys.modules.get(name)
        if module is not None and module is not done and getattr(module.__spec__, "_initializing", False):
            return
    _registered.append(True)
    from specla_hf.drafters import dart, eagle

    eagle.register_auto_classes()
    dart.register_auto_classes()


def _install_hybrid(module) -> None:
    from specla_hf.models import qwen3_5

    qwen3_5.install(module)


_hooks.after_import("fla", _install_fla)
for _module in ("transformers.models.auto.modeling_auto", *_REGISTRATION_IMPORTS[1:]):
    _hooks.after_import(_module, _register_drafters)
for _module in sorted({m for (m, _), adapter in ADAPTERS.items() if adapter.endswith(":HybridRunner")}):
    _hooks.after_import(_module, _install_hybrid)
