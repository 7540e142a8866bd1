"""Pieces of a fused one-token step shared by the model adapters (``GDNRunner._decode_step``,
``HybridRunner._decode_step``): weights fused so that one GEMV serves several projections, norm weights in the form
the GEMV's prologue takes, and the gated delta rule's recurrence for one token, in place.

A batch-1 decode step is bound by its kernel count: each GEMV (``specla_kernels.gemv``) applies the op that produced
its input and the op that consumes its output, so a GDN layer is four GEMVs and the recurrence.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton

from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel
from specla_hf.models import fla_backend as backend
from specla_kernels import ops, tuning
from specla_kernels.fused_gemm import MAX_ROWS as FUSED_GEMM_MAX_ROWS, MIN_GATED_HEAD


def fused_rows(owner: nn.Module, key: str, params: list[torch.Tensor], pad_to: int = 1) -> torch.Tensor:
    """``params`` concatenated along dim 0, cached on ``owner`` under ``key``, with each parameter re-pointed at its
    rows of the result: one GEMM (or conv) then serves them all, weights are not stored twice, and in-place updates of
    a parameter (optimizer steps, ``load_state_dict``'s ``copy_``) reach the fused tensor, so CUDA graphs reading it
    stay in step. Rebuilt when a parameter is no longer that view (``model.to(...)``,
    ``load_state_dict(assign=True)``, ``copy.deepcopy``): the cached tensor keeps its storage alive, so no other
    tensor can have a view's ``data_ptr``. ``pad_to`` rounds the row count up with zero rows: cuBLAS picks a slow
    GEMV for a batch-1 product whose output rows are not 16-byte aligned (q|k|v|g plus 2 x num_heads gate rows).
    Adapters fuse when they are built: a CUDA graph captured before a parameter is re-pointed keeps reading its old
    storage, which the re-pointing frees (an illegal address once the allocator hands it out again)."""
    cached = owner.__dict__.get(key)
    if cached is not None and cached[1] == tuple(p.data_ptr() for p in params):
        return cached[0]
    with torch.inference_mode(False):      # the parameters become views of it: they must stay usable by autograd
        rows = sum(p.shape[0] for p in params)
        pad = params[0].new_zeros(-rows % pad_to, *params[0].shape[1:])
        fused = torch.cat([p.detach() for p in params] + [pad])
    for p, view in zip(params, fused.split([p.shape[0] for p in params] + [pad.shape[0]])):
        p.data = view
    owner.__dict__[key] = (fused, tuple(p.data_ptr() for p in params))
    return fused


def product(weight: torch.Tensor, x: torch.Tensor, **fused) -> torch.Tensor:
    """A one-token step's product ``ops.gemv(weight, x, **fused)`` (1-D vectors), or the same through
    ``ops.fused_gemm`` on one row where ``KernelTuning.one_token_fused_gemm`` asks for it (an A/B: the GEMV streams at
    62% of the bandwidth in the step; ``fused_gemm``'s K loop is a pipelined ``tl.dot``)."""
    if not tuning.active().one_token_fused_gemm:
        return ops.gemv(weight, x, **fused)
    rows = {k: v.view(1, -1) if k in ("add", "add_out", "gate", "residual") and v is not None else v
            for k, v in fused.items()}
    return ops.fused_gemm(weight, x.view(1, -1), **rows).view(-1)


def fusable_gated_head(size: int) -> bool:
    """Whether the fused paths' gated-norm prologue takes value heads of ``size``: a power of two (the GEMV's register
    tile) of at least ``fused_gemm.MIN_GATED_HEAD`` (a tree pass's K step is one head)."""
    return not size & (size - 1) and size >= MIN_GATED_HEAD


def fused_tree_pass(batch: int, nodes: int) -> bool:
    """Whether a tree pass of ``batch`` x ``nodes`` goes through an adapter's ``fused_gemm`` products (batch 1, at most
    ``KernelTuning.fused_verify_max_nodes`` nodes and ``fused_gemm``'s rows); the adapter says whether its modules
    allow them."""
    return batch == 1 and nodes <= min(tuning.active().fused_verify_max_nodes, FUSED_GEMM_MAX_ROWS)


def unit_offset_weight(norm: nn.Module) -> torch.Tensor:
    """``1 + norm.weight`` in fp32, the scale of a zero-centred RMSNorm (Qwen3.5's: ``x * (1 + w)``, computed in
    fp32), as the GEMV's norm prologue takes it (a scale it multiplies in fp32). Cached on ``norm`` and rewritten in
    place when the weight changes (its version counter moves), so CUDA graphs reading it stay bound to one tensor:
    call it again for every norm before replaying graphs after a weight update (``HybridRunner.new_cache`` does)."""
    w = norm.weight
    cached = norm.__dict__.get("_specla_unit_offset")
    stamp = (w.data_ptr(), w._version)
    if cached is None or cached[0].shape != w.shape or cached[0].device != w.device:
        cached = (torch.empty(w.shape, dtype=torch.float32, device=w.device), None)
    if cached[1] != stamp:
        with torch.no_grad():
            cached[0].copy_(w.float() + 1.0)
        norm.__dict__["_specla_unit_offset"] = cached = (cached[0], stamp)
    return cached[0]


def recurrent_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    allow_neg_eigval: bool = False) -> torch.Tensor:
    """One token of batch 1 (1-D ``q, k [H*K]``, ``v [HV*V]``, raw gate inputs ``a, b [HV]``) through the gated
    delta rule with the gate ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (x2 with
    ``allow_neg_eigval``) and L2-normed q and k; ``state [1, HV, V, K]`` (V-first) is updated in place, the output
    ``o [HV*V]`` returned. Value head ``i`` reads key head ``i // (HV / H)``. With Triton: fla's fused-recurrent kernel
    (fla's and transformers' layers run it for one token, same math) launched with the state as its initial and its
    final state (each program reads its block before writing it back), which saves the stock call's state allocation
    and copy. Its pointers index token 0 of batch 0 only, so column slices of one projection row are valid inputs.
    (Kernels of our own that take part in the GEMVs' programmatic dependent launch did not beat it on an H200: a
    one-token step of 1.183 against 1.148 ms, and of 1.142 against 1.129-1.146 ms for a second design.)"""
    HV, V, K = state.shape[1:]
    H = q.numel() // K
    if not ops.use_triton(q):
        o, final = backend.gated_delta_rule(
            q.view(1, 1, H, K), k.view(1, 1, H, K), v.view(1, 1, HV, V), g=a.view(1, 1, HV), beta=b.view(1, 1, HV),
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval,
            state_v_first=True)
        state.copy_(final)
        return o.view(-1).to(v.dtype)
    o = v.new_empty(HV * V)
    BV = min(8, triton.next_power_of_2(V))      # as fla's wrapper launches it
    fused_recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(V, BV) * HV,)](
        q=q, k=k, v=v, g=a, gk=None, gv=None, beta=b, A_log=A_log, dt_bias=dt_bias, o=o, h0=state, ht=state,
        cu_seqlens=None, scale=K ** -0.5, T=1, H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=True,
        ALLOW_NEG_EIGVAL=allow_neg_eigval, STATE_V_FIRST=True, num_warps=1, num_stages=3)
    return o
