"""Public entry points of the SpecLA kernels: the Triton kernel on CUDA tensors (and on any tensors when Triton was
imported with ``TRITON_INTERPRET=1``, i.e. runs its interpreter), the pure-PyTorch reference otherwise.

Every entry point is static-shape friendly: no host synchronisation, no ``.item()``, no Python loop over data, so the
CUDA paths can be captured in CUDA graphs. The in-place commits keep that contract on the reference path by copying
the reference result into the given tensors.
"""
from __future__ import annotations

import torch

from specla_kernels import reference
from specla_kernels import commit as _commit
from specla_kernels import draft_expand as _draft_expand
from specla_kernels import gate as _gate
from specla_kernels import gated_norm as _gated_norm
from specla_kernels import gemv as _gemv
from specla_kernels import topk as _topk
from specla_kernels import tree_conv as _tree_conv
from specla_kernels import tree_delta as _tree_delta

MAX_NODES = 128  # nodes of one verified tree chunk held in a kernel's registers


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on ``x``'s device."""
    return x.is_cuda or _tree_delta.INTERPRETED


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a token tree from the committed state: ``o``, ``k_hat``, ``u`` (see ``tree_gated_delta_rule_ref``).

    The Triton kernel verifies one chunk of up to 128 nodes and takes no ``prefix``; other calls run the reference.
    """
    if use_triton(q) and prefix is None and k.shape[1] <= MAX_NODES:
        return _tree_delta.tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale, prefix)
    return reference.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, initial_state, scale, prefix)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay ``g`` and write strength ``beta`` of each token, fp32 (see ``gdn_gate_beta_ref``)."""
    if use_triton(a):
        return _gate.gdn_gate_beta(a, b, A_log, dt_bias, allow_neg_eigval)
    return reference.gdn_gate_beta_ref(a, b, A_log, dt_bias, allow_neg_eigval)


def tree_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    parents: torch.Tensor,
    activation: str | None = 'silu',
    x_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree-aware depthwise short convolution (see ``tree_conv_ref``); ``x_out`` receives a contiguous copy of ``x``."""
    if use_triton(x):
        return _tree_conv.tree_conv(x, weight, bias, window, parents, activation, x_out)
    return reference.tree_conv_ref(x, weight, bias, window, parents, activation, x_out)


def commit_state_(
    state: torch.Tensor,
    k_hat: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    accepted: torch.Tensor,
) -> torch.Tensor:
    """Apply the accepted path's factors to ``state`` in place (see ``commit_state_ref``); returns ``state``.

    The Triton kernel handles up to 128 verified nodes (one tree chunk); more run the reference.
    """
    if use_triton(state) and k_hat.shape[1] <= MAX_NODES:
        return _commit.commit_state_(state, k_hat, u, g, parents, accepted)
    return state.copy_(reference.commit_state_ref(state, k_hat, u, g, parents, accepted))


def commit_window_(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """Move the conv window along the accepted path in place (see ``commit_window_ref``); returns ``window``."""
    if use_triton(window):
        return _commit.commit_window_(x, window, parents, accepted)
    return window.copy_(reference.commit_window_ref(x, window, parents, accepted))


def commit_states_(states: list[torch.Tensor], k_hats: list[torch.Tensor], us: list[torch.Tensor],
                   gs: list[torch.Tensor], parents: torch.Tensor, accepted: torch.Tensor) -> None:
    """``commit_state_`` of every layer of a model (one tree, one accepted node); two launches on the Triton path."""
    if use_triton(states[0]) and k_hats[0].shape[1] <= MAX_NODES:
        contiguous = lambda ts: [t.contiguous() for t in ts]          # noqa: E731  (no-op for the cache's factors)
        _commit.commit_states_(states, contiguous(k_hats), contiguous(us), contiguous(gs), parents, accepted)
        return
    for args in zip(states, k_hats, us, gs):
        commit_state_(*args, parents, accepted)


def commit_windows_(xs: list[torch.Tensor], windows: list[torch.Tensor], parents: torch.Tensor,
                    accepted: torch.Tensor) -> None:
    """``commit_window_`` of every layer of a model; one launch on the Triton path."""
    if use_triton(windows[0]):
        _commit.commit_windows_([x.contiguous() for x in xs], windows, parents, accepted)
        return
    for x, window in zip(xs, windows):
        commit_window_(x, window, parents, accepted)


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``x [R, V]``, descending, ties to the lower index (see
    ``row_topk_ref``); the Triton path takes ``k <= 16``."""
    if use_triton(x) and k <= min(16, x.shape[-1]):
        return _topk.row_topk(x, k)
    return reference.row_topk_ref(x, k)


def expand_frontier(top_logp: torch.Tensor, top_token: torch.Tensor, frontier_score: torch.Tensor,
                    frontier_cand: torch.Tensor, cand: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    next_score: torch.Tensor, next_cand: torch.Tensor, n: int, cand_base: int) -> None:
    """One depth of the drafter's tree expansion after its top-k, in place (see ``expand_frontier_ref``)."""
    fn = _draft_expand.expand_frontier if use_triton(top_logp) else reference.expand_frontier_ref
    fn(top_logp, top_token, frontier_score, frontier_cand, cand, tokens, parents, next_score, next_cand, n, cand_base)


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, activation: str = "swish") -> torch.Tensor:
    """The GatedDeltaNet output norm on ``[B, T, H, D]`` (see ``rms_norm_gated_ref``); the kernel reads a strided gate
    (a column slice of the fused projection) in place."""
    if use_triton(x):
        return _gated_norm.rms_norm_gated(x, g, weight, bias, eps, activation)
    return reference.rms_norm_gated_ref(x, g, weight, bias, eps, activation)


def gemv(weight: torch.Tensor, x: torch.Tensor, **fused) -> torch.Tensor:
    """``weight @ f(x)`` for one token with the decode step's norm / SwiGLU / residual / short-conv ops fused around
    it (see ``gemv_ref`` for the keywords)."""
    if use_triton(x):
        return _gemv.gemv(weight, x, **fused)
    return reference.gemv_ref(weight, x, **fused)
