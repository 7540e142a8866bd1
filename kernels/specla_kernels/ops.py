"""Public entry points of the SpecLA ops. Until the Triton kernels land these run the torch reference everywhere;
the kernels replace them on CUDA (and under TRITON_INTERPRET=1) with the same signatures."""
from __future__ import annotations

import torch

from specla_kernels.reference import (commit_state_ref, commit_window_ref, tree_conv_ref,
                                      tree_gated_delta_rule_ref)


def tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale=None, prefix=None):
    return tree_gated_delta_rule_ref(q, k, v, g, beta, parents, initial_state, scale=scale, prefix=prefix)


def tree_conv(x, weight, bias, window, parents, activation='silu'):
    return tree_conv_ref(x, weight, bias, window, parents, activation)


def commit_state_(state: torch.Tensor, k_hat, u, g, parents, accepted) -> torch.Tensor:
    return state.copy_(commit_state_ref(state, k_hat, u, g, parents, accepted))


def commit_window_(x, window: torch.Tensor, parents, accepted) -> torch.Tensor:
    return window.copy_(commit_window_ref(x, window, parents, accepted))
