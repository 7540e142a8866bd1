"""Run a device call's benchmark stages under one time budget, keeping whatever each stage wrote even when a stage (or
the call) is cut at its limit.

    python benchmarks/device_stages.py --budget 560 \\
        "kernels:300:python benchmarks/bench_kernels.py --nodes 16,32,64" \\
        "ab:240:python benchmarks/profile_step.py --out {work}/ab --ab small,pdl_small --ab-only"

Each stage is ``name:seconds:command``. Stages run one after another, each under ``min(seconds, what is left of the
budget)``; once under 20 s of the budget are left, the remaining stages are skipped. A stage's output goes to
``{work}/{name}.log`` as it is printed (``{work}`` in a command is the work folder, ``$OUT/stages`` by default, so
files a stage writes there come back too), and the whole work folder is packed into ``$OUT/stages.tgz`` every 15 s
and after each stage: a stage killed at its limit, or the call killed at the device's, loses at most the last 15 s.
``stages.txt`` in it lists each stage's exit status and seconds. (Session 11 lost a profile and half a test run to limits that killed a pipeline before it wrote.)
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

PACK_EVERY_S = 15
MIN_STAGE_S = 20
_PACKING = threading.Lock()       # the packer thread and the main loop both pack


def pack(work: Path, archive: Path) -> None:
    """``work`` as a gzipped tar at ``archive``, written beside it first so that a kill mid-write keeps the last one."""
    with _PACKING:
        tmp = archive.with_suffix(".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(work, arcname=work.name)
        os.replace(tmp, archive)


def run(command: list[str], log: Path, limit: float) -> int | str:
    """``command`` with its output in ``log``; at ``limit`` seconds its whole process group is killed (a test run's
    child processes too)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "cut at its limit"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stages", nargs="+", help="name:seconds:command")
    ap.add_argument("--budget", type=float, required=True, help="seconds for all stages together")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = ap.parse_args()
    work = args.out / "stages"
    work.mkdir(parents=True, exist_ok=True)
    archive = args.out / "stages.tgz"
    start = time.monotonic()
    done = threading.Event()

    def packer():
        while not done.wait(PACK_EVERY_S):
            pack(work, archive)
    threading.Thread(target=packer, daemon=True).start()

    summary = work / "stages.txt"
    for stage in args.stages:
        name, seconds, command = stage.split(":", 2)
        left = args.budget - (time.monotonic() - start)
        limit = min(float(seconds), left)
        if left < MIN_STAGE_S:
            line = f"{name}: skipped ({left:.0f} s left of the budget)"
        else:
            t = time.monotonic()
            rc = run(shlex.split(command.replace("{work}", str(work))), work / f"{name}.log", limit)
            what = rc if isinstance(rc, str) else f"exit {rc}"
            line = f"{name}: {what} in {time.monotonic() - t:.0f} s (limit {limit:.0f} s)"
        with open(summary, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        pack(work, archive)
    done.set()
    pack(work, archive)


if __name__ == "__main__":
    main()
