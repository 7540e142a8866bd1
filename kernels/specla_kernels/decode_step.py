"""Triton kernel: a batch-1 GDN model's whole one-token step (every layer, then the LM head) in one launch.

Semantics of :func:`specla_kernels.reference.decode_step_ref`: per layer the input projection (RMSNorm before it, the
short conv and its window shift after it), the gated delta rule on the state in place, the output projection (gated
head norm before it), the MLP's gate|up (residual add and RMSNorm before it) and down projection (SwiGLU before it,
residual add after it); then the final norm and the LM head. These are the products and fused ops of
``specla_kernels.gemv`` (the same prologue, epilogue and row-loop code), with fla's fused-recurrent arithmetic for the
recurrence.

Why one launch: as 106 launches (four GEMVs and fla's recurrence per layer) the step hands over between dependent
kernels 105 times, and at each hand-over the next kernel waits for the whole previous grid to finish, then ramps its
loads up; session 14 found the step bound by that, not by the products' streaming rate (docs/kernels.md). Here a
persistent grid, every program resident at once, runs the phases in order with a grid barrier between dependent
ones, and each program requests its first weight tile (or state tile) of the next phase, which depends on nothing
computed, before it waits at the barrier.

The barrier is a counter that only grows during a launch: barrier ``j`` is passed once it reaches ``(j + 1) * G``;
the last program to leave re-arms it for the next launch. Its spin is bounded (``SPIN_LIMIT`` polls): a grid that
could not be resident at once ends with ``err`` set instead of hanging. Activations live in per-layer scratch rows,
written once per launch, so no program can read a stale cached copy of one. Under the interpreter programs run one
after another, so the grid is one program (which then owns every block and passes every barrier at once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specla_kernels.commit import TL_DTYPES, address_table
from specla_kernels.reference import StepLayer, StepShape
from specla_kernels.gemv import (CONV, GATED_NORM, NO_EPILOGUE, NORM, NORM_ADD, RESIDUAL, SWIGLU, _rhs, _rows,
                                 _weight_block)

# rows of the per-layer address table
(IN_W, CONV_W, CONV_B, A_LOG, DT_BIAS, ATTN_NORM, O_NORM, O_W, MLP_NORM, GATE_UP, DOWN, WINDOW,
 STATE) = map(tl.constexpr, range(13))
# launch shape: warps per program, weight elements per program and stage (32 per thread with 8 warps, as the tuned
# GEMVs hold), a register cap (None: the compiler's choice) and at most this many programs per SM
# (sync=False drops the grid barriers: wrong results, for timing what they cost)
LAUNCH = dict(num_warps=8, tile_elems=8192, maxnreg=None, max_per_sm=2, sync=True)
SPIN_LIMIT = tl.constexpr(1 << 16)   # polls of the barrier counter before a launch gives up (~30 ms)


@triton.jit
def _ptr(tab, row, layer, L, DT: tl.constexpr):
    return tl.load(tab + row * L + layer).to(tl.pointer_type(DT))


@triton.jit
def _sync(bar, target, err, SYNC: tl.constexpr):
    """Grid barrier: this program's stores are released, then it waits until ``target`` programs have arrived
    (``SYNC = False``: none, for timing what the barriers cost; the results are then wrong)."""
    if not SYNC:
        return
    tl.debug_barrier()                               # every thread's stores are issued before the release
    tl.atomic_add(bar, 1, sem="release")
    polls = 0
    while (tl.load(bar, volatile=True) < target) & (polls < SPIN_LIMIT):
        polls += 1
    if polls >= SPIN_LIMIT:
        tl.atomic_xchg(err, 1)
    tl.atomic_add(bar, 0, sem="acquire")             # the other programs' stores are visible to the loads after
    tl.debug_barrier()


@triton.jit
def _state_tile(state, it, n_items, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BVR: tl.constexpr):
    """Recurrence item ``it`` (value head, ``BVR`` rows of its ``[V, K]`` state): the tile's addresses and mask."""
    NV: tl.constexpr = (V + BVR - 1) // BVR
    o_v = (it % NV) * BVR + tl.arange(0, BVR)
    o_k = tl.arange(0, BK)
    # (scalar conditions as a vector compare: the interpreter turns a bool vector & bool scalar into int32)
    mask = (o_v < tl.where(it < n_items, V, 0))[:, None] & (o_k < K)[None, :]
    return state + (it // NV) * V * K + o_v[:, None] * K + o_k[None, :], mask


@triton.jit
def _recurrence(b_h, it, state, p, o, A_log, dt_bias, scale, KD: tl.constexpr, VD: tl.constexpr,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BVR: tl.constexpr, NEG_EIG: tl.constexpr):
    """One token of the gated delta rule on item ``it``'s state rows ``b_h`` (fp32, loaded), as fla's fused-recurrent
    kernel computes it: gate and write strength from the raw ``a``, ``b`` columns of the projection ``p``
    (``[q | k | v | gate | a | b]``), l2-normalised ``q`` (scaled) and ``k``; the rows are stored back and their
    outputs written to ``o``."""
    NV: tl.constexpr = (V + BVR - 1) // BVR
    i_hv = it // NV
    i_h = i_hv // (HV // H)
    p_s, m_s = _state_tile(state, it, HV * NV, H, HV, K, V, BK, BVR)
    o_k = tl.arange(0, BK)
    o_v = (it % NV) * BVR + tl.arange(0, BVR)
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(p + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(p + KD + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(p + 2 * KD + i_hv * V + o_v, mask=m_v, other=0.).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_beta = tl.sigmoid(tl.load(p + 2 * KD + 2 * VD + HV + i_hv).to(tl.float32))
    if NEG_EIG:
        b_beta = b_beta * 2
    b_a = tl.load(p + 2 * KD + 2 * VD + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
    b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.where(b_a < 20., tl.log(1 + tl.exp(b_a)), b_a)
    b_h *= tl.exp(b_g)
    b_v = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
    b_h += b_v[:, None] * b_k[None, :]
    tl.store(o + i_hv * V + o_v, tl.sum(b_h * b_q[None, :], 1).to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_h, mask=m_s)


@triton.jit
def decode_step_kernel(
    tab, eps, L, tok, emb, h, p, o, mixed, res, xm, logits, head_w, head_norm, bar, err, eps_head, scale,
    D: tl.constexpr, NP: tl.constexpr, C: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, I: tl.constexpr,
    VOCAB: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    WP: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, NEG_EIG: tl.constexpr, DT: tl.constexpr, A_DT: tl.constexpr,
    DTB_DT: tl.constexpr,
    KR_D: tl.constexpr, KC_D: tl.constexpr, KR_O: tl.constexpr, KR_I: tl.constexpr, KC_I: tl.constexpr,
    BN_D: tl.constexpr, BN_O: tl.constexpr, BN_I: tl.constexpr, BK: tl.constexpr, BVR: tl.constexpr,
    SYNC: tl.constexpr,
):
    # Phases of layer l, each program taking blocks pid, pid + G, .. of each (G programs, all resident):
    #   A in_proj   p[l]     = W_in @ rmsnorm(h_l), conv epilogue on the q|k|v rows (window shifted in place)
    #   B recurrence o[l]    = the delta rule per (value head, BVR state rows), the state updated in place
    #   C o_proj    mixed[l] = W_o @ gated_rmsnorm(o[l], gate of p[l])
    #   D gate_up   xm[l]    = W_gu @ rmsnorm(h_l + mixed[l]); program 0 writes the sum to res[l]
    #   E down      h_{l+1}  = W_down @ swiglu(xm[l]) + res[l]
    # h_0 is the token's embedding row, read in place; after the last layer F: logits = W_head @ rmsnorm(h_L).
    # eps [3, L]: each layer's attn-norm, output-norm and MLP-norm epsilons.
    # A barrier separates consecutive phases; before each, a program requests its next phase's first tile.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols_d = tl.arange(0, KR_D)[:, None] * KC_D + tl.arange(0, KC_D)[None, :]
    m_d = cols_d < D
    cols_o = tl.arange(0, KR_O)[:, None] * V + tl.arange(0, V)[None, :]
    m_o = cols_o < VD
    cols_i = tl.arange(0, KR_I)[:, None] * KC_I + tl.arange(0, KC_I)[None, :]
    m_i = cols_i < I
    n_items = HV * ((V + BVR - 1) // BVR)
    w_a = _weight_block(_ptr(tab, IN_W, 0, L, DT), pid, NP, D, cols_d, m_d, BN_D)
    barrier = 0
    for l in range(L):
        if l == 0:
            h_in = emb + tl.load(tok) * D
        else:
            h_in = h + l * D
            barrier += 1
            _sync(bar, barrier * G, err, SYNC)
        p_l, o_l, mixed_l, res_l, xm_l = p + l * NP, o + l * VD, mixed + l * D, res + l * D, xm + l * 2 * I
        rhs = _rhs(h_in, h_in, h_in, _ptr(tab, ATTN_NORM, l, L, DT), h_in, tl.load(eps + l), cols_d, m_d, D, False,
                   NORM, KC_D, 0)
        _rows(_ptr(tab, IN_W, l, L, DT), w_a, w_a, rhs, p_l, NP, D, cols_d, m_d, pid, G, h_in,
              _ptr(tab, WINDOW, l, L, DT), _ptr(tab, CONV_W, l, L, DT), _ptr(tab, CONV_B, l, L, DT), C, CONV,
              HAS_CONV_BIAS, W, WP, BN_D, 2)

        state = _ptr(tab, STATE, l, L, tl.float32)
        p_s, m_s = _state_tile(state, pid, n_items, H, HV, K, V, BK, BVR)
        first = tl.load(p_s, mask=m_s, other=0.)
        barrier += 1
        _sync(bar, barrier * G, err, SYNC)
        for it in range(pid, n_items, G):
            p_s, m_s = _state_tile(state, tl.where(it == pid, n_items, it), n_items, H, HV, K, V, BK, BVR)
            b_h = tl.where(it == pid, first, tl.load(p_s, mask=m_s, other=0.))     # (the first is loaded)
            _recurrence(b_h, it, state, p_l, o_l, _ptr(tab, A_LOG, l, L, A_DT), _ptr(tab, DT_BIAS, l, L, DTB_DT),
                        scale, KD, VD, H, HV, K, V, BK, BVR, NEG_EIG)

        w_o = _ptr(tab, O_W, l, L, DT)
        w_c = _weight_block(w_o, pid, D, VD, cols_o, m_o, BN_O)
        barrier += 1
        _sync(bar, barrier * G, err, SYNC)
        rhs = _rhs(o_l, o_l, o_l, _ptr(tab, O_NORM, l, L, DT), p_l + 2 * KD + VD, tl.load(eps + L + l), cols_o, m_o,
                   VD, False, GATED_NORM, V, 0)
        _rows(w_o, w_c, w_c, rhs, mixed_l, D, VD, cols_o, m_o, pid, G, o_l, o_l, o_l, o_l, 0, NO_EPILOGUE,
              False, 1, 1, BN_O, 2)

        w_gu = _ptr(tab, GATE_UP, l, L, DT)
        w_d = _weight_block(w_gu, pid, 2 * I, D, cols_d, m_d, BN_D)
        barrier += 1
        _sync(bar, barrier * G, err, SYNC)
        rhs = _rhs(mixed_l, h_in, res_l, _ptr(tab, MLP_NORM, l, L, DT), mixed_l, tl.load(eps + 2 * L + l), cols_d,
                   m_d, D, pid == 0, NORM_ADD, KC_D, 0)
        _rows(w_gu, w_d, w_d, rhs, xm_l, 2 * I, D, cols_d, m_d, pid, G, xm_l, xm_l, xm_l, xm_l, 0, NO_EPILOGUE,
              False, 1, 1, BN_D, 2)

        w_dn = _ptr(tab, DOWN, l, L, DT)
        w_e = _weight_block(w_dn, pid, D, I, cols_i, m_i, BN_I)
        barrier += 1
        _sync(bar, barrier * G, err, SYNC)
        rhs = _rhs(xm_l, xm_l, xm_l, xm_l, xm_l, 0., cols_i, m_i, I, False, SWIGLU, KC_I, 0)
        _rows(w_dn, w_e, w_e, rhs, h + (l + 1) * D, D, I, cols_i, m_i, pid, G, res_l, res_l, res_l, res_l, 0,
              RESIDUAL, False, 1, 1, BN_I, 2)
        if l + 1 < L:
            w_a = _weight_block(_ptr(tab, IN_W, l + 1, L, DT), pid, NP, D, cols_d, m_d, BN_D)
        else:
            w_a = _weight_block(head_w, pid, VOCAB, D, cols_d, m_d, BN_D)

    barrier += 1
    _sync(bar, barrier * G, err, SYNC)
    h_out = h + L * D
    rhs = _rhs(h_out, h_out, h_out, head_norm, h_out, eps_head, cols_d, m_d, D, False, NORM, KC_D, 0)
    _rows(head_w, w_a, w_a, rhs, logits, VOCAB, D, cols_d, m_d, pid, G, h_out, h_out, h_out, h_out, 0, NO_EPILOGUE,
          False, 1, 1, BN_D, 2)
    # leave: the last program out re-arms the counter (every program arrives once more than it passed barriers)
    tl.debug_barrier()
    if tl.atomic_add(bar, 1, sem="acq_rel") == (barrier + 1) * G - 1:
        tl.atomic_xchg(bar, 0)


def _table_row(layer: StepLayer, row: int) -> torch.Tensor:
    return [layer.in_proj, layer.conv_weight, layer.conv_bias if layer.conv_bias is not None else layer.conv_weight,
            layer.A_log, layer.dt_bias, layer.attn_norm, layer.o_norm, layer.o_proj, layer.mlp_norm, layer.gate_up,
            layer.down, layer.window, layer.state][row]


class DecodeStep:
    """The one-launch step of one model: its scratch rows and barrier counter, made on first use. ``__call__(token,
    embedding, layers, head_norm, head)`` returns the logits ``[vocab]`` (a new tensor). One step of a given object
    runs at a time (its scratch and counter are shared by its launches)."""

    def __init__(self, shape: StepShape, **launch):
        self.shape = shape
        self.launch = {**LAUNCH, **launch}
        self.per_sm: int | None = None       # programs per SM the compiled kernel can keep resident
        self.n_regs: int | None = None
        self._scratch: dict = {}
        self._eps: dict = {}

    def _buffers(self, L: int, NP: int, D: int, VD: int, I: int, dtype: torch.dtype, device: torch.device):
        key = (L, NP, D, VD, I, dtype, device)
        if key not in self._scratch:
            self._scratch.clear()
            new = lambda *n: torch.empty(*n, dtype=dtype, device=device)   # noqa: E731
            self._scratch[key] = dict(h=new(L + 1, D), p=new(L, NP), o=new(L, VD), mixed=new(L, D), res=new(L, D),
                                      xm=new(L, 2 * I), bar=torch.zeros(1, dtype=torch.int32, device=device),
                                      err=torch.zeros(1, dtype=torch.int32, device=device))
        return self._scratch[key]

    def __call__(self, token: torch.Tensor, embedding: torch.Tensor, layers: list[StepLayer], head_norm: torch.Tensor,
                 head: torch.Tensor) -> torch.Tensor:
        s = self.shape
        l0 = layers[0]
        NP, D = l0.in_proj.shape
        C, W = l0.conv_weight.shape
        VD, I = l0.o_proj.shape[1], l0.down.shape[1]
        H, HV, K, V = s.heads, s.v_heads, s.head_k, s.head_v
        KD = H * K
        if VD != HV * V or C != 2 * KD + VD or NP < C + VD + 2 * HV or V & (V - 1):
            raise ValueError("decode_step: the layer tensors do not have a GatedDeltaNet block's shapes (power-of-two "
                             f"head_v_dim needed; got in_proj {tuple(l0.in_proj.shape)}, o_proj "
                             f"{tuple(l0.o_proj.shape)}, conv {tuple(l0.conv_weight.shape)})")
        dev, dt = embedding.device, embedding.dtype
        buf = self._buffers(len(layers), NP, D, VD, I, dt, dev)
        tab = address_table([_table_row(layer, r) for r in range(13) for layer in layers])   # [13, L], cached
        eps = tuple(getattr(layer, f"eps_{kind}") for kind in ("attn", "o", "mlp") for layer in layers)
        if eps not in self._eps:       # made on the first (eager) call: a graph capture cannot copy from the host
            self._eps[eps] = torch.tensor(eps, dtype=torch.float32, device=dev)
        logits = torch.empty(head.shape[0], dtype=dt, device=dev)
        KC_D = min(512, triton.next_power_of_2(D))
        KR_D = triton.cdiv(triton.next_power_of_2(D), KC_D)
        KC_I = min(512, triton.next_power_of_2(I))
        KR_I = triton.cdiv(triton.next_power_of_2(I), KC_I)
        KR_O = triton.next_power_of_2(HV)
        BK = triton.next_power_of_2(K)
        bn = lambda elems: max(1, min(16, self.launch["tile_elems"] // elems))      # noqa: E731
        consts = dict(D=D, NP=NP, C=C, KD=KD, VD=VD, I=I, VOCAB=head.shape[0], H=H, HV=HV, K=K, V=V, W=W,
                      WP=triton.next_power_of_2(W), HAS_CONV_BIAS=l0.conv_bias is not None,
                      NEG_EIG=s.allow_neg_eigval, DT=TL_DTYPES[dt], A_DT=TL_DTYPES[l0.A_log.dtype],
                      DTB_DT=TL_DTYPES[l0.dt_bias.dtype],
                      KR_D=KR_D, KC_D=KC_D, KR_O=KR_O, KR_I=KR_I, KC_I=KC_I, BN_D=bn(KR_D * KC_D),
                      BN_O=bn(KR_O * V), BN_I=bn(KR_I * KC_I), BK=BK,
                      BVR=max(1, min(triton.next_power_of_2(V), 4096 // BK)), SYNC=self.launch["sync"])
        args = (tab, self._eps[eps], len(layers), token, embedding, buf["h"], buf["p"], buf["o"], buf["mixed"],
                buf["res"], buf["xm"], logits, head, head_norm, buf["bar"], buf["err"], s.eps_head, K ** -0.5)
        warps = self.launch["num_warps"]
        options = dict(num_warps=warps, num_stages=1)
        if self.launch["maxnreg"]:
            options["maxnreg"] = self.launch["maxnreg"]
        if not dev.type == "cuda":       # the interpreter runs programs one after another: one program owns all
            decode_step_kernel[(1,)](*args, **consts, **options)
            return logits
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if self.per_sm is None:
            # one program per SM is resident whatever the kernel's resources; the compiled kernel says how many more
            compiled = decode_step_kernel[(sms,)](*args, **consts, **options)
            self.n_regs = compiled.n_regs
            regs = 65536 // (max(compiled.n_regs, 1) * 32 * warps)
            smem = torch.cuda.get_device_properties(dev).shared_memory_per_multiprocessor // max(
                compiled.metadata.shared, 1)
            self.per_sm = max(1, min(self.launch["max_per_sm"], regs, smem))
            return logits
        decode_step_kernel[(sms * self.per_sm,)](*args, **consts, **options)
        return logits

    def failed(self) -> bool:
        """Whether a launch hit the barrier's spin limit (a grid that was not resident at once); host sync."""
        return any(bool(b["err"].item()) for b in self._scratch.values())
