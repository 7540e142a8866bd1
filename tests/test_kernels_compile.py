"""Every SpecLA Triton kernel compiles for the H200 (sm_90), checked on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as Python and accepts code the compiler refuses (a non-constexpr
global read inside a kernel failed only on the GPU, costing a device call). Here each kernel wrapper is called at the
1.3B layer's shapes with its launch intercepted: the arguments it would launch with are turned into a signature and
compiled ahead of time to a cubin for ``GPUTarget("cuda", 90, 32)`` with Triton's bundled ptxas. Nothing runs.
"""
import contextlib

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from specla_kernels.tree_delta import INTERPRETED

pytestmark = pytest.mark.skipif(INTERPRETED, reason="compiles kernels: needs Triton without the interpreter")

TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
            torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


@contextlib.contextmanager
def recording_launches():
    """Record ``(kernel, arguments, launch options)`` of every Triton launch inside the block instead of launching."""
    recorded, run = [], JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        bound = dict(zip(self.arg_names, args)) | kwargs
        recorded.append((self, bound, options))

    JITFunction.run = record
    try:
        yield recorded
    finally:
        JITFunction.run = run


@pytest.fixture
def launches():
    with recording_launches() as recorded:
        yield recorded


def compile_for_h200(fn: JITFunction, bound: dict, options: dict):
    """The recorded launch compiled ahead of time for sm_90 (checked: a cubin, and a PDL launch waits), specialised
    as the JIT specialises a launch: pointers 16-byte aligned and integers divisible by 16 marked so (``do_not_
    specialize`` integers not), which decides whether loads are vectorised and so the registers ptxas reports."""
    signature, constexprs, attrs = {}, {}, {}
    for param in fn.params:
        value = bound[param.name]
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TL_TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[param.name], aligned = "i1", False
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            aligned = value % 16 == 0 and not param.do_not_specialize
        else:
            signature[param.name], aligned = "fp32", False
        if aligned and not param.do_not_specialize_on_alignment:
            attrs[(param.num,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("cubin"), fn.__name__
    if options.get("launch_pdl"):   # may start before the previous kernel ends: must wait for it (specla_kernels.pdl)
        assert "griddepcontrol.wait" in compiled.asm["ptx"], fn.__name__
    return compiled


def call_every_wrapper():
    """Each SpecLA kernel wrapper once per distinct compile (1.3B layer shapes, bf16 model, fp32 state)."""
    from specla_kernels import (accept, commit, draft_expand, draw, fused_gemm, gate, gated_norm, gemv, input_norm,
                                log_softmax, masked_attention, topk, tree_conv, tree_delta)
    bf, f32 = torch.bfloat16, torch.float32
    H, K, V, D, W, N = 6, 256, 512, 2 * 6 * 256 + 6 * 512, 4, 64
    z = lambda *shape, dtype=bf: torch.zeros(*shape, dtype=dtype)                  # noqa: E731
    parents = torch.arange(-1, N - 1).view(1, N)
    state = z(1, H, V, K, dtype=f32)
    # each size's default (tree_delta.SWEEPS: sweeps with the block solve as fallback at 64 and 128 nodes, the block
    # solve elsewhere), and the other solves at 32 and 64 nodes
    for n, dtype, over in ((16, bf, {}), (32, bf, {}), (64, bf, {}), (128, bf, {}), (32, f32, {}),
                           (32, bf, dict(SWEEP_MAX=16)), (64, bf, dict(SWEEP_MAX=0))):
        tree_delta.tree_gated_delta_rule(z(1, n, H, K, dtype=dtype), z(1, n, H, K, dtype=dtype),
                                         z(1, n, H, V, dtype=dtype), z(1, n, H, dtype=f32), z(1, n, H, dtype=f32),
                                         parents[:, :n], state, config=over)
    for n in (1, 4, 8):                          # the node-by-node kernel (the default up to 4 nodes)
        tree_delta.tree_gated_delta_rule(z(1, n, H, K), z(1, n, H, K), z(1, n, H, V), z(1, n, H, dtype=f32),
                                         z(1, n, H, dtype=f32), parents[:, :n], state, config=dict(SMALL=True))
    gate.gdn_gate_beta(z(1, N, H), z(1, N, H), z(H, dtype=f32), z(H, dtype=f32))
    gated_norm.rms_norm_gated(z(1, N, H, V), z(1, N, H, V), z(V), None, 1e-5)
    input_norm.embed_norm_cat(z(8192, 2048), torch.zeros(9, dtype=torch.long), z(9, 2048), z(2048), 1e-6, z(2048),
                              1e-6)
    input_norm.embed_norm_cat(z(248320, 4096), torch.zeros(9, dtype=torch.long), z(9, 4096), z(4096, dtype=f32), 1e-6,
                              z(4096, dtype=f32), 1e-6, feature_first=True)      # the MTP head's unit-offset scales
    x = z(1, N, D)
    tree_conv.tree_conv(x, z(D, W), None, z(1, D, W), parents, x_out=z(1, N, D))
    tree_conv.tree_conv_gates(x, z(D, W), None, z(1, D, W), parents, z(1, N, H), z(1, N, H), z(H, dtype=f32),
                              z(H, dtype=f32), x_out=z(1, N, D))
    tree_delta.tree_ancestors(parents)
    path, length = torch.arange(N)[None], torch.full((1,), N)
    commit.commit_(path, length, states=([state, state.clone()], [z(1, N, H, K, dtype=f32)] * 2,
                                         [z(1, N, H, V, dtype=f32)] * 2, [z(1, N, H, dtype=f32)] * 2),
                   windows=([x, x.clone()], [z(1, D, W), z(1, D, W)]))
    commit.commit_(path[:, :9], length, tile=dict(BP=32),            # one chunk of a short path, wider
                   states=([state], [z(1, N, H, K, dtype=f32)], [z(1, N, H, V, dtype=f32)], [z(1, N, H, dtype=f32)]),
                   windows=([x], [z(1, D, W)]))
    # the hybrids' attention layers (Qwen3.5: 2 KV heads of 256), the path as the acceptance hands it over
    kv = [z(1, 2, 512, 256) for _ in range(4)]
    masked_attention.attention_mask(torch.zeros(1, dtype=torch.long), tree_delta.tree_ancestors(parents), N, 2048, bf)
    masked_attention.attention_mask(torch.zeros(1, dtype=torch.long), None, 1, 2048, bf)
    q, mask = z(1, 8, 16, 256).transpose(1, 2).contiguous().transpose(1, 2), z(1, 1, 16, 512)
    for splits in (1, None):                      # one slot range (normalised in place), several (merged)
        masked_attention.masked_attention(q, kv[0], kv[1], mask, 0.0625, splits, gate=z(1, 16, 8, 2, 256)[..., 1, :])
    commit.commit_kv_(path[:, :9], length, kv[:2], kv[2:], [torch.zeros(1, dtype=torch.long)] * 2)
    tokens, cap = torch.zeros(N, dtype=torch.long), 9
    accept.accept_walk(tokens, parents[0], tree_delta.tree_ancestors(parents)[0], cap, argmax=tokens)
    accept.accept_walk(tokens, parents[0], tree_delta.tree_ancestors(parents)[0], cap, hit=z(N, dtype=torch.bool))
    accept.drawn_hits(tokens, parents[0], z(N, 8192, dtype=f32), z(N, 8192, dtype=f32), z(N, dtype=f32), 4)
    topk.row_topk(z(4, 16384), 4)
    log_softmax.log_softmax(z(4, 32768))                                        # a row in registers
    log_softmax.log_softmax(z(1, 248320, dtype=f32))                            # a row read twice
    seed = torch.zeros(1, dtype=torch.long)
    draw.draw_children(z(4, 8192, dtype=f32), 4, 0.7, 50, z(4, 8192, dtype=f32), seed=seed)   # a top-k warper
    draw.draw_children(z(4, 8192), 4, 0.7, 50, z(4, 8192, dtype=f32), seed=seed)   # bf16 logits: 16-bit keys
    draw.draw_children(z(4, 8192, dtype=f32), 4, 1.0, 0, z(4, 8192, dtype=f32), seed=seed)
    draw.draw_children(z(4, 8192, dtype=f32), 4, 0.7, 20, z(4, 8192, dtype=f32), seed=seed, top_p=0.95)  # top-p
    draw.warped_log_probs(z(64, 16384, dtype=f32), 0.7, 0, z(64, 16384, dtype=f32), top_p=0.9)
    draw.draw_children(z(4, 248320, dtype=f32), 4, 1.0, 0, z(4, 248320, dtype=f32), seed=seed)
    draw.warped_probs_sliced(z(64, 248320), 0.7, 20, top_p=0.95)              # a target's rows, Qwen's warpers
    draw.warped_probs_sliced(z(64, 248320, dtype=f32), 1.0, 50)
    draft_expand.expand_frontier(z(4, 4, dtype=f32), z(4, 4, dtype=f32), torch.zeros(4, 4, dtype=torch.long),
                                 z(4, dtype=f32),
                                 torch.zeros(4, dtype=torch.long), z(3, 64, dtype=torch.float64),
                                 torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long),
                                 z(4, dtype=f32), torch.zeros(4, dtype=torch.long), 5, 0)
    hid, w = 2048, z(2048)
    gemv.gemv(z(9280, hid), z(hid), norm=(w, 1e-6), conv=(z(D, W), z(D, W), None))
    gemv.gemv(z(hid, H * V), z(H * V), norm=(z(V), 1e-5), gate=z(H * V))
    gemv.gemv(z(2 * 5632, hid), z(hid), norm=(w, 1e-6), add=z(hid), add_out=z(hid))
    gemv.gemv(z(hid, 5632), z(2 * 5632), swiglu=True, residual=z(hid))
    gemv.gemv(z(hid, H * V), z(H * V), norm=(z(V), 1e-5), gate=z(H * V), split=512)   # split-K
    gemv.gemv(z(hid, 5632), z(2 * 5632), swiglu=True, residual=z(hid), split=512)
    gemv.gemv(z(9280, hid), z(hid), norm=(w, 1e-6), conv=(z(D, W), z(D, W), None), split=1024)   # and wide ones
    gemv.gemv(z(2 * 5632, hid), z(hid), norm=(w, 1e-6), add=z(hid), add_out=z(hid), split=512)
    gemv.gemv(z(2 * 5632, hid), z(hid), norm=(w, 1e-6), add=z(hid), add_out=z(hid), split=0,   # three stages
              config=dict(BN=4, PER_SM=2, STAGES=3, num_warps=8))
    # the verify pass's products at 16 rows, whole rows and K slices; the gated norm at 64 rows (one stage); one
    # token's input projection with the conv epilogue
    whole, sliced = dict(BN=64, BK=128, KS=0, num_stages=4), dict(BN=32, BK=512, KS=1024, num_stages=3)
    for config in (whole, sliced):
        fused_gemm.fused_gemm(z(9280, hid), z(16, hid), norm=(w, 1e-6), config=config)
        fused_gemm.fused_gemm(z(2 * 5632, hid), z(16, hid), norm=(w, 1e-6), add=z(16, hid), add_out=z(16, hid),
                              config=config)
        fused_gemm.fused_gemm(z(hid, 5632), z(16, 2 * 5632), swiglu=True, residual=z(16, hid), config=config)
    fused_gemm.fused_gemm(z(hid, H * V), z(16, H * V), norm=(z(V), 1e-5), gate=z(16, H * V), config=sliced)
    fused_gemm.fused_gemm(z(9280, hid), z(1, hid), norm=(w, 1e-6), conv=(z(D, W), z(D, W), None), config=sliced)
    fused_gemm.fused_gemm(z(hid, H * V), z(64, H * V), norm=(z(V), 1e-5), gate=z(64, H * V),
                          config=dict(BN=16, BK=512, KS=0, num_warps=8, num_stages=1))


def test_every_kernel_compiles_for_sm90(launches, monkeypatch):
    from specla_kernels import pdl, tuning
    monkeypatch.setattr(pdl, "enabled", lambda device: True)     # launch as on the H200 (no GPU here)
    call_every_wrapper()
    with tuning.using(pdl_small_kernels=True):                  # and the verify pass's small kernels with PDL
        call_every_wrapper()
    names = {fn.__name__ for fn, _, _ in launches}
    assert {"tree_gdn_fwd_kernel", "tree_gdn_small_kernel", "ancestors_kernel", "gate_beta_kernel",
            "rms_norm_gated_kernel", "tree_conv_kernel", "commit_kernel", "row_topk_slices_kernel",
            "row_topk_merge_kernel", "expand_frontier_kernel", "gemv_kernel", "gemv_split_kernel",
            "fused_gemm_kernel", "commit_kv_kernel", "accept_walk_kernel", "drawn_rank_kernel",
            "draw_row_kernel", "draw_slices_kernel", "draw_merge_kernel",
            "draw_logq_kernel", "warp_slices_kernel", "warp_merge_kernel", "warp_write_kernel",
            "attention_mask_kernel", "embed_norm_cat_kernel", "masked_attention_split_kernel",
            "masked_attention_merge_kernel", "log_softmax_kernel"} <= names, names
    assert all(options.get("launch_pdl") for fn, _, options in launches if "gemv" in fn.__name__
               or fn.__name__ == "fused_gemm_kernel")
    small = {"tree_gdn_fwd_kernel", "tree_gdn_small_kernel", "gate_beta_kernel", "rms_norm_gated_kernel",
             "tree_conv_kernel"}
    assert {fn.__name__ for fn, _, options in launches if options.get("launch_pdl")} >= small
    seen = set()
    for fn, bound, options in launches:
        key = (fn.__name__, repr(sorted((k, v if not isinstance(v, torch.Tensor) else v.dtype)
                                        for k, v in bound.items())))
        if key not in seen:
            seen.add(key)
            compile_for_h200(fn, bound, options)


def test_state_and_weight_streams_are_128_bit(launches):
    """The commit streams every layer's state (63 MiB at the 1.3B shape) through addresses it loads from a table,
    whose alignment Triton cannot see: it must mark them (``ALIGN``) to get 128-bit accesses, else it moves 4 bytes
    at a time. The GEMV's weight stream, from a pointer argument, must be 128-bit too."""
    from specla_kernels import commit, gemv
    H, K, V, N = 6, 256, 512, 16
    states = ([torch.zeros(1, H, V, K)], [torch.zeros(1, N, H, K)], [torch.zeros(1, N, H, V)], [torch.zeros(1, N, H)])
    for align in (16, 1):
        commit.commit_(torch.arange(N)[None], torch.ones(1, dtype=torch.long), states=states, tile=dict(ALIGN=align))
    gemv.gemv(torch.zeros(4096, 2048, dtype=torch.bfloat16), torch.zeros(2048, dtype=torch.bfloat16))
    (c_16, b_16, o_16), (c_1, b_1, o_1), (g, b_g, o_g) = launches
    hinted, unhinted = (compile_for_h200(c, b, o).asm["ptx"] for c, b, o in ((c_16, b_16, o_16), (c_1, b_1, o_1)))
    assert "ld.global.v4.b32" in hinted and "st.global.v4.b32" in hinted
    assert "st.global.v4.b32" not in unhinted          # the test sees the difference the hint makes
    assert "ld.global.v4.b32" in compile_for_h200(g, b_g, o_g).asm["ptx"]


def test_probe_tree_anchors_are_in_the_kernel():
    """``benchmarks/probe_tree.py`` adds its clock stamps after anchor lines of the tree verify's source: a kernel edit
    that moves one must show here, not on the next device call."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_tree.py"
    spec = importlib.util.spec_from_file_location("probe_tree", path)
    probe_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_tree)
    assert hasattr(probe_tree.probed_module(), "_stamp")


def test_fused_gemm_autotuner_prunes_and_compiles_each_verify_product(launches, monkeypatch):
    """The autotuned ``fused_gemm`` launch, as a GPU makes it (timings stubbed, launches intercepted): the autotuner
    calls ``_prune`` with the launch's positional arguments apart from its keywords, and the launch it keeps for
    each verify product of the 1.3B shape (bf16 and fp32, 16 and 64 rows, one token with the conv) compiles for
    sm_90 within the H200's shared memory."""
    from specla_kernels import fused_gemm, pdl
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))      # take the autotuned path
    monkeypatch.setattr(fused_gemm._tuned, "cache_results", False)
    monkeypatch.setattr(fused_gemm._tuned, "_bench", lambda *a, config, **kw: [float(id(config) % 7)] * 3)
    monkeypatch.setattr(fused_gemm._tuned, "cache", {})
    pruned = []
    prune = fused_gemm._tuned.early_config_prune
    monkeypatch.setattr(fused_gemm._tuned, "early_config_prune", lambda *a, **kw: pruned.append(prune(*a, **kw))
                        or pruned[-1])
    hid, vd, inter, hd, proj, conv = 2048, 3072, 5632, 512, 9280, 6144
    for dtype in (torch.bfloat16, torch.float32):
        z = lambda *shape: torch.zeros(*shape, dtype=dtype)                          # noqa: E731
        for M in (16, 64):
            fused_gemm.fused_gemm(z(proj, hid), z(M, hid), norm=(z(hid), 1e-6))
            fused_gemm.fused_gemm(z(hid, vd), z(M, vd), norm=(z(hd), 1e-5), gate=z(M, vd))
            fused_gemm.fused_gemm(z(2 * inter, hid), z(M, hid), norm=(z(hid), 1e-6), add=z(M, hid), add_out=z(M, hid))
            fused_gemm.fused_gemm(z(hid, inter), z(M, 2 * inter), swiglu=True, residual=z(M, hid))
        fused_gemm.fused_gemm(z(proj, hid), z(1, hid), norm=(z(hid), 1e-6), conv=(z(conv, 4), z(conv, 4), None))
    assert len(pruned) == len(launches) == 18 and all(pruned)
    for fn, bound, options in launches:
        assert fn.__name__ == "fused_gemm_kernel"
        assert compile_for_h200(fn, bound, options).metadata.shared <= fused_gemm.SHARED_BYTES
