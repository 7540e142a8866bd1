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
``stages.txt`` in it lists each stage's exit status and seconds. (Without this, a limit that kills a pipeline before
it writes loses everything the pipeline measured.)

A fresh machine spends minutes compiling Triton kernels (the 1.3B headline's warm-up took 238 s cold against 49 s
warm on an H200), and a machine left idle for half a minute is handed back. ``--triton-cache TGZ`` unpacks ``TGZ``
(when it exists) into ``$TRITON_CACHE_DIR`` before the stages and packs that folder, without the kernels'
intermediate IRs, into ``$OUT/triton-cache.tgz`` after them (give it seconds of the call's time beyond the budget),
so the next call can carry it back (copy it into the carried ``.device`` folder first). Triton keys each cached
kernel by its source, version and target, so a stale entry is recompiled, never used. A call carries 64 MiB with
the working tree: ``--triton-cache-mib`` caps the packed cache at what is left beside the tree and the wheels (the
most recently used groups are kept), or it does not travel back.
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
MAX_RETURNED_BYTES = 16 << 20    # the device tool returns no larger file from $OUT
# a cached Triton kernel loads from its binary and metadata alone (Triton 3.6's CompiledKernel; a cache group's
# missing files are skipped), so its intermediate IRs stay behind: most of the cache's bytes
IR_SUFFIXES = {".ttir", ".ttgir", ".llir", ".ptx", ".source"}
_PACKING = threading.Lock()       # the packer thread and the main loop both pack


def pack(work: Path, archive: Path) -> None:
    """``work`` as a gzipped tar at ``archive``, written beside it first so that a kill mid-write keeps the last one.
    A running stage may remove or rename a file while it is packed (a trace gzipped in place, say): it is skipped,
    and the next pack has it under its new name."""
    with _PACKING:
        tmp = archive.with_suffix(".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(work.rglob("*")):
                try:
                    tar.add(path, arcname=str(Path(work.name) / path.relative_to(work)), recursive=False)
                except FileNotFoundError:
                    continue
        os.replace(tmp, archive)


def compile_cache() -> Path:
    """Triton's compile cache folder (``$TRITON_CACHE_DIR``, which the device prelude sets)."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        raise SystemExit("--triton-cache needs TRITON_CACHE_DIR set (source .device/prelude.sh first)")
    return Path(os.environ["TRITON_CACHE_DIR"])


def restore_cache(archive: Path, cache: Path) -> str:
    """Unpack a ``pack_cache`` archive into ``cache``; what it did, in words. Triton's group files name a kernel's
    files by absolute path, so the archive serves a machine whose ``$TRITON_CACHE_DIR`` is the packing one's (the
    prelude's ``/tmp/triton-cache`` on every device machine); elsewhere its kernels are compiled again."""
    if not archive.exists():
        return f"triton cache: no {archive}, compiling from scratch"
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
        return f"triton cache: {len(tar.getmembers())} entries from {archive}"


def pack_cache(cache: Path, archive: Path, limit: int | None = None) -> str:
    """``cache``'s contents but the intermediate IRs as an xz tar at ``archive``; the fast preset, since the packing
    comes out of the call's time. Over ``limit`` bytes (default: what the device returns; less for a cache that must
    travel beside the working tree), the most recently used compile groups that fit are kept (a file's access time,
    which a relatime mount updates on the first read after extraction, else its modification time): Triton keys a
    group by its kernel's source, so the least recently used are mostly earlier versions of edited kernels, never hit
    again (a cache of a day's edits packed to 20-23 MiB, which would otherwise be dropped whole)."""
    limit = MAX_RETURNED_BYTES if limit is None else limit

    def keep(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if Path(member.name).suffix in IR_SUFFIXES else member

    def write(entries: list[Path]) -> int:
        with tarfile.open(archive, "w:xz", preset=1) as tar:
            for entry in entries:
                tar.add(entry, arcname=entry.name, filter=keep)
        return archive.stat().st_size

    def size_and_use(entry: Path) -> tuple[int, float]:
        """The bytes of ``entry`` that travel, and when it was last read or written."""
        files = [entry] if entry.is_file() else [f for f in entry.rglob("*") if f.is_file()]
        stats = [f.stat() for f in files]
        return (sum(st.st_size for f, st in zip(files, stats) if f.suffix not in IR_SUFFIXES),
                max((max(st.st_atime, st.st_mtime) for st in stats), default=0.))

    entries = sorted(cache.iterdir()) if cache.exists() else []
    size = write(entries)
    if size <= limit:
        return f"triton cache: {size / 2**20:.1f} MiB in {archive}"
    # the packed / raw ratio of the whole cache sizes the most recently used slice that should fit, with a 10% margin
    info = {entry: size_and_use(entry) for entry in entries}
    budget = 0.9 * limit * sum(raw for raw, _ in info.values()) / size
    kept, total = [], 0
    for entry in sorted(entries, key=lambda e: info[e][1], reverse=True):
        if total + info[entry][0] > budget:
            break
        kept.append(entry)
        total += info[entry][0]
    trimmed = write(sorted(kept))
    what = f"{size / 2**20:.1f} MiB packed, its {len(kept)} most recently used of {len(entries)} groups"
    if trimmed > limit:
        archive.unlink()
        return f"triton cache: {what} ({trimmed / 2**20:.1f} MiB) still over {limit / 2**20:.1f} MiB: dropped"
    return f"triton cache: {what} ({trimmed / 2**20:.1f} MiB) in {archive}"


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
    ap.add_argument("--triton-cache", type=Path, help="compile cache carried in (if it exists) and packed out")
    ap.add_argument("--triton-cache-mib", type=float,
                    help="the packed cache's size at most (default: what the device returns); a call carries 64 MiB "
                         "with the working tree, so a ~49 MiB tree leaves room for ~10")
    args = ap.parse_args()
    if args.triton_cache:
        print(restore_cache(args.triton_cache, compile_cache()), flush=True)
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
    if args.triton_cache:
        limit = None if args.triton_cache_mib is None else int(args.triton_cache_mib * 2**20)
        print(pack_cache(compile_cache(), args.out / "triton-cache.tgz", limit), flush=True)


if __name__ == "__main__":
    main()
