"""Public entry points of the SpecLA kernels: the Triton kernel on CUDA tensors (and on any tensors when Triton was
imported with ``TRITON_INTERPRET=1``, i.e. runs its interpreter), the pure-PyTorch reference otherwise.

Every entry point is static-shape friendly: no host synchronisation, no ``.item()``, no Python loop over data, so the
CUDA paths can be captured in CUDA graphs. The in-place commits keep that contract on the reference path by copying
the reference result into the given tensors.
"""
from __future__ import annotations

import torch

from specla_kernels import reference
from specla_kernels import accept as _accept
from specla_kernels import commit as _commit
from specla_kernels import draft_expand as _draft_expand
from specla_kernels import draw as _draw
from specla_kernels import fused_gemm as _fused_gemm
from specla_kernels import gate as _gate
from specla_kernels import gated_norm as _gated_norm
from specla_kernels import gemv as _gemv
from specla_kernels import input_norm as _input_norm
from specla_kernels import log_softmax as _log_softmax
from specla_kernels import masked_attention as _masked_attention
from specla_kernels import qk_norm_rope as _qk_norm_rope
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
    ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a token tree from the committed state: ``o``, ``k_hat``, ``u`` (see ``tree_gated_delta_rule_ref``).
    ``ancestors``: ``tree_ancestors(parents)`` when the caller has it (a model's layers verify one tree).

    The Triton kernel verifies one chunk of up to 128 nodes and takes no ``prefix``; other calls run the reference.
    """
    if use_triton(q) and prefix is None and k.shape[1] <= MAX_NODES:
        return _tree_delta.tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale, prefix,
                                                 ancestors=ancestors)
    return reference.tree_gated_delta_rule_ref(q, k, v, g, beta, parents, initial_state, scale, prefix)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                  allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay ``g`` and write strength ``beta`` of each token, fp32 (see ``gdn_gate_beta_ref``): for layers
    without a short conv (``tree_conv_gates`` computes them beside the conv)."""
    if use_triton(a):
        return _gate.gdn_gate_beta(a, b, A_log, dt_bias, allow_neg_eigval)
    return reference.gdn_gate_beta_ref(a, b, A_log, dt_bias, allow_neg_eigval)


def tree_conv_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    parents: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    allow_neg_eigval: bool = False,
    x_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer's tree-aware short convolution with SiLU (``tree_conv_ref``; ``x_out`` receives a contiguous copy
    of ``x``) and the log-decay ``g`` and write strength ``beta`` of its last ``T`` nodes (``gdn_gate_beta_ref``,
    ``a, b [B, T, heads]``, fp32): ``(y, g, beta)``, one launch on the GPU."""
    if use_triton(x):
        return _tree_conv.tree_conv_gates(x, weight, bias, window, parents, a, b, A_log, dt_bias, allow_neg_eigval,
                                          x_out=x_out)
    y = reference.tree_conv_ref(x, weight, bias, window, parents, 'silu', x_out)
    return (y, *reference.gdn_gate_beta_ref(a, b, A_log, dt_bias, allow_neg_eigval))


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``anc [B, N, N]`` (bool): node ``j`` is node ``i`` or one of its ancestors (see ``tree_ancestors`` in the
    reference); one launch on the Triton path for up to 128 nodes."""
    if use_triton(parents) and 1 <= parents.shape[1] <= MAX_NODES:
        return _tree_delta.tree_ancestors(parents)
    return reference.tree_ancestors(parents)


def commit_(parents: torch.Tensor, accepted: torch.Tensor, *,
            states: tuple[list[torch.Tensor], ...] | None = None,
            windows: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
            ancestors: torch.Tensor | None = None,
            path: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Keep the root-to-``accepted`` path in place, every layer at once: ``states = (states, k_hats, us, gs)`` (see
    ``commit_state_ref``) and ``windows = (xs, windows)`` (see ``commit_window_ref``); one launch on the Triton path
    for up to 128 verified nodes, the reference layer by layer otherwise. ``path = (nodes [B, P], length [B])``: that
    path, root first, when the caller has it (the Triton kernel reads it; without it, it is read off ``ancestors``,
    a few small kernels more)."""
    some = states[0][0] if states is not None else windows[1][0]
    if use_triton(some) and parents.shape[1] <= MAX_NODES:
        if path is None:
            path = _commit.root_path(tree_ancestors(parents) if ancestors is None else ancestors, accepted)
        contiguous = lambda ts: [t.contiguous() for t in ts]          # noqa: E731  (no-op for the cache's factors)
        _commit.commit_(*path, states=None if states is None else (states[0], *map(contiguous, states[1:])),
                        windows=None if windows is None else (contiguous(windows[0]), windows[1]))
        return
    for state, k_hat, u, g in zip(*states) if states is not None else ():
        state.copy_(reference.commit_state_ref(state, k_hat, u, g, parents, accepted))
    for x, window in zip(*windows) if windows is not None else ():
        window.copy_(reference.commit_window_ref(x, window, parents, accepted))


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, cap: int,
                argmax: torch.Tensor | None = None, hit: torch.Tensor | None = None) -> torch.Tensor:
    """The accepted path of a verified tree and what the step emits, ``[length, emitted (cap), path (cap), node]``,
    from each node's greedy ``argmax`` or sampled ``hit`` (see ``accept_walk_ref``)."""
    if use_triton(tokens) and tokens.shape[0] <= _accept.MAX_NODES:
        return _accept.accept_walk(tokens, parents, ancestors, cap, argmax=argmax, hit=hit)
    return reference.accept_walk_ref(tokens, parents, ancestors, cap, argmax=argmax, hit=hit)


def drawn_hits(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
               uniforms: torch.Tensor, siblings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling of drawn children, every parent at once: each node's hit and each parent's
    residual (rows without children undefined on the Triton path; see ``drawn_hits_ref``)."""
    if use_triton(probs) and probs.shape[0] <= _accept.MAX_NODES:
        return _accept.drawn_hits(tokens, parents, probs.float(), draft_probs.float(), uniforms, siblings)
    return reference.drawn_hits_ref(tokens, parents, probs, draft_probs, uniforms, siblings)


def commit_kv_(path: torch.Tensor, length: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               committed: list[torch.Tensor]) -> None:
    """Keep the path's entries (``path [B, P]``, root first, ``length [B]`` of its nodes) right after each attention
    layer's ``committed [B]`` positions in its ``keys``/``values`` buffers and advance the counts (see
    ``commit_kv_ref``): two launches for all the layers on the Triton path, the reference layer by layer otherwise."""
    if use_triton(keys[0]):
        _commit.commit_kv_(path, length, keys, values, committed)
    else:
        for buffer, count in zip(keys + values, committed + committed):
            buffer.copy_(reference.commit_kv_ref(buffer, count, path, length))
    torch._foreach_add_(committed, [length] * len(committed))


def commit_state_(state: torch.Tensor, k_hat: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                  parents: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Apply the accepted path's factors to ``state`` in place (see ``commit_state_ref``); returns ``state``."""
    commit_(parents, accepted, states=([state], [k_hat.float()], [u.float()], [g.float()]))
    return state


def commit_window_(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor,
                   accepted: torch.Tensor) -> torch.Tensor:
    """Move the conv window along the accepted path in place (see ``commit_window_ref``); returns ``window``."""
    commit_(parents, accepted, windows=([x], [window]))
    return window


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim of logits of any float dtype (see ``log_softmax_ref``): one launch on the
    Triton path, where aten casts 16-bit logits in a launch of its own first."""
    return _log_softmax.log_softmax(x) if use_triton(x) else reference.log_softmax_ref(x)


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``x [R, V]``, descending, ties to the lower index (see
    ``row_topk_ref``); the Triton path takes ``k <= 16``."""
    if use_triton(x) and k <= min(16, x.shape[-1]):
        return _topk.row_topk(x, k)
    return reference.row_topk_ref(x, k)


def _top_k_that_removes(top_k: int, x: torch.Tensor) -> int:
    """A top-k warper of at least a row's entries keeps every entry, as transformers' does: none (0)."""
    return 0 if top_k >= x.shape[-1] else top_k


def draw_children(x: torch.Tensor, k: int, temperature: float, top_k: int, logq_out: torch.Tensor,
                  top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` children of each row of draft scores ``x [F, V]`` drawn without replacement under the temperature, top-k
    and top-p warpers, the warped log-probs written into ``logq_out`` (see ``draw_children_ref``). Fresh randomness
    each call from torch's generator, also inside a CUDA graph: the Triton path reads a seed drawn on the device
    (Philox in the kernel), the reference path uniforms. Rows too long for one program take the warpers first, in
    slices under a top-k warper (``warped_probs_sliced``), else in torch, and the kernels' draws from their
    output."""
    top_k = _top_k_that_removes(top_k, x)
    if use_triton(x) and k <= _draw.MAX_DRAWS:
        if x.shape[-1] > _draw.ONE_PROGRAM_VOCAB and (top_k or top_p < 1.0):
            x = (_draw.warped_probs_sliced(x, temperature, top_k, top_p, log=True)
                 if _draw.sliced_warp_fits(x.shape[-1], top_k) else
                 reference.warped_scores_ref(x, temperature, top_k, top_p))
            temperature, top_k, top_p = 1.0, 0, 1.0
        seed = torch.randint(2 ** 31 - 1, (1,), dtype=torch.int64, device=x.device)
        return _draw.draw_children(x, k, temperature, top_k, logq_out, seed=seed, top_p=top_p)
    return reference.draw_children_ref(x, k, temperature, top_k, logq_out, torch.empty_like(x).uniform_(), top_p)


def warped_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0) -> torch.Tensor:
    """Rows of scores ``x [R, V]`` after the temperature, top-k and top-p warpers (``top_k`` 0, ``top_p`` 1: none)
    as fp32 probabilities (see ``warped_scores_ref``): on the Triton path the log-probs in one launch for rows of up
    to 16K entries, then their exponentials; longer rows under a top-k warper in slices (three launches); others as
    the reference's torch ops (a sort of each row under top-p)."""
    top_k = _top_k_that_removes(top_k, x)
    if not warps_in_kernels(x, top_k):
        return torch.softmax(reference.warped_scores_ref(x, temperature, top_k, top_p), -1)
    if x.shape[-1] <= _draw.ONE_PROGRAM_VOCAB:
        return _draw.warped_log_probs(x, temperature, top_k, torch.empty(x.shape, dtype=torch.float32,
                                                                          device=x.device), top_p).exp_()
    return _draw.warped_probs_sliced(x, temperature, top_k, top_p)


def warps_in_kernels(x: torch.Tensor, top_k: int) -> bool:
    """Whether ``warped_probs`` warps rows like ``x`` under ``top_k`` in its kernels, not the reference's torch ops."""
    top_k = _top_k_that_removes(top_k, x)
    return use_triton(x) and (x.shape[-1] <= _draw.ONE_PROGRAM_VOCAB or _draw.sliced_warp_fits(x.shape[-1], top_k))


def expand_frontier(top_logp: torch.Tensor, top_rank: torch.Tensor, top_token: torch.Tensor,
                    frontier_score: torch.Tensor, frontier_cand: torch.Tensor, cand: torch.Tensor,
                    tokens: torch.Tensor, parents: torch.Tensor, next_score: torch.Tensor, next_cand: torch.Tensor,
                    n: int, cand_base: int) -> None:
    """One depth of the drafter's tree expansion after its top-k, in place (see ``expand_frontier_ref``)."""
    fn = _draft_expand.expand_frontier if use_triton(top_logp) else reference.expand_frontier_ref
    fn(top_logp, top_rank, top_token, frontier_score, frontier_cand, cand, tokens, parents, next_score, next_cand, n,
       cand_base)


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, activation: str = "swish") -> torch.Tensor:
    """The GatedDeltaNet output norm on ``[B, T, H, D]`` (see ``rms_norm_gated_ref``); the kernel reads a strided gate
    (a column slice of the fused projection) in place."""
    if use_triton(x):
        return _gated_norm.rms_norm_gated(x, g, weight, bias, eps, activation)
    return reference.rms_norm_gated_ref(x, g, weight, bias, eps, activation)


def embed_norm_cat(table: torch.Tensor, tokens: torch.Tensor, feature: torch.Tensor, w_e: torch.Tensor, eps_e: float,
                   w_f: torch.Tensor, eps_f: float, feature_first: bool = False) -> torch.Tensor:
    """A drafter pass's input rows ``[..., T, 2H]``: the embedding rows of ``tokens [..., T]`` and ``feature [..., T,
    H]``, each RMS-normalised with its own scale, side by side (see ``embed_norm_cat_ref``); one launch."""
    if use_triton(feature):
        return _input_norm.embed_norm_cat(table, tokens, feature, w_e, eps_e, w_f, eps_f, feature_first)
    return reference.embed_norm_cat_ref(table, tokens, feature, w_e, eps_e, w_f, eps_f, feature_first)


def gemv(weight: torch.Tensor, x: torch.Tensor, **fused) -> torch.Tensor:
    """``weight @ f(x)`` for one token with the decode step's norm / SwiGLU / residual / short-conv ops fused around
    it (see ``gemv_ref`` for the keywords)."""
    if use_triton(x):
        return _gemv.gemv(weight, x, **fused)
    return reference.gemv_ref(weight, x, **fused)


def fused_gemm(weight: torch.Tensor, x: torch.Tensor, **fused) -> torch.Tensor:
    """``f(x) @ weight.T`` for the few token rows ``x [M, K]`` of a verified tree, with ``gemv``'s norm / SwiGLU /
    residual ops fused around it (see ``fused_gemm_ref``)."""
    if use_triton(x):
        return _fused_gemm.fused_gemm(weight, x, **fused)
    return reference.fused_gemm_ref(weight, x, **fused)


def qk_norm_rope_append(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                        length: torch.Tensor, num_heads: int, first: int = 0) -> torch.Tensor:
    """Tokens of a Qwen3.5 gated attention layer from their projections to the attention: q/k head norms, rotary,
    token ``t``'s key and value stored at slot ``length + first + t``; returns the queries ``[T, heads, D]`` (see
    ``qk_norm_rope_append_ref``)."""
    if use_triton(qkv):
        return _qk_norm_rope.qk_norm_rope_append(qkv, q_weight, k_weight, eps, cos, sin, key_buffer, value_buffer,
                                                 length, num_heads, first)
    return reference.qk_norm_rope_append_ref(qkv, q_weight, k_weight, eps, cos, sin, key_buffer, value_buffer,
                                             length, num_heads, first)


def attention_mask(length: torch.Tensor, ancestors: torch.Tensor | None, T: int, capacity: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask and the positions of ``T`` new tokens over an attention layer's buffer (see
    ``attention_mask_ref``): one launch on the Triton path."""
    fn = _masked_attention.attention_mask if use_triton(length) else reference.attention_mask_ref
    return fn(length, ancestors, T, capacity, dtype)


def masked_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``masked_attention``'s kernel takes these inputs: an additive mask of the queries' dtype, one row per
    query and one column per slot, for every head; unit-stride head dims of at most 256, whole key/value groups, at
    most 1024 query rows per key/value head."""
    B, H, T, D = q.shape
    return (mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1 and mask.shape[2] == T
            and mask.shape[3] == k.shape[2] and mask.dtype == q.dtype and k.shape == v.shape
            and k.shape[1] and H % k.shape[1] == 0 and D <= 256 and (H // k.shape[1]) * T <= 1024
            and q.stride(3) == k.stride(3) == v.stride(3) == 1 and q.dtype == k.dtype == v.dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a few queries over a KV buffer under an additive mask, grouped key/value heads, the output
    times ``sigmoid(gate)`` if given (see ``masked_attention_ref``); the kernel skips tiles of hidden slots. Inputs it
    does not take (``masked_attention_applies``) run the reference."""
    if use_triton(q) and masked_attention_applies(q, k, v, mask):
        return _masked_attention.masked_attention(q, k, v, mask.expand(q.shape[0], *mask.shape[1:]), scale,
                                                  gate=gate)
    return reference.masked_attention_ref(q, k, v, mask, scale, gate)
