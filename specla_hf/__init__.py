"""SpecLA-HF: lossless speculative decoding for Gated DeltaNet models in Hugging Face Transformers.

``import specla_hf`` gives fla's Triton-only modules a torch path on CPU and lets
``GatedDeltaNetForCausalLM.generate(..., assistant_model=drafter)`` run speculative decoding.
"""
from specla_hf import backend as _backend

_backend.install()

__version__ = "0.1.0"
