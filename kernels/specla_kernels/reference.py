"""Pure-PyTorch reference of every SpecLA op: the math the Triton kernels must match, and the CPU path.

Conventions follow flash-linear-attention 0.6.0: inputs are ``[B, T, H, D]``, the recurrent state is V-first
``[B, HV, V, K]`` in fp32, value heads ``HV`` may be a multiple of query/key heads ``H`` (grouped value heads: value
head ``h`` reads key head ``h // (HV // H)``).

A *token tree* is given by ``parents [B, N]``: ``parents[b, i] < i`` is the node's parent, ``-1`` means the node hangs
off the committed state. Nodes are numbered in topological order, so every ancestor mask is lower triangular. A chain
is the tree ``parents = [-1, 0, 1, ...]``. See ``docs/design.md`` for the derivation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------------------------
# tree topology
# ----------------------------------------------------------------------------------------------------------------
def chain_parents(n: int, batch: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """Parent pointers of a chain of ``n`` nodes: ``[-1, 0, 1, ..., n-2]``."""
    return (torch.arange(n, device=device) - 1).expand(batch, n).contiguous()


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``anc[b, i, j]`` is True iff node ``j`` is ``i`` or one of its ancestors. Loop-free (log-depth doubling)."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.float32, device=parents.device).expand(B, N, N)
    step = F.one_hot(parents.clamp(min=0), N).float() * (parents >= 0).unsqueeze(-1)
    anc = eye + step
    reach = 1
    while reach < N:  # after t squarings, paths of length up to 2^t are covered
        anc = (anc @ anc).clamp(max=1.0)
        reach *= 2
    return anc > 0


def tree_depth(anc: torch.Tensor) -> torch.Tensor:
    """Depth of each node (0 for children of the committed state)."""
    return anc.sum(-1) - 1


def ancestor_at(parents: torch.Tensor, nodes: torch.Tensor, distance: int) -> torch.Tensor:
    """The ancestor ``distance`` steps above ``nodes`` (both ``[B, M]``), or -1 once the path leaves the tree."""
    cur = nodes
    for _ in range(distance):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur)
    return cur


# ----------------------------------------------------------------------------------------------------------------
# gated delta rule
# ----------------------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's in-kernel l2 normalisation: ``x / sqrt(sum(x^2) + eps)`` in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, ``g <= 0``)."""
    a = a.float()
    if dt_bias is not None:
        a = a + dt_bias.float()
    return -A_log.float().exp() * F.softplus(a)


def gdn_gate_beta_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                      allow_neg_eigval: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-decay ``g`` (``gdn_gate``) and write strength ``beta = sigmoid(b)`` (x2 with negative
    eigenvalues allowed), both fp32."""
    return gdn_gate(a, A_log, dt_bias), b.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule exactly as fla's ``fused_recurrent`` kernel orders it.

    q, k: ``[B, T, H, K]`` (raw, l2-normalised here); v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (activated).
    Returns ``o [B, T, HV, V]`` (dtype of v) and the final state ``[B, HV, V, K]`` (fp32).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    scale = K ** -0.5 if scale is None else scale
    rep = HV // H
    out_dtype = v.dtype
    qn = (l2norm(q) * scale).repeat_interleave(rep, dim=2)
    kn = l2norm(k).repeat_interleave(rep, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    S = q.new_zeros(B, HV, V, K, dtype=torch.float32) if initial_state is None else initial_state.float().clone()
    o = v.new_empty(B, T, HV, V, dtype=out_dtype)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum('bhvk,bhk->bhv', S, kn[:, t]))
        S = S + u[..., None] * kn[:, t, :, None, :]
        o[:, t] = torch.einsum('bhvk,bhk->bhv', S, qn[:, t])
    return o, S


def tree_gated_delta_rule_ref(
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
    """Verify ``N`` tree nodes in one pass from the committed state, writing no per-node state.

    q, k: ``[B, N, H, K]`` raw; v: ``[B, N, HV, V]``; g, beta: ``[B, N, HV]``; initial_state: ``[B, HV, V, K]``.
    ``prefix``: factors ``(k_hat [B, N0, H, K], u [B, N0, HV, V], g [B, N0, HV])`` of nodes already verified on the
    same committed state; then ``parents`` is ``[B, N0 + N]`` and the new nodes may hang off old ones.
    Returns ``o [B, N, HV, V]`` and the new nodes' factors ``k_hat [B, N, H, K]``, ``u [B, N, HV, V]`` (fp32).
    """
    B, N, H, K = k.shape
    HV, V = v.shape[-2:]
    rep = HV // H
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    S0 = initial_state.float()
    k_hat = l2norm(k)
    qh = (l2norm(q) * scale).repeat_interleave(rep, dim=2)
    kh = k_hat.repeat_interleave(rep, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    if prefix is None:
        prefix = (k_hat[:, :0], v.new_empty(B, 0, HV, V), g[:, :0])
    k0, u0, g0 = prefix
    N0 = k0.shape[1]
    kh_all = torch.cat([k0.float().repeat_interleave(rep, dim=2), kh], 1)      # [B, Nt, HV, K]
    g_all = torch.cat([g0.float(), g], 1)                                       # [B, Nt, HV]

    anc_all = tree_ancestors(parents)                                           # [B, Nt, Nt]
    anc = anc_all[:, N0:]
    gam_all = torch.einsum('bij,bjh->bih', anc_all.float(), g_all)              # path log-decay
    gam = gam_all[:, N0:]                                                       # [B, N, HV]
    diff = gam[:, :, None, :] - gam_all[:, None, :, :]                          # [B, N, Nt, HV]
    decay = torch.where(anc[..., None], diff, torch.full_like(diff, float('-inf'))).exp()
    self_mask = torch.zeros_like(anc)
    self_mask[:, :, N0:] = torch.eye(N, dtype=torch.bool, device=anc.device)
    strict = decay * (~self_mask)[..., None]

    kk = torch.einsum('bihk,bjhk->bijh', kh, kh_all)                            # k_i . k_j
    rhs = beta[..., None] * (v - gam.exp()[..., None] * torch.einsum('bhvk,bihk->bihv', S0, kh))
    if N0:
        rhs = rhs - beta[..., None] * torch.einsum('bijh,bjhv->bihv', (strict * kk)[:, :, :N0], u0.float())
    L = (beta[:, :, None, :] * strict[:, :, N0:] * kk[:, :, N0:]).permute(0, 3, 1, 2)   # [B, HV, N, N]
    eye = torch.eye(N, device=L.device, dtype=L.dtype)
    u = torch.linalg.solve_triangular(eye + L, rhs.permute(0, 2, 1, 3), upper=False, unitriangular=True)
    u = u.permute(0, 2, 1, 3)                                                   # [B, N, HV, V]

    u_all = torch.cat([u0.float(), u], 1)
    qk = torch.einsum('bihk,bjhk->bijh', qh, kh_all)
    o = gam.exp()[..., None] * torch.einsum('bhvk,bihk->bihv', S0, qh)
    o = o + torch.einsum('bijh,bjhv->bihv', decay * qk, u_all)
    return o.to(out_dtype), k_hat, u


def commit_state_ref(
    state: torch.Tensor,
    k_hat: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    accepted: torch.Tensor,
) -> torch.Tensor:
    """State after the root-to-``accepted`` path, from compact factors: one rank-|P| update, no re-run.

    state: ``[B, HV, V, K]``; k_hat ``[B, Nt, H, K]``, u ``[B, Nt, HV, V]``, g ``[B, Nt, HV]`` of all verified nodes;
    ``accepted [B]``: the last accepted node (-1: nothing accepted, state unchanged).
    """
    B, Nt, H, K = k_hat.shape
    HV = u.shape[2]
    anc = tree_ancestors(parents)
    on_path = anc.gather(1, accepted.clamp(min=0)[:, None, None].expand(B, 1, Nt)).squeeze(1)
    on_path = on_path & (accepted >= 0)[:, None]
    gp = g.float() * on_path[..., None]                       # gates of path nodes, 0 elsewhere
    gam_m = gp.sum(1)                                          # [B, HV]
    gam_j = torch.cumsum(gp, 1)                                # path order == index order on a root path
    w = torch.where(on_path[..., None], (gam_m[:, None] - gam_j).exp(), torch.zeros_like(gp))
    kh = k_hat.float().repeat_interleave(HV // H, dim=2)
    upd = torch.einsum('bjh,bjhv,bjhk->bhvk', w, u.float(), kh)
    return state.float() * gam_m.exp()[..., None, None] + upd


# ----------------------------------------------------------------------------------------------------------------
# short convolution
# ----------------------------------------------------------------------------------------------------------------
def _tree_gather(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                 nodes: torch.Tensor, distance: int) -> torch.Tensor:
    """Raw input ``distance`` steps above each of ``nodes`` ([B, M]): a tree node's, or the committed window's.

    x: ``[B, Nt, D]`` raw inputs of the tree nodes; window: ``[B, D, W]`` (fla layout, newest last).
    """
    W = window.shape[-1]
    anc = ancestor_at(parents, nodes, distance)                                          # [B, M]
    from_tree = x.gather(1, anc.clamp(min=0)[..., None].expand(-1, -1, x.shape[-1]))
    node_depth = depth.gather(1, nodes.clamp(min=0))
    win_idx = (W - distance + node_depth).clamp(0, W - 1)                                # see docs/design.md
    from_win = window.gather(2, win_idx[:, None, :].expand(-1, window.shape[1], -1)).transpose(1, 2)
    return torch.where((anc >= 0)[..., None], from_tree, from_win.to(x.dtype))


def tree_conv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    parents: torch.Tensor,
    activation: str | None = 'silu',
    x_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv where each node sees its own ancestors, then the committed window.

    x: ``[B, Nt, D]`` raw (pre-conv) inputs; weight ``[D, W]``; window ``[B, D, W]``. Returns ``[B, Nt, D]``.
    ``x_out``, if given, receives a copy of ``x`` (the kernel writes it on the way, saving the caller a copy).
    """
    if x_out is not None:
        x_out.copy_(x)
    B, N, D = x.shape
    W = weight.shape[-1]
    depth = tree_depth(tree_ancestors(parents))
    nodes = torch.arange(N, device=x.device).expand(B, N)
    y = torch.zeros(B, N, D, dtype=torch.float32, device=x.device)
    for s in range(W):
        y = y + _tree_gather(x, window, parents, depth, nodes, s).float() * weight[:, W - 1 - s].float()
    if bias is not None:
        y = y + bias.float()
    if activation in ('silu', 'swish'):
        y = F.silu(y)
    return y.to(x.dtype)


def commit_window_ref(x: torch.Tensor, window: torch.Tensor, parents: torch.Tensor,
                      accepted: torch.Tensor) -> torch.Tensor:
    """Conv window after the accepted path: the last ``W`` raw inputs of ``[window, x along the path]``."""
    W = window.shape[-1]
    depth = tree_depth(tree_ancestors(parents))
    m = accepted[:, None]
    cols = [_tree_gather(x, window, parents, depth, m, s)[:, 0] for s in range(W - 1, -1, -1)]
    new = torch.stack(cols, -1)                                                          # [B, D, W]
    return torch.where((accepted >= 0)[:, None, None], new.to(window.dtype), window)


def commit_kv_ref(buffer: torch.Tensor, committed: torch.Tensor, path: torch.Tensor,
                  length: torch.Tensor) -> torch.Tensor:
    """An attention layer's key or value buffer ``[B, KV heads, capacity, D]`` after a commit: the pending entries
    follow the ``committed [B]`` positions in node order, and slot ``committed + i`` takes path node ``i``'s entry
    for ``i < length[b]`` (``path [B, P]``, root first); every other slot keeps its entry."""
    B, H, _, D = buffer.shape
    steps = torch.arange(path.shape[1], device=buffer.device)
    source = committed[:, None] + torch.where(steps < length[:, None], path, steps)
    gathered = buffer.gather(2, source[:, None, :, None].expand(B, H, -1, D))
    target = (committed[:, None] + steps)[:, None, :, None].expand(B, H, -1, D)
    return buffer.scatter(2, target, gathered)


def conv_sequence_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor | None,
                      activation: str | None = 'silu') -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``ShortConvolution`` on a plain sequence with its cache: returns ``y [B, T, D]`` and the new window."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if window is None:
        window = x.new_zeros(B, D, W)
    full = torch.cat([window.to(x.dtype), x.transpose(1, 2)], -1)                       # [B, D, W + T]
    y = F.conv1d(full[..., 1:].float(), weight.float()[:, None], bias.float() if bias is not None else None,
                 groups=D)
    if activation in ('silu', 'swish'):
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), full[..., -W:].contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# the drafters' log-softmax, and the top-k of each row (the drafter's expansion)
# ---------------------------------------------------------------------------------------------------------------------
def log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs over the last dim of logits ``x`` (the drafters' draft log-probs)."""
    return torch.log_softmax(x, -1, dtype=torch.float32)


def row_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, V]`` -> ``values [R, k]``, ``indices [R, k]``: the ``k`` largest of each row, descending, ties to the lower
    index (``torch.topk`` leaves the order of ties unspecified; a stable sort fixes it)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def warped_scores_ref(x: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0) -> torch.Tensor:
    """Each row of scores ``x [F, V]`` after transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (``top_k``
    0: none; entries below the ``top_k``-th largest become ``-inf``) and ``TopPLogitsWarper`` (``top_p`` 1: none;
    ``nucleus_mask_ref``), in that order, fp32."""
    s = x.float() / temperature
    if top_k:
        s = s.masked_fill(s < torch.topk(s, top_k, -1).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        s = s.masked_fill(~nucleus_mask_ref(s, top_p), float("-inf"))
    return s


def nucleus_mask_ref(s: torch.Tensor, top_p: float) -> torch.Tensor:
    """What transformers' ``TopPLogitsWarper`` (one token kept at least) keeps of each row of scores ``s [F, V]``:
    in ascending order of score, an entry whose probability summed with every entry before it is at most
    ``1 - top_p`` is removed; the last entry is always kept. Equal scores are ordered by index, as a stable sort
    orders them (transformers' ``torch.sort`` leaves their order to the implementation: unstable on the CPU), so the
    lower indices of a tie go first."""
    ordered, order = torch.sort(s, dim=-1, stable=True)
    kept_sorted = ordered.softmax(-1).cumsum(-1) > 1 - top_p
    kept_sorted[:, -1] = True
    return kept_sorted.scatter(-1, order, kept_sorted)


def draw_children_ref(x: torch.Tensor, k: int, temperature: float, top_k: int, logq_out: torch.Tensor,
                      uniforms: torch.Tensor, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` children of each row of scores ``x [F, V]`` (fp32) drawn without replacement under the temperature, top-k
    and top-p warpers (``warped_scores_ref``; ``top_k`` 0, ``top_p`` 1: none), by Gumbel
    keys from ``uniforms [F, V]`` in [0, 1). Writes the warped log-probs ``q`` into ``logq_out [F, V]`` (``-inf``
    where the top-k warper removed an entry) and returns, in draw order, the draws' log-probs, their sibling ranks (the
    log of the mass each draw was made from, floored at its own log-prob, falling; fp64 arithmetic) and tokens, all
    ``[F, k]``. Where fewer than ``k`` entries can be drawn the rest are token 0 at log-prob and rank ``-inf``."""
    s = warped_scores_ref(x, temperature, top_k, top_p)
    logq = s - torch.logsumexp(s, -1, keepdim=True)
    logq_out.copy_(logq)
    exp1 = (-torch.log(1 - uniforms.float())).clamp(min=torch.finfo(torch.float32).tiny)
    key, token = row_topk_ref(s - torch.log(exp1), k)
    drawn = key != float("-inf")
    token = token.masked_fill(~drawn, 0)
    top_logq = logq.gather(1, token).masked_fill(~drawn, float("-inf"))
    q = top_logq.double().exp()
    left = (1 - (q.cumsum(1) - q)).clamp(min=0).log()
    rank = torch.maximum(left, top_logq.double()).cummin(1).values.float().masked_fill(~drawn, float("-inf"))
    return top_logq, rank, token


def expand_frontier_ref(top_logp: torch.Tensor, top_rank: torch.Tensor, top_token: torch.Tensor,
                        frontier_score: torch.Tensor, frontier_cand: torch.Tensor, cand: torch.Tensor,
                        tokens: torch.Tensor, parents: torch.Tensor, next_score: torch.Tensor, next_cand: torch.Tensor,
                        n: int, cand_base: int) -> None:
    """One depth of the drafter's tree expansion, in place. The ``F`` frontier nodes (tree slots ``n - F .. n - 1``,
    cumulative scores ``frontier_score [F]``, candidate numbers ``frontier_cand [F]``) have ``K`` children each
    (``top_logp``, ``top_token`` ``[F, K]``), ranked for the tree's selection by ``top_rank [F, K]`` (``top_logp``
    for drafts chosen by their log-probs). Writes the ``F * K`` candidates into ``cand [3, >= F*K]`` (float64 rows:
    frontier score + rank, token, parent candidate), picks the ``K`` of the best cumulative score (ties to the lower
    candidate) as the next frontier: their tokens and parent slots into ``tokens[n:n+K]``, ``parents[n:n+K]``, their
    scores and candidate numbers (``cand_base`` + index) into ``next_score``, ``next_cand``."""
    F, K = top_logp.shape
    score = (frontier_score[:, None] + top_logp).flatten()
    cand[0, :F * K] = (frontier_score[:, None] + top_rank.float()).flatten()     # fp32 sums: a child never
                                                                                 # outranks its parent by rounding
    cand[1, :F * K] = top_token.flatten()
    cand[2, :F * K] = frontier_cand[:, None].expand(F, K).flatten()
    best_score, best = (t[0] for t in row_topk_ref(score[None], K))
    tokens[n:n + K] = top_token.flatten()[best]
    parents[n:n + K] = (n - F) + best // K
    next_score.copy_(best_score)
    next_cand.copy_(cand_base + best)


# ---------------------------------------------------------------------------------------------------------------------
# norms (fla's fused RMSNorm and the GatedDeltaNet output norm, computed in fp32)
# ---------------------------------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None, prenorm: bool = False) -> torch.Tensor | tuple:
    """fla's fused RMSNorm (with optional residual add and pre-norm output), computed in fp32."""
    dtype = x.dtype
    h = x.float() if residual is None else x.float() + residual.float()
    y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    return (y, h.to(dtype)) if prenorm else y


def embed_norm_cat_ref(table: torch.Tensor, tokens: torch.Tensor, feature: torch.Tensor, w_e: torch.Tensor,
                       eps_e: float, w_f: torch.Tensor, eps_f: float, feature_first: bool = False) -> torch.Tensor:
    """A drafter pass's input rows ``[..., T, 2H]``: ``[rmsnorm(table[tokens]) * w_e ; rmsnorm(feature) * w_f]`` (the
    halves swapped with ``feature_first``), each half as ``rms_norm_ref`` (fp32, rounded once)."""
    halves = [rms_norm_ref(table[tokens], w_e, None, eps_e), rms_norm_ref(feature, w_f, None, eps_f)]
    return torch.cat(halves[::-1] if feature_first else halves, -1)


def rms_norm_gated_ref(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float, activation: str) -> torch.Tensor:
    """fla's ``FusedRMSNormGated``: ``rmsnorm(x) * w * act(g)`` with ``act`` swish/silu or sigmoid."""
    y = rms_norm_ref(x.float(), weight, bias, eps).float()
    gf = g.float()
    y = y * (gf * torch.sigmoid(gf) if activation in ("swish", "silu") else torch.sigmoid(gf))
    return y.to(x.dtype)


def gemv_ref(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
             add: torch.Tensor | None = None, add_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
             swiglu: bool = False, residual: torch.Tensor | None = None,
             conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``weight [N, K] @ f(x)`` for one token (1-D ``x``), with the ops around a decode step's GEMV:

    - ``f`` (at most one): RMSNorm ``norm = (weight, eps)`` of ``x`` or of ``x + add`` (the sum, rounded, goes to
      ``add_out``: fla's pre-norm residual add); with ``gate``, fla's gated RMSNorm of each ``norm``-weight-sized head
      (swish gate); ``swiglu``: ``x = [gate | up]`` of length ``2K`` -> ``silu(gate) * up``;
    - then ``residual`` is added to the output, or ``conv = (window [C, W], conv_weight [C, W], bias)``: output rows
      ``< C`` are raw conv inputs, shifted into ``window`` in place (newest last) and replaced by ``silu(conv)``.

    Intermediates are rounded to ``x``'s dtype where the unfused ops (fla's norm, SwiGLU, conv; the GEMM) round."""
    dtype = x.dtype
    if swiglu:
        g, up = x.float().chunk(2)
        rhs = (F.silu(g) * up).to(dtype)
    elif gate is not None:
        D = norm[0].numel()
        rhs = rms_norm_gated_ref(x.view(-1, D), gate.reshape(-1, D), norm[0], None, norm[1], "swish").view(-1)
    elif add is not None:
        rhs, total = rms_norm_ref(x, norm[0], None, norm[1], residual=add, prenorm=True)
        add_out.copy_(total)
    elif norm is not None:
        rhs = rms_norm_ref(x, norm[0], None, norm[1])
    else:
        rhs = x
    y = F.linear(rhs, weight)
    if residual is not None:
        y = (y.float() + residual.float()).to(dtype)
    if conv is not None:
        window, conv_weight, bias = conv
        C = window.shape[0]
        window.copy_(torch.cat([window[:, 1:], y[:C, None]], 1))
        out = (window.float() * conv_weight.float()).sum(-1)
        if bias is not None:
            out = out + bias.float()
        y = torch.cat([F.silu(out).to(dtype), y[C:]])
    return y


def fused_gemm_ref(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                   add: torch.Tensor | None = None, add_out: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None, swiglu: bool = False,
                   residual: torch.Tensor | None = None,
                   conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``gemv_ref`` for each row of ``x [M, K]`` (``[M, 2K]`` with ``swiglu``; ``add``, ``add_out``, ``gate`` and
    ``residual`` by row too): the few tokens of a verified tree through one product, ``[M, N]``; ``conv`` for one
    row (one token shifted into the window)."""
    def row(t, i):
        return None if t is None else t[i]
    return torch.stack([gemv_ref(weight, x[i], norm=norm, add=row(add, i), add_out=row(add_out, i),
                                 gate=row(gate, i), swiglu=swiglu, residual=row(residual, i), conv=conv)
                        for i in range(x.shape[0])])


def qk_norm_rope_append_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, key_buffer: torch.Tensor,
                            value_buffer: torch.Tensor, length: torch.Tensor, num_heads: int,
                            first: int = 0) -> torch.Tensor:
    """``T`` tokens of a Qwen3.5 gated attention layer between its projections and the attention itself (batch 1):
    ``qkv [T, W]`` (or ``[W]``, one token) is ``[q_proj | k_proj | v_proj]``'s output (per query head its query
    then its output gate, ``2 * D``), the query and key heads are RMS-normed over ``D`` with the fp32 scales
    ``q_weight`` / ``k_weight`` (a zero-centred norm's ``1 + w``) and rounded, their first ``R`` dims rotated
    (``x * cos + rotate_half(x) * sin``, ``cos, sin [T, R]`` or ``[R]``), token ``t``'s key and value heads written to
    slot ``length + first + t`` of ``key_buffer`` / ``value_buffer`` ``[1, KV heads, capacity, D]``. Returns the
    queries ``[T, num_heads, D]``."""
    KV, D = key_buffer.shape[1], key_buffer.shape[3]
    dtype = qkv.dtype
    qkv = qkv.view(-1, qkv.shape[-1])
    T = qkv.shape[0]
    cos, sin = cos.view(-1, 1, cos.shape[-1]).float(), sin.view(-1, 1, sin.shape[-1]).float()     # [T or 1, 1, R]
    q = qkv[:, :2 * num_heads * D].view(T, num_heads, 2, D)[:, :, 0]
    k = qkv[:, 2 * num_heads * D:(2 * num_heads + KV) * D].view(T, KV, D)
    v = qkv[:, (2 * num_heads + KV) * D:(2 * num_heads + 2 * KV) * D].view(T, KV, D)

    def norm_rope(x, weight):
        x = x.float()
        y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight).to(dtype).float()
        R = cos.shape[-1]
        rot, rest = y[..., :R], y[..., R:]
        half = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1).to(dtype)
    slots = (length.view(1) + first + torch.arange(T, device=length.device)).view(1, 1, T, 1).expand(1, KV, T, D)
    key_buffer.scatter_(2, slots, norm_rope(k, k_weight).transpose(0, 1)[None])
    value_buffer.scatter_(2, slots, v.transpose(0, 1)[None])
    return norm_rope(q, q_weight)


# mask entries at or below this count as hidden (``masked_attention``'s kernel skips tiles of them)
HIDDEN = -1e4


def attention_mask_ref(length: torch.Tensor, ancestors: torch.Tensor | None, T: int, capacity: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask ``[B, 1, T, capacity]`` (0 seen, ``dtype``'s least value hidden) and the positions ``[B, T]``
    of ``T`` new tokens after ``length [B]`` committed positions of an attention layer's buffer, whose slot ``j``
    holds committed position ``j`` below the length and pending node ``j - length`` from there. Consumed tokens
    (``ancestors=None``): token ``t`` sees the slots up to ``length + t``, at position ``length + t``. Tree nodes:
    ``ancestors [B, T, N]`` are their rows of the pending nodes' ancestor mask (themselves included); a node sees the
    committed slots and its ancestors' slots, at position ``length + depth``."""
    B = length.shape[0]
    length = length[:, None]                                                    # [B, 1]
    slots = torch.arange(capacity, device=length.device)
    if ancestors is None:
        offsets = torch.arange(T, device=length.device).expand(B, T)
        seen = slots <= (length + offsets)[..., None]                           # [B, T, capacity]
    else:
        offsets = tree_depth(ancestors)
        pending = slots - length                                                # [B, capacity]
        N = ancestors.shape[-1]
        among = ancestors.gather(2, pending.clamp(0, N - 1)[:, None].expand(B, T, -1))
        seen = (pending < 0)[:, None] | (among & (pending < N)[:, None])
    mask = torch.zeros(B, 1, T, capacity, dtype=dtype, device=length.device)
    return mask.masked_fill_(~seen[:, None], torch.finfo(dtype).min), length + offsets


def masked_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of queries ``q [B, H, T, D]`` over keys and values ``k, v [B, HKV, S, D]`` (query head ``h``
    reads key/value head ``h // (H / HKV)``) under the additive ``mask [B, 1, T, S]``, computed in fp32: output
    ``[B, T, H, D]`` in ``q``'s dtype (the layout transformers' attention functions return). A row whose every mask
    entry is at or below ``HIDDEN`` sees nothing: zeros. With ``gate [B, T, H, D]`` the output is then multiplied by
    ``sigmoid(gate)`` in ``q``'s dtype (Qwen3.5's gated attention)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    s = q.float() @ k.transpose(-1, -2) * scale + mask.float()
    o = (torch.softmax(s, -1) @ v * (mask > HIDDEN).any(-1, keepdim=True)).transpose(1, 2).to(q.dtype)
    return o if gate is None else o * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------------------------------
# acceptance of a verified tree (the device loop's step; the rule is ``specla_hf.loop.acceptance``)
# ---------------------------------------------------------------------------------------------------------------------
def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """``[N, N]``: ``[i, s]`` whether node ``s`` is a sibling of node ``i`` tried before it (children in node order)."""
    idx = torch.arange(parents.shape[0], device=parents.device)
    return (parents[None, :] == parents[:, None]) & (idx[None, :] < idx[:, None])


def earlier_twin(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``[N]``: whether an earlier sibling holds the same token (a walk trying children in order never reaches it)."""
    return (earlier_siblings(parents) & (tokens[None, :] == tokens[:, None])).any(1)


def accept_walk_ref(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, cap: int,
                    argmax: torch.Tensor | None = None, hit: torch.Tensor | None = None) -> torch.Tensor:
    """The accepted path of a verified tree ``tokens``/``parents [N]`` (node 0 the root; parent -1 for it and for
    padding nodes, never accepted), ``ancestors [N, N]`` (row ``i``: ``i`` and its ancestors), and what the step
    emits, as ``[length, emitted (cap), path (cap), node]`` (int64).

    A node matches when, with ``argmax [N]`` (greedy: the target's choice after each node), its token is its parent's
    argmax and no earlier sibling holds that token; with ``hit [N]`` (sampling: each node's own acceptance draw),
    when it hit and no earlier sibling hit. A node is accepted when every node on its root path matches; the deepest
    (the first of equal depth) ends the path, of ``length`` nodes, root first in ``path`` (padded with ``node``).
    ``emitted``: the drafts after the root along the path, then the bonus token after ``node`` (padded with it):
    ``argmax[node]``, or -1 under sampling (the caller draws it)."""
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    if argmax is not None:
        fits = (tokens == argmax[parents.clamp(min=0)]) & ~earlier_twin(tokens, parents)
    else:
        fits = hit & ~(earlier_siblings(parents) & hit[None, :]).any(1)
    match = torch.where(parents >= 0, fits, idx == 0)
    accepted = ~(ancestors & ~match[None, :]).any(1)
    depth = ancestors.sum(1)
    node = torch.where(accepted, depth, 0).argmax().view(1)
    length = depth.index_select(0, node)
    on_path = ancestors.index_select(0, node)[0]
    slot = torch.where(on_path, depth - 1, cap)                # a path node's position; the rest to a spare slot
    path = node.repeat(cap + 1).scatter(0, slot, idx)[:cap]
    after = torch.cat([path[1:], node])                         # the node each emitted draft token comes from
    bonus = argmax.index_select(0, node) if argmax is not None else torch.full_like(node, -1)
    emitted = torch.where(torch.arange(cap, device=idx.device) + 1 < length, tokens[after], bonus)
    return torch.cat([length, emitted, path, node])


def rejection_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draw from ``q`` leaves of ``p`` (last dim): ``norm(max(p - q, 0))``; ``p`` itself where
    nothing is left (``p == q`` up to rounding, where a rejection has no chance but rounding's). Masses are summed in
    fp64: where ``q`` is close to ``p`` the residual is a cancellation that an fp32 sum over a 248K vocabulary can
    miss by more than a token's mass."""
    rest = (p - q).clamp(min=0)
    total = rest.sum(-1, keepdim=True, dtype=torch.float64)
    return torch.where(total > 0, (rest / total.clamp(min=torch.finfo(p.dtype).tiny)).to(p.dtype), p)


def without_draw(q: torch.Tensor, x: torch.Tensor | int) -> torch.Tensor:
    """``q`` (last dim) with the drawn token ``x`` removed, renormalised: the law of the next draw without
    replacement (all zero once nothing is left: no further child can be accepted)."""
    q = q.clone()
    if isinstance(x, int):
        q[x] = 0
    else:
        q.scatter_(-1, x[:, None], 0)
    return (q / q.sum(-1, keepdim=True, dtype=torch.float64).clamp(min=torch.finfo(q.dtype).tiny)).to(q.dtype)


def drawn_hits_ref(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
                   uniforms: torch.Tensor, siblings: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling of children drawn without replacement, every parent at once: node ``u``'s
    children (``parents == u``, in node order; the first ``siblings``) were drawn from ``draft_probs[u]``; the child
    of rank ``r`` hits when ``uniforms[child] * q(x) < p(x)`` (``q(x) > 0``) with ``p`` the target's ``probs[u]``
    after the rejections of ranks ``< r`` (``rejection_residual``) and ``q`` without their tokens (``without_draw``).
    Returns ``hit [N]`` (bool; False for nodes without a parent) and each row's residual after all its children,
    in fp32 (a row without children: ``probs``'s)."""
    N = tokens.shape[0]
    idx = torch.arange(N, device=tokens.device)
    rank = earlier_siblings(parents).sum(1)
    # child_of[u, r]: node u's child of rank r, or N (none); a padding column takes what does not belong
    child_of = torch.full((N + 1, siblings + 1), N, dtype=torch.long, device=tokens.device)
    drafted = (parents >= 0) & (rank < siblings)
    child_of[torch.where(drafted, parents, N), torch.where(drafted, rank, siblings)] = idx
    child_of = child_of[:N, :siblings]
    p, q = probs.float(), draft_probs.float()
    hit = torch.zeros(N + 1, dtype=torch.bool, device=tokens.device)
    for r in range(siblings):
        child = child_of[:, r]
        has = child < N
        x = tokens[child.clamp(max=N - 1)][:, None]
        px, qx = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
        hit[child] = has & (qx > 0) & (uniforms[child.clamp(max=N - 1)] * qx < px)
        p = torch.where(has[:, None], rejection_residual(p, q), p)
        q = torch.where(has[:, None], without_draw(q, x[:, 0]), q)
    return hit[:N], p
