"""Where a tree verify program spends its time on the GPU: phase timings from ``%clock64`` stamps.

    python benchmarks/probe_tree.py          # on the GPU machine; with $OUT set, $OUT/probe_tree.json

It copies ``kernels/specla_kernels/tree_delta.py`` with stamps added to the WY/UT kernel (each after an anchor line
of the source; a stamp reads the SM clock once a value its phase computed is ready, through a data dependency on a
sum of that value), runs the 21-layer verify of ``bench_kernels`` as one CUDA graph, and reports per phase the median
over programs of its cycles (the K loop from the program's start, its first loads included; the mask, gates, ``v``
and k's norms after it; decay, ``L`` and ``R``; the tree's depth; the solve; the deferred q.k pass; the output
product; the stores), and from ``%globaltimer`` each layer's span. The sums the stamps wait on add cross-warp reductions: the probed graph runs ~15% slower than the plain one,
so read the phases as shares, not as absolute times. When the kernel's source changes, an anchor that is gone
stops the probe with its text.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import LAYERS, V, bench_graph, comb_tree, drafted_tree, layer_inputs  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "specla_kernels" / "tree_delta.py"
PHASES = ["K loop (from the start)", "mask, gates, v, norms", "decay/L/R", "depth", "solve", "q.k (LATE_QK), P",
          "o product", "stores"]
STAMPS = '''
@triton.jit
def _stamp(probe, slot, dep, TIMER: tl.constexpr):
    reg: tl.constexpr = "%globaltimer" if TIMER else "%clock64"
    t = tl.inline_asm_elementwise("mov.u64 $0, " + reg + ";", "=l,r", [(dep != 0.123).to(tl.int32)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    tl.store(probe + slot, t)


'''
# (anchor line in the kernel, stamp added after it): slots 0-8 are the phase boundaries, 14 / 15 the start / end time
INSERTS = [
    ("    NV: tl.constexpr = (V + BV - 1) // BV\n",
     "    pp = probe + (i_bh * (NV + 1) + i_v) * 16\n    _stamp(pp, 14, i_v.to(tl.float32), True)\n"
     "    _stamp(pp, 0, i_v.to(tl.float32), False)\n"),
    ("                b_qk += tl.dot(b_qf, tl.trans(b_kf), input_precision=\"tf32x3\")\n",
     "        _stamp(pp, 1, tl.sum(b_kk) + tl.sum(b_ks) + tl.sum(b_qs), False)\n"),
    ("        rk = 1. / tl.sqrt(tl.sum(tl.where(eye, b_kk, 0.), 1) + 1e-6)\n",
     "        _stamp(pp, 2, tl.sum(b_vv) + tl.sum(anc.to(tl.float32)) + tl.sum(b_g) + tl.sum(b_beta)"
     " + tl.sum(rk), False)\n"),
    ("        b_l = tl.where(eye, 0., (b_beta * rk)[:, None] * decay * b_kk * rk[None, :])\n",
     "        _stamp(pp, 3, tl.sum(b_l) + tl.sum(b_r), False)\n"),
    ("            depth = tl.max(tl.sum(anc.to(tl.int32), 1), 0) - 1\n",
     "            _stamp(pp, 4, depth.to(tl.float32), False)\n"),
    ("        # ---- outputs: o = e^Γ S0 q̂ + (ancestor-masked decayed q̂ k̂^T) U\n",
     "        _stamp(pp, 5, tl.sum(b_u), False)\n"),
    ("        b_p = rq[:, None] * b_p * rk[None, :]\n", "        _stamp(pp, 6, tl.sum(b_p), False)\n"),
    ("        b_o += (eg * rq)[:, None] * b_qs\n", "        _stamp(pp, 7, tl.sum(b_o), False)\n"),
    ("        tl.store(o + p_nv, b_o.to(o.dtype.element_ty), mask=m_nv)\n",
     "        _stamp(pp, 8, i_v.to(tl.float32), False)\n        _stamp(pp, 15, i_v.to(tl.float32), True)\n"),
    ("b_k / nrm[:, None], mask=m_nk)\n", "        _stamp(pp, 15, i_v.to(tl.float32), True)\n"),   # the k̂ program
]


def probed_module():
    """``tree_delta`` with the stamps: its WY/UT kernel takes a ``[programs, 16]`` int64 buffer, set as ``PROBE``."""
    src = SOURCE.read_text()
    for anchor, stamp in INSERTS:
        if src.count(anchor) != 1:
            raise SystemExit(f"probe_tree: the kernel changed, anchor not found once: {anchor!r}")
        src = src.replace(anchor, anchor + stamp)
    kernel = '@triton.jit(do_not_specialize=["N", "n_lvl"])'
    for old, new in [("\n" + kernel, STAMPS + kernel),
                     ("    o, k_hat, u,                           # outputs\n", "    o, k_hat, u, probe,\n"),
                     ("    tree_gdn_fwd_kernel[grid](\n        *tensors, scale,",
                      "    tree_gdn_fwd_kernel[grid](\n        *tensors, PROBE, scale,")]:
        if src.count(old) != 1:
            raise SystemExit(f"probe_tree: the kernel changed, anchor not found once: {old!r}")
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / "tree_delta_probed.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tree_delta_probed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    td = probed_module()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, parents in [("drafted 64 (depth 8)", drafted_tree(64, gen)), ("comb 64 (depth 1)", comb_tree(64, 1, gen)),
                          ("drafted 32", drafted_tree(32, gen)), ("drafted 16", drafted_tree(16, gen))]:
        parents = parents.cuda()
        n = parents.shape[1]
        layers = [layer_inputs(n, gen, "cuda") for _ in range(LAYERS)]
        columns = triton.cdiv(V, td.tree_config(n, V)["BV"]) + 1          # V slices, then the k̂ program
        probes = torch.zeros(LAYERS, columns * 6, 16, dtype=torch.int64, device="cuda")
        anc = td.tree_ancestors(parents)

        def run():
            for L, probe in zip(layers, probes):
                td.PROBE = probe
                td.tree_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], parents, L["state"],
                                         ancestors=anc)
        us_21 = bench_graph(run, rep_ms=40) * 1e3
        p = probes.cpu()
        p[..., 4] = torch.where(p[..., 4] == 0, p[..., 3], p[..., 4])      # no depth stamp: the block solve alone
        main_programs = p[:, [i for i in range(columns * 6) if i % columns != columns - 1]]
        cycles = (main_programs[..., 1:9] - main_programs[..., :8]).float().reshape(-1, 8).median(0).values
        span = ((p[..., 15].max(1).values - p[..., 14].min(1).values).float() / 1e3).median().item()
        out[name] = dict(probed_graph_us_21=us_21, phase_cycles=dict(zip(PHASES, cycles.tolist())),
                         program_cycles=(main_programs[..., 8] - main_programs[..., 0]).float().median().item(),
                         layer_span_us=span)
        print(name, json.dumps(out[name]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_tree.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("\n| tree | probed 21L us | " + " | ".join(PHASES) + " | program | layer span us |")
    print("|---" * (len(PHASES) + 4) + "|")
    for name, r in out.items():
        phases = " | ".join(f"{c:.0f}" for c in r["phase_cycles"].values())
        print(f"| {name} | {r['probed_graph_us_21']:.0f} | {phases} | {r['program_cycles']:.0f} "
              f"| {r['layer_span_us']:.1f} |")


if __name__ == "__main__":
    main()
