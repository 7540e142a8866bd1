"""Triton kernels: a drafter's children drawn under sampling, every frontier row at once (``draw_children_ref``).

Under sampling each expanded node's ``K`` children are draws without replacement from the drafter's distribution after
the target's warpers (temperature, top-k): the ``K`` largest Gumbel keys. In torch that is ~20 tiny kernels a depth
(the warpers, ``torch.topk``'s multi-pass radix select for the top-k warper's threshold, log-softmax, the noise, the
draws' log-probs, the sibling ranks), each costing more in launch and dependency gaps than in work.

A row of up to ``ONE_PROGRAM_VOCAB`` entries (a drafter's vocabulary of 8K-16K tokens) is one program from start to
end, held in registers: the top-k warper's threshold (the ``top_k``-th largest scaled score, by bisection over the
scores' 32-bit order, or over the 16-bit order of bf16 scores in half the passes), the log-softmax's normaliser, the
Gumbel keys (uniforms from Philox on a seed read from device memory, so a CUDA graph replays fresh draws), the ``K``
largest keys (the draws, in draw order), their log-probs and sibling ranks (fp64), and the row's log-probs (``-inf``
where removed: the acceptance's ``q``). One launch a depth. Under a top-k warper the keys are drawn for the survivors
alone: the program lists their columns (up to ``CAP``, a scratch row in global memory) and reads them back, so the
Philox draws and the ``K`` rounds of maxima cover ``CAP`` entries instead of the whole row.

A longer row (a 32K draft vocabulary) comes warped (``ops.draw_children`` applies the warpers first, in slices by
``warped_probs_sliced`` below) and is spread over slices of it, in three launches:

1. One program per slice: its entries' max and sum of exponentials (the normaliser, in parts), their Gumbel keys
   and the slice's ``K`` largest keys.
2. One program per row: the normaliser, the ``K`` largest keys of the slices', the draws' log-probs and ranks.
3. One program per slice writes the row's log-probs.

A verified tree's warped rows at a target's vocabulary (Qwen3.5's 248K) under a top-k warper
(``warped_probs_sliced``, slices of 4096 or 8192 entries) need no sort and no pass of one program over a whole row,
in three launches:

1. One program per slice lists a few of its entries, compacted: those at or above a scaled score ``t_s`` that at
   least ``top_k`` and at most four times as many reach, by bisection over the values with an early exit (a few
   passes where 32 would find the exact ``top_k``-th score); where ties defeat that, those above the exact
   ``top_k``-th score and how many equal it. Every survivor of the row's top-k warper is among them: the row's
   threshold is at least every slice's ``top_k``-th score.
2. One program per row, over those candidates with their multiplicities: the row's top-k threshold, the nucleus's
   threshold and how many of the entries tied at it (in index order) it removes, the normaliser, and per slice how
   many entries are tied at the nucleus's threshold.
3. One program per slice writes the probabilities, keeping an entry by its score alone, or by its rank among the
   ties (the slices before it counted in 2, its own by a running count).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.topk import NO_INDEX, top_k_slots

MAX_DRAWS = 16
ONE_PROGRAM_VOCAB = 16384     # rows up to this long are drawn by one program each (32 entries a thread)
# ``warped_probs_sliced``'s slices of a long row, the first whose candidates fit one program (64 rows of 248K under
# a top-k of 50: 141 us in slices of 4096, 192 in 8192; an H100)
WARP_SLICES = (4096, 8192)
VALUE_PASSES = 16             # its value bisection's passes at most before the exact one


@triton.jit
def _scores(x, stride_x, row, cols, V):
    """The row's scores at ``cols`` in fp32, ``-inf`` past V."""
    return tl.load(x + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _scaled(x, stride_x, row, cols, V, temperature):
    """The row's scores at ``cols`` after the temperature warper (fp32 ``scores / temperature``), ``-inf`` past V."""
    return _scores(x, stride_x, row, cols, V) / temperature


@triton.jit
def _flip_negative(bits):
    """fp32 bits <-> int32 keys in the values' order: a negative value's magnitude bits flipped (its own inverse)."""
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _order_keys(s):
    """fp32 scores as int32 keys in their order (``_flip_negative`` of their bits)."""
    return _flip_negative(s.to(tl.int32, bitcast=True))


@triton.jit
def _halve(lo, hi, mid, count, TOP_K: tl.constexpr):
    """One bisection step for the largest key ``t`` with at least ``TOP_K`` keys ``>= t``: ``count`` keys are
    ``>= mid``."""
    return tl.where(count >= TOP_K, mid, lo), tl.where(count >= TOP_K, hi, mid - 1)


@triton.jit
def _kth_key(key, counted, TOP_K: tl.constexpr, BITS: tl.constexpr):
    """The largest key ``t`` (keys of ``BITS`` bits, signed) with at least ``TOP_K`` of the ``counted`` keys ``>= t``,
    by bisection over the keys (``BITS`` counting passes, each one reduction); the lowest key where fewer are
    counted. Counting three cuts a pass halves the passes but makes each dearer: as int64 fields, an H100 draw of
    4 x 8192 fp32 rows took 33.6 us against 30.4 by bisection; as a ``[BLOCK, 4]`` tensor the draw kernel compiles
    to 255 registers with spills for sm_90 (180 by bisection, none spilled)."""
    lo = tl.full([], -(1 << (BITS - 1)), tl.int64)
    hi = tl.full([], (1 << (BITS - 1)) - 1, tl.int64)
    for _ in range(BITS):
        mid = lo + (hi - lo + 1) // 2
        lo, hi = _halve(lo, hi, mid, tl.sum((counted & (key >= mid.to(tl.int32))).to(tl.int32), 0), TOP_K)
    return lo.to(tl.int32)


@triton.jit
def _key_score(key):
    """The fp32 score of an order key."""
    return _flip_negative(key.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _gumbel_keys(s, uniforms, seed, row, cols, V, GIVEN_UNIFORMS: tl.constexpr):
    """Gumbel-max keys of the kept scaled scores ``s`` at ``cols`` (``-inf`` exactly where nothing can be drawn)."""
    at = row.to(tl.int64) * V + cols
    if GIVEN_UNIFORMS:
        u = tl.load(uniforms + at, mask=cols < V, other=0.)
    else:
        u = tl.rand(tl.load(seed), at.to(tl.int32))
    # -log(Exp(1)); the Exp(1) draw kept above 0 as the torch path clamps it
    e = tl.maximum(-tl.log(1. - u), 1.1754943508222875e-38)
    return s - tl.log(e)


@triton.jit
def draw_slices_kernel(x, stride_x, uniforms, seed, part_max, part_sum, key_v, key_i, V, NB, temperature,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr):
    i_s, row = tl.program_id(0), tl.program_id(1)
    cols = i_s * BLOCK + tl.arange(0, BLOCK)
    s = _scaled(x, stride_x, row, cols, V, temperature)
    top = tl.max(s, 0)
    safe = tl.where(top == float("-inf"), 0., top)           # a slice with nothing kept adds 0 to the sum
    tl.store(part_max + row * NB + i_s, top)
    tl.store(part_sum + row * NB + i_s, tl.sum(tl.exp(s - safe), 0))
    key = _gumbel_keys(s, uniforms, seed, row, cols, V, GIVEN_UNIFORMS)
    kv, ki = top_k_slots(key, cols.to(tl.int64), key != float("-inf"), K, KP)
    slot = (row.to(tl.int64) * NB + i_s) * KP + tl.arange(0, KP)
    tl.store(key_v + slot, kv)
    tl.store(key_i + slot, ki)


@triton.jit
def _store_draws(x, stride_x, row, pick, norm, temperature, top_logq, rank, token, K: tl.constexpr,
                 KP: tl.constexpr):
    """A row's draws ``pick [KP]`` (in draw order; ``NO_INDEX``: none) from its log-softmax with normaliser ``norm``:
    their log-probs, sibling ranks and tokens (a missing draw: token 0 at log-prob and rank ``-inf``)."""
    slot = tl.arange(0, KP)
    m_k = slot < K
    drawn = m_k & (pick != NO_INDEX)
    cols = tl.where(drawn, pick, 0)
    logq = tl.load(x + row.to(tl.int64) * stride_x + cols, mask=drawn, other=0.).to(tl.float32) / temperature - norm
    logq = tl.where(drawn, logq, float("-inf"))
    # sibling ranks: the log of the mass each draw was made from, floored at the draw's own log-prob, falling
    q = tl.where(m_k, tl.exp(logq.to(tl.float64)), 0.)
    before = tl.cumsum(q, 0) - q
    left = tl.log(tl.maximum(1. - before, 0.))
    r = tl.maximum(left, logq.to(tl.float64))
    run = tl.full([KP], float("inf"), tl.float64)
    for i in tl.static_range(K):                             # running minimum along the draws
        ri = tl.sum(tl.where(slot == i, r, 0.), 0)
        run = tl.where(slot >= i, tl.minimum(run, ri), run)
    run = tl.where(drawn, run, float("-inf"))
    at = row * K + slot
    tl.store(top_logq + at, logq, mask=m_k)
    tl.store(rank + at, run.to(tl.float32), mask=m_k)
    tl.store(token + at, cols, mask=m_k)


@triton.jit
def _masses_at_most(key, p, mid):
    """The mass ``p`` of the keys at or below ``mid`` (any shape)."""
    return tl.sum(tl.where(key <= mid.to(tl.int32), p, 0.))


@triton.jit
def _nucleus(s, cols, top_p, INDEX_STEPS: tl.constexpr):
    """A whole row's scaled scores ``s`` (``-inf`` where removed) after the top-p warper (``nucleus_mask_ref``):
    the smallest order key ``t`` whose mass at or below it exceeds the ``1 - top_p`` cut, by bisection (32 passes),
    then, among the entries tied at ``t`` in index order, the last one whose running sum stays within the cut (one
    pass per bit of the index). Kept: keys above ``t``, tied entries after that one, and the row's last entry in
    ascending order (the largest, at the highest index)."""
    top = tl.max(s, 0)
    p = tl.exp(s - top)                                       # unnormalised: the cut scales with the sum instead
    cut = (1. - top_p) * tl.sum(p, 0)
    key = _order_keys(s)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        over = _masses_at_most(key, p, mid) > cut
        lo, hi = tl.where(over, lo, mid + 1), tl.where(over, mid, hi)
    t = lo.to(tl.int32)
    below = tl.sum(tl.where(key < t, p, 0.), 0)
    tie_p = tl.where(key == t, p, 0.)
    lo_i = tl.full([], -1, tl.int32)
    hi_i = tl.full([], (1 << (INDEX_STEPS - 1)) - 1, tl.int32)
    for _ in range(INDEX_STEPS):
        mid_i = lo_i + (hi_i - lo_i + 1) // 2
        within = below + tl.sum(tl.where(cols <= mid_i, tie_p, 0.), 0) <= cut
        lo_i, hi_i = tl.where(within, mid_i, lo_i), tl.where(within, hi_i, mid_i - 1)
    last = tl.max(tl.where(s == top, cols, -1), 0)
    kept = (key > t) | ((key == t) & (cols > lo_i)) | (cols == last)
    return tl.where(kept, s, float("-inf"))


@triton.jit
def _draw_picks(uniforms, seed, row, cols, s, V, K: tl.constexpr, KP: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr):
    """The columns of the ``K`` largest Gumbel keys of the kept scores ``s`` at ``cols`` (``[KP]``, in draw order)."""
    key = _gumbel_keys(s, uniforms, seed, row, cols, V, GIVEN_UNIFORMS)
    _, pick = top_k_slots(key, cols.to(tl.int64), key != float("-inf"), K, KP)
    return pick


@triton.jit
def draw_row_kernel(x, stride_x, uniforms, seed, logq, stride_q, top_logq, rank, token, listed, V, temperature,
                    top_p, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                    TOP_P: tl.constexpr, INDEX_STEPS: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr,
                    KEY_BITS: tl.constexpr, CAP: tl.constexpr):
    # a whole row in one program (module docstring): thresholds, normaliser, keys, draws, the log-prob row
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    raw = _scores(x, stride_x, row, cols, V)                 # unscaled: bf16 rows take 16-bit keys
    s = raw / temperature
    if TOP_K > 0:
        if KEY_BITS == 16:      # bf16 scores: the upper half of their fp32 order key orders them (half the passes)
            t = _kth_key(_order_keys(raw) >> 16, cols < V, TOP_K, 16) << 16
            s = tl.where(raw >= _key_score(t), s, float("-inf"))
        else:
            s = tl.where(s >= _key_score(_kth_key(_order_keys(s), cols < V, TOP_K, 32)), s, float("-inf"))
    if TOP_P:
        s = _nucleus(s, cols, top_p, INDEX_STEPS)
    top = tl.max(s, 0)
    norm = top + tl.log(tl.sum(tl.exp(s - top), 0))
    tl.store(logq + row.to(tl.int64) * stride_q + cols, s - norm, mask=cols < V)
    if K > 0:                                                  # K 0: the warped rows alone (``warped_log_probs``)
        if CAP > 0:
            kept = s > float("-inf")
            n = tl.sum(kept.to(tl.int32), 0)
            if n <= CAP:       # the few entries a top-k warper keeps, listed: their draws cost CAP entries' work
                at = listed + row.to(tl.int64) * CAP
                tl.store(at + tl.cumsum(kept.to(tl.int32), 0) - 1, cols, mask=kept)
                tl.debug_barrier()                             # the list, written by all threads, read by all
                j = tl.arange(0, CAP)
                few = tl.load(at + j, mask=j < n, other=V)
                pick = _draw_picks(uniforms, seed, row, few, _scaled(x, stride_x, row, few, V, temperature), V, K, KP,
                                   GIVEN_UNIFORMS)
            else:
                pick = _draw_picks(uniforms, seed, row, cols, s, V, K, KP, GIVEN_UNIFORMS)
        else:
            pick = _draw_picks(uniforms, seed, row, cols, s, V, K, KP, GIVEN_UNIFORMS)
        _store_draws(x, stride_x, row, pick, norm, temperature, top_logq, rank, token, K, KP)


@triton.jit
def draw_merge_kernel(x, stride_x, part_max, part_sum, key_v, key_i, lse, top_logq, rank, token, NB, temperature,
                      K: tl.constexpr, KP: tl.constexpr, BNB: tl.constexpr, BC: tl.constexpr):
    row = tl.program_id(0)
    b = tl.arange(0, BNB)
    mb = b < NB
    pm = tl.load(part_max + row * NB + b, mask=mb, other=float("-inf"))
    ps = tl.load(part_sum + row * NB + b, mask=mb, other=0.)
    top = tl.max(pm, 0)
    norm = top + tl.log(tl.sum(ps * tl.exp(pm - top), 0))
    tl.store(lse + row, norm)
    j = tl.arange(0, BC)
    mj = j < NB * KP
    kv = tl.load(key_v + row.to(tl.int64) * NB * KP + j, mask=mj, other=float("-inf"))
    ki = tl.load(key_i + row.to(tl.int64) * NB * KP + j, mask=mj, other=NO_INDEX)
    _, pick = top_k_slots(kv, ki, mj & (ki != NO_INDEX), K, KP)     # ties: the lower column
    _store_draws(x, stride_x, row, pick, norm, temperature, top_logq, rank, token, K, KP)


@triton.jit
def draw_logq_kernel(x, stride_x, lse, logq, stride_q, V, temperature, BLOCK: tl.constexpr):
    i_s, row = tl.program_id(0), tl.program_id(1)
    cols = i_s * BLOCK + tl.arange(0, BLOCK)
    out = _scaled(x, stride_x, row, cols, V, temperature) - tl.load(lse + row)
    tl.store(logq + row.to(tl.int64) * stride_q + cols, out, mask=cols < V)


def _one_row(x: torch.Tensor, top_k: int, k: int) -> dict:
    """``draw_row_kernel``'s block and warps for rows ``x [F, V]``: the whole row, 32 entries a thread at most (and
    the index bisection's steps: the block's bits); 16-bit keys for bf16 scores; under a top-k warper, the slots
    ``CAP`` of the list of kept entries the ``k`` draws are made from (0: none, the draws read the whole row)."""
    BLOCK = max(16, triton.next_power_of_2(x.shape[1]))
    cap = 2 * triton.next_power_of_2(top_k) if top_k and k else 0
    return dict(BLOCK=BLOCK, INDEX_STEPS=BLOCK.bit_length(), num_warps=max(1, min(16, BLOCK // 1024)),
                KEY_BITS=16 if x.dtype == torch.bfloat16 else 32, CAP=cap if 4 * cap <= BLOCK else 0)


def _listed(x: torch.Tensor, meta: dict) -> torch.Tensor:
    """``draw_row_kernel``'s scratch for each row's list of kept entries (``meta``: ``_one_row``'s)."""
    return torch.empty(x.shape[0], max(1, meta["CAP"]), dtype=torch.int32, device=x.device)


def draw_children(x: torch.Tensor, k: int, temperature: float, top_k: int, logq_out: torch.Tensor,
                  seed: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                  block: int = 1024, one_program: int = ONE_PROGRAM_VOCAB, top_p: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``draw_children_ref``: the uniforms come from Philox on ``seed`` (an int64 device tensor of
    one element, drawn fresh each call) unless ``uniforms [F, V]`` are given (tests). Rows of at most
    ``one_program`` entries take one program each, longer ones slices of ``block`` entries (tests take both); the
    top-k and top-p warpers need the whole row in one program."""
    F, V = x.shape
    if (top_k or top_p < 1.0) and V > one_program:
        raise ValueError(f"draw_children applies the top-k and top-p warpers to rows of at most {one_program} "
                         f"entries, got {V}: warp longer rows first (warped_probs_sliced with log=True, or "
                         "reference.warped_scores_ref) and draw with temperature 1 and no warpers")
    x = x if x.stride(-1) == 1 else x.contiguous()
    KP = triton.next_power_of_2(k)
    dev, f32 = x.device, torch.float32
    given = uniforms is not None
    top_logq = torch.empty(F, k, dtype=f32, device=dev)
    rank = torch.empty(F, k, dtype=f32, device=dev)
    token = torch.empty(F, k, dtype=torch.int64, device=dev)
    if V <= one_program:
        meta = _one_row(x, top_k, k)
        draw_row_kernel[(F,)](x, x.stride(0), uniforms.contiguous() if given else x,
                              seed if seed is not None else token, logq_out, logq_out.stride(0), top_logq, rank,
                              token, _listed(x, meta), V, temperature, top_p, K=k, KP=KP, TOP_K=top_k,
                              TOP_P=top_p < 1.0, GIVEN_UNIFORMS=given, **meta)
        return top_logq, rank, token
    BLOCK = min(block, max(16, triton.next_power_of_2(V)))
    NB = triton.cdiv(V, BLOCK)
    warps = 4 if BLOCK >= 512 else 1
    part_max = torch.empty(F, NB, dtype=f32, device=dev)
    part_sum = torch.empty(F, NB, dtype=f32, device=dev)
    key_v = torch.empty(F, NB, KP, dtype=f32, device=dev)
    key_i = torch.empty(F, NB, KP, dtype=torch.int64, device=dev)
    draw_slices_kernel[(NB, F)](x, x.stride(0), uniforms.contiguous() if given else x,
                                seed if seed is not None else key_i, part_max, part_sum, key_v, key_i, V, NB,
                                temperature, K=k, KP=KP, BLOCK=BLOCK, GIVEN_UNIFORMS=given, num_warps=warps)
    lse = torch.empty(F, dtype=f32, device=dev)
    C = NB * KP
    draw_merge_kernel[(F,)](x, x.stride(0), part_max, part_sum, key_v, key_i, lse, top_logq, rank, token, NB,
                            temperature, K=k, KP=KP, BNB=max(16, triton.next_power_of_2(NB)),
                            BC=max(16, triton.next_power_of_2(C)), num_warps=1 if C <= 256 else 4)
    draw_logq_kernel[(NB, F)](x, x.stride(0), lse, logq_out, logq_out.stride(0), V, temperature, BLOCK=BLOCK,
                              num_warps=warps)
    return top_logq, rank, token


def warped_log_probs(x: torch.Tensor, temperature: float, top_k: int, out: torch.Tensor,
                     top_p: float = 1.0) -> torch.Tensor:
    """``out = log_softmax(warped_scores_ref(x, temperature, top_k, top_p))`` for rows of at most
    ``ONE_PROGRAM_VOCAB`` entries: ``draw_row_kernel`` without draws, one program a row; returns ``out``."""
    F, V = x.shape
    if V > ONE_PROGRAM_VOCAB:
        raise ValueError(f"warped_log_probs takes rows of at most {ONE_PROGRAM_VOCAB} entries, got {V}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    draw_row_kernel[(F,)](x, x.stride(0), x, x, out, out.stride(0), x, x, x, x, V, temperature, top_p, K=0, KP=1,
                          TOP_K=top_k, TOP_P=top_p < 1.0, GIVEN_UNIFORMS=False, **_one_row(x, top_k, 0))
    return out


@triton.jit
def warp_slices_kernel(x, stride_x, cand_v, n_above, group_v, group_c, V, NB, temperature, TOP_K: tl.constexpr,
                       CAP: tl.constexpr, BLOCK: tl.constexpr, VALUE_PASSES: tl.constexpr):
    # a slice's share of a long row's top-k survivors (module docstring, "A verified tree's warped rows", 1)
    i_s, row = tl.program_id(0), tl.program_id(1)
    cols = i_s * BLOCK + tl.arange(0, BLOCK)
    s = _scaled(x, stride_x, row, cols, V, temperature)
    finite = s > float("-inf")
    key = _order_keys(s)
    # listed: the keys above t. At most CAP finite entries: all. Else a key keeping TOP_K to CAP of them, by
    # bisection over the scores' values, stopping once found (a few passes on real logits); failing that (ties),
    # the TOP_K-th largest key exactly, by bisection over the keys, and the entries at it as one group
    n = tl.sum(finite.to(tl.int32), 0)
    t = tl.full([], -2147483648, tl.int32)
    searching = n > CAP
    lo = tl.min(tl.where(finite, s, float("inf")), 0)
    hi = tl.max(s, 0)
    passes = 0
    while searching & (passes < VALUE_PASSES):
        mid_key = _order_keys(lo + (hi - lo) * 0.5)
        n = tl.sum((finite & (key >= mid_key)).to(tl.int32), 0)
        searching = (n > CAP) | (n < TOP_K)
        t = tl.where(searching, t, mid_key - 1)
        lo = tl.where(n > CAP, _key_score(mid_key), lo)
        hi = tl.where(n < TOP_K, _key_score(mid_key), hi)
        passes += 1
    tied = tl.zeros([], tl.int32)
    if searching:
        t = _kth_key(key, finite, TOP_K, 32)
        tied = tl.sum((finite & (key == t)).to(tl.int32), 0)
    listed = finite & (key > t)
    at = row.to(tl.int64) * NB + i_s
    tl.store(cand_v + at * CAP + tl.cumsum(listed.to(tl.int32), 0) - 1, s, mask=listed)
    tl.store(n_above + at, tl.sum(listed.to(tl.int32), 0))
    tl.store(group_v + at, _key_score(t))
    tl.store(group_c + at, tied)


@triton.jit
def warp_merge_kernel(cand_v, n_above, group_v, group_c, tied, thr, removed, lse, NB, top_p, TOP_K: tl.constexpr,
                      TOP_P: tl.constexpr, CAP: tl.constexpr, BNB: tl.constexpr):
    # a long row's thresholds and normaliser from its slices' candidates (module docstring, 2): the candidates
    # each slice listed [BNB, CAP] count once, a slice's entries at its exact threshold as one group
    row = tl.program_id(0)
    b = tl.arange(0, BNB)
    at = row.to(tl.int64) * NB + b
    n = tl.load(n_above + at, mask=b < NB, other=0)
    listed = tl.arange(0, CAP)[None, :] < n[:, None]
    v = tl.load(cand_v + at[:, None] * CAP + tl.arange(0, CAP)[None, :], mask=listed, other=float("-inf"))
    kv = _order_keys(v)
    gc = tl.load(group_c + at, mask=b < NB, other=0)
    gv = tl.where(gc > 0, tl.load(group_v + at, mask=b < NB, other=float("-inf")), float("-inf"))
    kg = _order_keys(gv)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum(((kv >= mid.to(tl.int32)) & listed).to(tl.int32)) + tl.sum(tl.where(kg >= mid.to(tl.int32),
                                                                                           gc, 0))
        lo, hi = _halve(lo, hi, mid, count, TOP_K)
    t = lo.to(tl.int32)
    top = tl.maximum(tl.max(tl.where(listed, v, float("-inf"))), tl.max(gv))
    pv = tl.where(listed & (kv >= t), tl.exp(v - top), 0.)
    pg = tl.where((gc > 0) & (kg >= t), gc.to(tl.float32) * tl.exp(gv - top), 0.)
    total = tl.sum(pv) + tl.sum(pg)
    gone = tl.zeros([], tl.int32)
    kept_mass = total
    if TOP_P:
        # the nucleus (``nucleus_mask_ref``): the smallest key whose mass at or below it exceeds the cut, at most
        # the row's largest; of the entries tied at it the lowest-indexed ones within the cut go, never the last
        cut = (1. - top_p) * total
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            over = _masses_at_most(kv, pv, mid) + _masses_at_most(kg, pg, mid) > cut
            lo, hi = tl.where(over, lo, mid + 1), tl.where(over, mid, hi)
        top_key = _order_keys(top)
        t = tl.minimum(lo.to(tl.int32), top_key)
        below = _masses_at_most(kv, pv, t.to(tl.int64) - 1) + _masses_at_most(kg, pg, t.to(tl.int64) - 1)
        p_t = tl.exp(_key_score(t) - top)
        n_tied = tl.sum(((kv == t) & listed).to(tl.int32)) + tl.sum(tl.where(kg == t, gc, 0))
        gone = tl.minimum(tl.maximum((cut - below) / p_t, 0.), n_tied.to(tl.float32)).to(tl.int32)
        gone = tl.where(t == top_key, tl.minimum(gone, n_tied - 1), gone)
        kept_mass = total - below - gone.to(tl.float32) * p_t
    tl.store(tied + at, tl.sum(((kv == t) & listed).to(tl.int32), 1) + tl.where(kg == t, gc, 0), mask=b < NB)
    tl.store(thr + row, t)
    tl.store(removed + row, gone)
    tl.store(lse + row, top + tl.log(kept_mass))


@triton.jit
def warp_write_kernel(x, stride_x, tied, thr, removed, lse, out, stride_o, V, NB, temperature, BLOCK: tl.constexpr,
                      BNB: tl.constexpr, LOG: tl.constexpr):
    # a slice of a long row's warped probabilities or log-probs (module docstring, 3)
    i_s, row = tl.program_id(0), tl.program_id(1)
    cols = i_s * BLOCK + tl.arange(0, BLOCK)
    s = _scaled(x, stride_x, row, cols, V, temperature)
    key = _order_keys(s)
    t = tl.load(thr + row)
    b = tl.arange(0, BNB)
    before = tl.sum(tl.load(tied + row.to(tl.int64) * NB + b, mask=b < i_s, other=0), 0)
    at_t = (key == t) & (s > float("-inf"))
    rank = before + tl.cumsum(at_t.to(tl.int32), 0) - 1           # among the row's entries tied at t, by index
    kept = (key > t) | (at_t & (rank >= tl.load(removed + row)))
    logp = s - tl.load(lse + row)
    if LOG:
        res = tl.where(kept, logp, float("-inf"))
    else:
        res = tl.where(kept, tl.exp(logp), 0.)
    tl.store(out + row.to(tl.int64) * stride_o + cols, res, mask=cols < V)


def _slots(top_k: int) -> int:
    """Candidates a slice lists at most under a top-k warper of ``top_k`` (its value bisection stops between
    ``top_k`` and this many)."""
    return 4 * triton.next_power_of_2(top_k)


def sliced_warp_fits(V: int, top_k: int, block: int | None = None) -> bool:
    """Whether ``warped_probs_sliced`` takes rows of ``V`` entries under a top-k warper of ``top_k`` in slices of
    ``block`` entries (``None``: of any of ``WARP_SLICES``): the slices' candidates fit one program
    (``ONE_PROGRAM_VOCAB``)."""
    if block is None:
        return any(sliced_warp_fits(V, top_k, b) for b in WARP_SLICES)
    return 0 < top_k < V and max(2, triton.next_power_of_2(triton.cdiv(V, min(block, triton.next_power_of_2(V))))) \
        * _slots(top_k) <= ONE_PROGRAM_VOCAB


def warped_probs_sliced(x: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0,
                        block: int | None = None, log: bool = False) -> torch.Tensor:
    """``softmax(warped_scores_ref(x, temperature, top_k, top_p))`` (``log``: its log) as fp32 for long rows
    ``x [R, V]`` under a top-k warper (``sliced_warp_fits``), in slices of ``block`` entries (``None``: the first of
    ``WARP_SLICES`` that fits): three launches (module docstring)."""
    R, V = x.shape
    if not sliced_warp_fits(V, top_k, block):
        raise ValueError(f"warped_probs_sliced takes a top-k warper of 1 to {V - 1} entries whose slices' "
                         f"candidates fit one program ({ONE_PROGRAM_VOCAB}), got top_k {top_k} over {V} entries in "
                         f"slices of {block or WARP_SLICES}: use reference.warped_scores_ref")
    block = block or next(b for b in WARP_SLICES if sliced_warp_fits(V, top_k, b))
    x = x if x.stride(-1) == 1 else x.contiguous()
    BLOCK = min(block, triton.next_power_of_2(V))
    NB, CAP = triton.cdiv(V, BLOCK), _slots(top_k)
    BNB = max(2, triton.next_power_of_2(NB))
    dev, f32, i32 = x.device, torch.float32, torch.int32
    cand_v = torch.empty(R, NB, CAP, dtype=f32, device=dev)
    n_above, group_c, tied = (torch.empty(R, NB, dtype=i32, device=dev) for _ in range(3))
    group_v = torch.empty(R, NB, dtype=f32, device=dev)
    thr, removed = torch.empty(R, dtype=i32, device=dev), torch.empty(R, dtype=i32, device=dev)
    lse = torch.empty(R, dtype=f32, device=dev)
    out = torch.empty(R, V, dtype=f32, device=dev)
    warps = max(1, min(16, BLOCK // 1024))
    warp_slices_kernel[(NB, R)](x, x.stride(0), cand_v, n_above, group_v, group_c, V, NB, temperature, TOP_K=top_k,
                                CAP=CAP, BLOCK=BLOCK, VALUE_PASSES=VALUE_PASSES, num_warps=warps)
    warp_merge_kernel[(R,)](cand_v, n_above, group_v, group_c, tied, thr, removed, lse, NB, top_p, TOP_K=top_k,
                            TOP_P=top_p < 1.0, CAP=CAP, BNB=BNB, num_warps=max(1, min(8, BNB * CAP // 512)))
    warp_write_kernel[(NB, R)](x, x.stride(0), tied, thr, removed, lse, out, out.stride(0), V, NB, temperature,
                               BLOCK=BLOCK, BNB=BNB, LOG=log, num_warps=warps)
    return out
