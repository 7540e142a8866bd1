"""benchmarks/device_stages.py: stages run under one budget; a stage cut at its limit loses neither what it wrote nor
the stages after it, and its child processes die with it."""
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_stages.py"


def load_script():
    """The script as a module, to call its functions."""
    spec = importlib.util.spec_from_file_location("device_stages", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_keep_their_output_when_cut(tmp_path):
    marker = tmp_path / "still_running"
    stages = ["first:30:python -c 'print(\"one\")'",
              # writes a file, starts a child that would outlive it, then overruns its 3 s limit
              f"slow:3:bash -c 'echo partial > {{work}}/partial.txt; (sleep 8; touch {marker}) & sleep 60'",
              "last:30:python -c 'print(\"three\")'"]
    out = subprocess.run([sys.executable, str(SCRIPT), "--budget", "60", "--out", str(tmp_path), *stages],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with tarfile.open(tmp_path / "stages.tgz") as tar:
        files = {m.name: m for m in tar.getmembers()}
        summary = tar.extractfile(files["stages/stages.txt"]).read().decode()
        assert tar.extractfile(files["stages/partial.txt"]).read().decode() == "partial\n"
        assert tar.extractfile(files["stages/last.log"]).read().decode() == "three\n"
    assert "first: exit 0" in summary and "slow: cut at its limit" in summary and "last: exit 0" in summary
    subprocess.run(["sleep", "7"])
    assert not marker.exists(), "the cut stage's child process survived it"


def test_triton_cache_is_carried_in_and_packed_out(tmp_path):
    """``--triton-cache``: a call packs the compile cache it leaves; the next, on an empty cache, starts from it."""
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "cache" / "abc").mkdir(parents=True)
    (first / "cache" / "abc" / "kernel.cubin").write_bytes(b"\x7fELF compiled")
    (first / "cache" / "abc" / "kernel.ptx").write_text("// an intermediate IR: not carried")
    run = lambda out, stage: subprocess.run(                                     # noqa: E731
        [sys.executable, str(SCRIPT), "--budget", "60", "--out", str(out), "--triton-cache",
         str(first / "triton-cache.tgz"), stage], capture_output=True, text=True, timeout=60,
        env={**os.environ, "TRITON_CACHE_DIR": str(out / "cache")})
    out = run(first, "noop:30:true")
    assert out.returncode == 0 and "compiling from scratch" in out.stdout, out.stdout + out.stderr
    assert (first / "triton-cache.tgz").exists()
    out = run(second, f"check:30:test -f {second}/cache/abc/kernel.cubin")
    assert out.returncode == 0 and "entries from" in out.stdout, out.stdout + out.stderr
    assert "check: exit 0" in (second / "stages" / "stages.txt").read_text()
    assert (second / "cache" / "abc" / "kernel.cubin").read_bytes() == b"\x7fELF compiled"
    assert not (second / "cache" / "abc" / "kernel.ptx").exists()


def test_pack_skips_a_file_removed_while_packing(tmp_path, monkeypatch):
    """A stage may rename a file while the packer walks its folder (a trace gzipped in place, say): the file is
    skipped, the rest packed, and nothing raises."""
    stages = load_script()
    work = tmp_path / "stages"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "kept.txt").write_text("kept")
    gone = work / "trace.json"
    walk = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: [*walk(self, pattern), gone])  # listed, then gone
    stages.pack(work, tmp_path / "stages.tgz")
    with tarfile.open(tmp_path / "stages.tgz") as tar:
        assert tar.extractfile("stages/sub/kept.txt").read() == b"kept"
        assert "stages/trace.json" not in tar.getnames()


def test_cache_over_the_limit_keeps_its_most_recently_used_groups(tmp_path, monkeypatch):
    """A Triton cache that packs over what the device returns keeps its most recently used compile groups that fit
    (the others are mostly earlier versions of edited kernels), not nothing; intermediate IRs never travel."""
    stages = load_script()
    monkeypatch.setattr(stages, "MAX_RETURNED_BYTES", 200_000)
    cache = tmp_path / "cache"
    for i in range(10):          # 10 groups of 50 kB incompressible bytes, group 9 the most recently used
        group = cache / f"group{i}"
        group.mkdir(parents=True)
        for name in ("kernel.cubin", "kernel.ptx"):
            (group / name).write_bytes(os.urandom(50_000))
            os.utime(group / name, (1000 + i, 1000 + i))
    message = stages.pack_cache(cache, tmp_path / "cache.tar.xz")
    assert "most recently used" in message
    archive = tmp_path / "cache.tar.xz"
    assert archive.stat().st_size <= 200_000
    with tarfile.open(archive) as tar:
        groups = {Path(name).parts[0] for name in tar.getnames()}
        assert not any(name.endswith(".ptx") for name in tar.getnames())
    assert groups == {f"group{i}" for i in range(10 - len(groups), 10)} and 1 <= len(groups) < 10
    # a smaller limit (what a call can carry beside the working tree) keeps fewer of the newest groups
    stages.pack_cache(cache, archive, limit=100_000)
    with tarfile.open(archive) as tar:
        fewer = {Path(name).parts[0] for name in tar.getnames()}
    assert archive.stat().st_size <= 100_000 and fewer < groups and "group9" in fewer
