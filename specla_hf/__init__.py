"""SpecLA-HF: lossless speculative decoding for Gated DeltaNet models in Hugging Face Transformers.

``import specla_hf`` gives fla's Triton-only modules (and the kernels transformers binds for its GDN hybrids) a torch
path on CPU and lets ``GatedDeltaNetForCausalLM.generate(..., assistant_model=drafter)`` run speculative decoding, as
it does for transformers' Qwen3.5, Qwen3.5-MoE and Qwen3-Next.
"""
import warnings

# fla warns on every CPU import that Triton has no GPU driver; on CPU SpecLA runs its torch path by design
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

from specla_hf.models import fla_backend as _backend  # noqa: E402
from specla_hf import generation as _generation  # noqa: E402
from specla_hf.models import qwen3_5 as _hybrids  # noqa: E402

_backend.install()
_generation.install()
_hybrids.install()

from specla_hf.cache import SpecLACache  # noqa: E402
from specla_hf.decoding import SpecLAStats, speculative_decode  # noqa: E402
from specla_hf.drafting import DraftOptions, DraftTree, DynamicTreeDrafter, GDNDrafter  # noqa: E402
from specla_hf.models.fla_gdn import GDNRunner  # noqa: E402
from specla_hf.eagle import EagleDrafter, SpecLADrafter, SpecLADrafterConfig  # noqa: E402,F401  (registers the Auto classes)
from specla_hf.dart import DartDrafter, SpecLADartConfig, SpecLADartDrafter  # noqa: E402,F401  (registers the Auto classes)

__all__ = ["SpecLACache", "SpecLAStats", "speculative_decode", "DraftOptions", "DraftTree", "DynamicTreeDrafter",
           "GDNDrafter", "GDNRunner"]

__version__ = "0.1.0"
