"""A CPU path for the kernel-bound functions of transformers' GDN hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

transformers binds each modeling module's ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_fn`` and ``causal_conv1d_update`` at import time (``use_kernel_func_from_hub_with_fallback``): with
flash-linear-attention (or causal-conv1d) installed the module-level name calls that package's Triton / CUDA kernel
for every tensor, also on a CPU, where Triton finds no driver ("0 active drivers"), so even the stock model's forward
fails there. The torch function stays reachable under the wrapper (``functools.wraps``: ``inspect.unwrap``), in
transformers 5.17 as in 5.23. ``install(module)`` (run when the modeling module is imported, after ``import specla_hf``) rebinds each such name to a
dispatcher:
CPU tensors take the torch function, any other device the bound kernel. The GDN modules look these names up in their
module's globals on every call, so the stock ``forward`` / ``generate`` and ``specla_hf.models.qwen3_5`` both see it.
"""
from __future__ import annotations

import functools
import inspect

KERNEL_BOUND = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")


def on_cpu_use_torch(bound, torch_function):
    """``bound`` (a kernel-bound function) with CPU tensors sent to ``torch_function``, keyword arguments it does not
    take dropped, as transformers' wrapper drops them."""
    params = inspect.signature(torch_function).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(bound)
    def dispatch(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if first.device.type != "cpu":
            return bound(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None:
            # the torch path would ignore the boundaries and mix the packed sequences' states
            raise ValueError(f"{torch_function.__name__} on CPU cannot keep packed sequences (cu_seqlens) apart; "
                             "unpack them into a padded batch, or run on CUDA")
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_function(*args, **kwargs)

    dispatch.specla_cpu_dispatch = True
    return dispatch


def install(module) -> None:
    """Rebind the kernel-bound functions of a hybrid modeling ``module`` (idempotent)."""
    for fn_name in KERNEL_BOUND:
        bound = getattr(module, fn_name, None)
        if bound is None or getattr(bound, "specla_cpu_dispatch", False):
            continue
        torch_function = inspect.unwrap(bound)
        if torch_function is not bound:          # a plain function: no kernel binding to route around
            setattr(module, fn_name, on_cpu_use_torch(bound, torch_function))
