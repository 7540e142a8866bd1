"""A pure-PyTorch path for every Triton op a fla Gated DeltaNet model calls, chosen per call by device.

fla's norms, gated norm, short convolution, SwiGLU MLP, fused cross-entropy and gated-delta-rule ops are Triton-only:
on a machine without a GPU they fail ("0 active drivers"). ``install()`` (run on ``import specla_hf``) wraps those
entry points so that CPU tensors take the torch path below and CUDA tensors keep fla's kernels. The torch path is the
same math as ``specla_kernels.reference`` and is what our tests compare fla against (under ``TRITON_INTERPRET=1``).

Two switches, for tests and training:
- ``use_backend(modules="fla")`` sends CPU tensors to fla's kernels too (run them under the Triton interpreter);
- ``use_backend(delta_rule="torch")`` sends even CUDA tensors' gated delta rule to torch (fla's chunk backward is
  refused on Hopper with Triton 3.6, so training on the H200 uses our autograd-friendly chunk form).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fla.modules.activations import swiglu
from fla.modules.norm.layernorm import rms_norm as fla_rms_norm
from specla_kernels.reference import (conv_sequence_ref, gdn_gate, recurrent_gated_delta_rule_ref,
                                      rms_norm_gated_ref as rms_norm_gated, rms_norm_ref as rms_norm)

_MODE = {"modules": "auto", "delta_rule": "auto"}
_INSTALLED = False


@contextlib.contextmanager
def use_backend(modules: str | None = None, delta_rule: str | None = None) -> Iterator[None]:
    """Temporarily choose ``"auto"`` (torch on CPU, fla on CUDA), ``"torch"`` or ``"fla"`` for modules / delta rule."""
    old = dict(_MODE)
    for key, value in (("modules", modules), ("delta_rule", delta_rule)):
        if value is not None:
            if value not in ("auto", "torch", "fla"):
                raise ValueError(f"backend {key}={value!r}: expected 'auto', 'torch' or 'fla'")
            _MODE[key] = value
    try:
        yield
    finally:
        _MODE.update(old)


def _torch_wanted(kind: str, x: torch.Tensor) -> bool:
    mode = _MODE[kind]
    return mode == "torch" or (mode == "auto" and x.device.type != "cuda")


# --------------------------------------------------------------------------------------------------------------
# torch implementations, with fla's signatures
# --------------------------------------------------------------------------------------------------------------
def gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                     cu_seqlens=None, **_):
    """Torch gated delta rule with the keyword interface of fla's chunk / fused_recurrent entry points."""
    if cu_seqlens is not None:
        raise NotImplementedError("the torch gated-delta-rule path does not take packed (cu_seqlens) inputs")
    if not (use_qk_l2norm_in_kernel and state_v_first):
        raise NotImplementedError("the torch gated-delta-rule path implements the GatedDeltaNet layer's call only "
                                  "(in-kernel q/k l2norm, V-first state)")
    g = gdn_gate(g, A_log, dt_bias) if use_gate_in_kernel else g.float()
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta.float()
    if allow_neg_eigval:
        beta = beta * 2
    if torch.is_grad_enabled() and q.shape[1] > 1:
        from specla_kernels.chunk import chunk_gated_delta_rule_torch
        o, state = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=initial_state, scale=scale)
    else:
        o, state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=initial_state, scale=scale)
    return o, (state if output_final_state else None)


# --------------------------------------------------------------------------------------------------------------
# wrapping fla's entry points
# --------------------------------------------------------------------------------------------------------------
def _dispatch_method(cls, torch_forward):
    fla_forward = cls.forward

    @functools.wraps(fla_forward)
    def forward(self, x, *args, **kwargs):
        if _torch_wanted("modules", x):
            return torch_forward(self, x, *args, **kwargs)
        return fla_forward(self, x, *args, **kwargs)

    forward.fla_forward = fla_forward
    cls.forward = forward


def _dispatch_function(module, name: str, kind: str, torch_fn):
    fla_fn = getattr(module, name)

    @functools.wraps(fla_fn)
    def fn(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))  # fla calls these with q=/x= keywords
        return (torch_fn if _torch_wanted(kind, first) else fla_fn)(*args, **kwargs)

    fn.fla_fn = fla_fn
    setattr(module, name, fn)


def _causal_conv1d(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                   activation=None, cu_seqlens=None, **_):
    """fla's functional ``causal_conv1d`` (the layer's fused q/k/v conv when it runs without a cache)."""
    if cu_seqlens is not None:
        raise NotImplementedError("the torch short-convolution path does not take packed (cu_seqlens) inputs")
    y, window = conv_sequence_ref(x, weight, bias, initial_state, activation)
    if residual is not None:
        y = y + residual
    return y, (window if output_final_state else None)


def _drop_trivial_mask(fla_forward):
    """transformers passes an all-ones attention mask; fla turns any mask into packed (cu_seqlens) inputs, which the
    torch path does not take. An all-ones mask means no padding: drop it on the torch path."""

    @functools.wraps(fla_forward)
    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        if (attention_mask is not None and _torch_wanted("delta_rule", hidden_states)
                and bool((attention_mask == 1).all())):
            attention_mask = None
        return fla_forward(self, hidden_states, attention_mask, *args, **kwargs)

    return forward


def _rmsnorm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    return rms_norm(x, self.weight, self.bias, self.eps, residual=residual, prenorm=prenorm)


def _gated_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None or prenorm:
        raise NotImplementedError("torch FusedRMSNormGated path: residual/prenorm are not used by GatedDeltaNet")
    return rms_norm_gated(x, g, self.weight, self.bias, self.eps, self.activation)


def _conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None, **_):
    if cu_seqlens is not None:
        raise NotImplementedError("the torch short-convolution path does not take packed (cu_seqlens) inputs")
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    y, window = conv_sequence_ref(x, self.weight[:, 0], self.bias, cache, self.activation)
    if cache is not None and not torch.is_grad_enabled():
        cache.copy_(window)  # fla updates the cache in place on decode steps; keep that contract
        window = cache
    if residual is not None:
        y = y + residual
    return y, (window if output_final_state else None)


def rms_norm_scaled(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of ``x`` with the given scale (e.g. a zero-centred norm's fp32 ``1 + w``), or of ``x + residual``,
    returning the norm and the sum: fla's kernel, or the torch path where that is chosen."""
    prenorm = residual is not None
    if _torch_wanted("modules", x):
        return rms_norm(x, weight, None, eps, residual=residual, prenorm=prenorm)
    return fla_rms_norm(x, weight, None, residual=residual, eps=eps, prenorm=prenorm)


def swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: fla's one-kernel SwiGLU, or the torch path where that is chosen."""
    return F.silu(gate) * up if _torch_wanted("modules", gate) else swiglu(gate, up)


def gated_mlp_down(mlp, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A swish fla ``GatedMLP``'s activation and down projection from its gate and up projections (for callers that
    compute those themselves, e.g. as one fused GEMM): torch where the torch path is chosen, fla's SwiGLU otherwise."""
    if _torch_wanted("modules", gate):
        return mlp.down_proj(F.silu(gate) * up)
    if mlp.fuse_swiglu:
        return mlp.swiglu_linear(gate, up, mlp.down_proj.weight, mlp.down_proj.bias)
    return mlp.down_proj(swiglu(gate, up))


def _mlp_forward(self, x, **_):
    if self.hidden_act != "swish":
        raise NotImplementedError(f"torch GatedMLP path supports hidden_act='swish', not {self.hidden_act!r}")
    return gated_mlp_down(self, self.gate_proj(x), self.up_proj(x))


def _cross_entropy_forward(self, logits, target):
    return F.cross_entropy(logits.float(), target, ignore_index=self.ignore_index, reduction=self.reduction,
                           label_smoothing=getattr(self, "label_smoothing", 0.0))


def install() -> None:
    """Wrap fla's Triton entry points once; CUDA tensors still go to fla (see module docstring)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import fla.layers.gated_deltanet as gdn_layer
    from fla.layers import GatedDeltaNet
    from fla.modules import FusedCrossEntropyLoss, FusedRMSNormGated, GatedMLP, RMSNorm, ShortConvolution

    _dispatch_method(RMSNorm, _rmsnorm_forward)
    _dispatch_method(FusedRMSNormGated, _gated_norm_forward)
    _dispatch_method(ShortConvolution, _conv_forward)
    _dispatch_method(GatedMLP, _mlp_forward)
    _dispatch_method(FusedCrossEntropyLoss, _cross_entropy_forward)
    GatedDeltaNet.forward = _drop_trivial_mask(GatedDeltaNet.forward)
    _dispatch_function(gdn_layer, "causal_conv1d", "modules", _causal_conv1d)
    _dispatch_function(gdn_layer, "chunk_gated_delta_rule", "delta_rule", gated_delta_rule)
    _dispatch_function(gdn_layer, "fused_recurrent_gated_delta_rule", "delta_rule", gated_delta_rule)
    _INSTALLED = True
