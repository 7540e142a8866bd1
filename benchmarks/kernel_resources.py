"""CPU: registers and spills of every SpecLA kernel as compiled for the H200 (sm_90), and of the tree verify at other
launch shapes, without a GPU. Each kernel's launch at the 1.3B shapes is intercepted, compiled ahead of time
(``tests/test_kernels_compile.py``'s harness) and its PTX assembled by Triton's bundled ``ptxas -v``.

    python benchmarks/kernel_resources.py [--tree-configs] [--sass DIR]

``--sass DIR`` also writes each kernel's sm_90 SASS (Triton's bundled ``nvdisasm``) to ``DIR`` and reports its
instruction count and the body of each loop (label to backward branch): a latency-bound kernel's time follows the
instructions on its path (the tree verify's depth sweep went from 372 to 123 instructions a warp that way, found
in the SASS before it was timed).

A kernel that spills keeps part of its working set in local memory (L1/L2 round trips on its critical path): a lead
for the launch-shape sweep of ``benchmarks/bench_kernels.py``, which decides on the GPU. (The GPU's Triton may
allocate differently from this machine's: install its version beside yours for these reports.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kernels_compile import call_every_wrapper, compile_for_h200, recording_launches  # noqa: E402

from specla_kernels import pdl, tree_delta, tuning  # noqa: E402

# launch shapes of the tree verify to report beside tree_config's, per padded node count
TREE_CONFIGS = {16: [dict(num_warps=4), dict(BK=32)],
                32: [dict(num_warps=8), dict(BV=16, num_warps=2), dict(BK=32), dict(BK=32, num_warps=8)],
                64: [dict(num_warps=8), dict(BV=16), dict(BV=16, num_warps=8), dict(BV=64, num_warps=8), dict(BK=32),
                     dict(BK=32, num_warps=8)],
                128: [dict(BV=16), dict(BV=16, num_warps=16), dict(BK=32), dict(BK=16, BV=16)]}
for _bn, _configs in TREE_CONFIGS.items():   # the other solve at each size (block solve where the default sweeps)
    _configs.append(dict(SWEEP_MAX=0 if tuning.active().tree_sweeps.get(_bn) else 16))


def ptxas_resources(ptx: str) -> dict[str, int]:
    """Registers, spill stores / loads and stack bytes per thread from ``ptxas -v`` on ``ptx`` for sm_90a."""
    from triton import knobs
    from triton.backends.nvidia.compiler import ptx_get_version
    tool = knobs.nvidia.ptxas
    # the PTX may name a newer ISA than the bundled ptxas reads; Triton rewrites it the same way when it assembles
    isa = ptx_get_version(tool.version)
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {isa // 10}.{isa % 10}", ptx, count=1, flags=re.M)
    ptxas = tool.path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    numbers = dict(registers=r"Used (\d+) registers", spill_stores=r"(\d+) bytes spill stores",
                   spill_loads=r"(\d+) bytes spill loads", stack=r"(\d+) bytes stack frame")
    found = {k: re.search(p, err) for k, p in numbers.items()}
    if not all(found.values()):
        raise RuntimeError(f"unexpected ptxas output: {err[-500:]}")
    return {k: int(m.group(1)) for k, m in found.items()}


def sass_report(cubin: bytes, path: Path) -> str:
    """Write the SASS of ``cubin`` to ``path``; return its instruction count and each loop body's (in code order)."""
    from triton import knobs
    nvdisasm = Path(knobs.nvidia.ptxas.path).with_name("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    path.write_text(sass)
    count, label_at, loops = 0, {}, []
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            label_at[m.group(1)] = count
        elif re.match(r"\s+/\*[0-9a-f]+\*/", line):
            count += 1
            if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and m.group(1) in label_at:
                loops.append(count - label_at[m.group(1)])
    return f"{count} instructions, loop bodies {loops}"


def tree_launches() -> None:
    """The tree verify at the 1.3B layer (bf16) for each padded size, at tree_config's shape and the others."""
    H, K, V = 6, 256, 512
    state = torch.zeros(1, H, V, K)
    for n, configs in TREE_CONFIGS.items():
        q, k, v = (torch.zeros(1, n, H, d, dtype=torch.bfloat16) for d in (K, K, V))
        g, beta = torch.zeros(1, n, H), torch.zeros(1, n, H)
        for over in [{}] + configs:
            tree_delta.tree_gated_delta_rule(q, k, v, g, beta, torch.arange(-1, n - 1).view(1, n), state,
                                             ancestors=torch.zeros(1, n, n, dtype=torch.bool), config=over)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree-configs", action="store_true", help="only the tree verify, at several launch shapes")
    ap.add_argument("--sass", type=Path, help="write each kernel's SASS here and report instruction counts")
    args = ap.parse_args()
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    pdl.enabled = lambda device: True                # launch as on the H200
    with recording_launches() as launches:
        tree_launches() if args.tree_configs else call_every_wrapper()
    sass_column = bool(args.sass)
    print("| kernel | shape | warps | registers | spill stores B | spill loads B | stack B |" + " SASS |" * sass_column)
    print("|---|---|---|---|---|---|---|" + "---|" * sass_column)
    seen = set()
    for fn, bound, options in launches:
        shape = {k: bound[k] for k in ("BN", "BV", "BK", "BC", "KR", "KC", "PRO", "EPI", "SWEEP_MAX", "ANC_LATE")
                 if k in bound}
        key = (fn.__name__, tuple(shape.items()), options.get("num_warps"))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_for_h200(fn, bound, options)
        r = ptxas_resources(compiled.asm["ptx"])
        sass = (f" {sass_report(compiled.asm['cubin'], args.sass / f'{fn.__name__}_{len(seen)}.sass')} |"
                if args.sass else "")
        print(f"| {fn.__name__} | {shape} | {options.get('num_warps', 4)} | {r['registers']} | {r['spill_stores']} "
              f"| {r['spill_loads']} | {r['stack']} |{sass}")


if __name__ == "__main__":
    main()
