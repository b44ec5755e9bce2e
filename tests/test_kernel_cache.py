"""The kernel cache on disk (cutlass_kernels/_cache.py), on the CPU: a miss compiles and stores,
a hit loads the same object and a function that takes the same arguments; corrupt and stale
entries are compiled again with a warning; processes filling the cache at once all leave a valid
entry; ``CUTEINFER_KERNEL_CACHE=0`` keeps nothing; ``compile_all`` (_parallel.py) compiles in
worker processes, from a background thread that only ever loads (``Compiling``), while the cuda
executor allocates and uploads (a fake upload here) and cancels it when that fails.

Kernels are SiLU-and-mul at small widths (0.1-0.3 s to compile); each test uses its own widths,
as the in-memory compile cache would otherwise answer instead of the disk.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import multiprocessing
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from cutlass_kernels import _cache, _parallel
from cutlass_kernels.silu_mul import SIGNATURE, SiluMul, compile_silu_mul


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache folder, switched on."""
    monkeypatch.setenv("CUTEINFER_CACHE", str(tmp_path))
    monkeypatch.delenv("CUTEINFER_KERNEL_CACHE", raising=False)
    return tmp_path / "kernels"


def _compile(inter: int):
    """(compiled function, what it did: loaded / compiled / stored / rejected, seconds)."""
    before = _cache.STATS.copy()
    t0 = time.perf_counter()
    kernel = SIGNATURE.compile(SiluMul(inter))
    return kernel.compiled, _cache.STATS - before, time.perf_counter() - t0


def _entry(cache: Path) -> tuple[Path, dict, Path]:
    (manifest,) = cache.glob("*.json")
    entry = json.loads(manifest.read_text())
    return manifest, entry, cache / entry["object"]


def _outcome(fn) -> str:
    """What calling ``fn`` with SiluMul's arguments does here: on a CPU-only machine the call
    reaches the CUDA runtime (no driver); with 0 tokens a GPU launch is refused (empty grid)."""
    import cutlass
    from cuda.bindings import driver

    from cutlass_kernels._common import gmem_ptr

    try:
        fn(gmem_ptr("bf16", 4096), gmem_ptr("bf16", 8192), cutlass.Int32(0), driver.CUstream(0))
    except Exception as e:
        return type(e).__name__
    return "ok"


def test_miss_then_hit_loads_the_same_kernel(cache: Path) -> None:
    fresh, did, t_miss = _compile(64)
    assert did == Counter(compiled=1, stored=1)
    manifest, entry, obj = _entry(cache)
    assert entry["key"]["kernel"] == "cutlass_kernels.silu_mul.SiluMul"
    assert entry["key"]["attributes"]["inter"] == 64 and entry["key"]["arch"] == "sm_90a"
    assert not list(cache.glob(".tmp-*")), "temp files left behind"

    loaded, did, t_hit = _compile(64)
    assert did == Counter(loaded=1)
    assert t_hit < t_miss / 2, (t_hit, t_miss)
    # the same code: the stored object is what this compile exports, byte for byte
    assert obj.read_bytes() == fresh.dump_to_object(entry["prefix"])
    assert str(loaded.execution_args.signature) == str(fresh.execution_args.signature)
    assert list(loaded.kernel_info) == list(fresh.kernel_info)
    assert _outcome(loaded) == _outcome(fresh)


def test_the_key_follows_the_compile_time_parameters(cache: Path) -> None:
    _compile(80)
    _, did, _ = _compile(96)
    assert did["compiled"] == 1
    assert len(list(cache.glob("*.json"))) == 2


def test_the_source_fingerprint_covers_what_the_kernel_imports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _cache._module_file
    seen: list[str] = []
    monkeypatch.setattr(_cache, "_fingerprints", {})
    monkeypatch.setattr(_cache, "_module_file", lambda name: seen.append(name) or real(name))
    before = _cache.source_fingerprint("cutlass_kernels.rmsnorm")
    assert {"cutlass_kernels.rmsnorm", "cutlass_kernels._common",
            "cutlass_kernels._reduce"} <= set(seen)
    assert "cutlass_kernels._cache" not in seen  # the cache's own code changes no kernel

    edited = tmp_path / "_reduce.py"  # _reduce.py with one more comment line
    edited.write_bytes(real("cutlass_kernels._reduce").read_bytes() + b"# edited\n")
    monkeypatch.setattr(_cache, "_fingerprints", {})
    monkeypatch.setattr(_cache, "_module_file", lambda name: edited
                        if name == "cutlass_kernels._reduce" else real(name))
    assert _cache.source_fingerprint("cutlass_kernels.rmsnorm") != before


def _imported_by_the_ast(name: str, source: bytes, is_package: bool) -> list[str]:
    """What ``_cache._imported`` must find at least: every import statement Python sees."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return [m for m in out if m.split(".")[0] == "cutlass_kernels" and m != _cache._SELF]


def test_the_import_scan_finds_every_import_the_ast_holds() -> None:
    sources = {f"cutlass_kernels.{f.stem}": f for f in sorted(_cache.PACKAGE.glob("*.py"))}
    sources["cutlass_kernels.tricky"] = None
    tricky = (b"import cutlass_kernels._common as common  # noqa\n"
              b"from . import (silu_mul,  # a comment\n    rmsnorm as r)\n"
              b"from .gemm import \\\n    GemmSm90\n"
              b"def f():\n    import os; import cutlass_kernels.rope_kv\n")
    for name, path in sources.items():
        src = tricky if path is None else path.read_bytes()
        want = set(_imported_by_the_ast(name, src, False))
        assert want <= set(_cache._imported(name, src, False)), name
    got = set(_cache._imported("cutlass_kernels.tricky", tricky, False))
    assert {"cutlass_kernels._common", "cutlass_kernels.silu_mul", "cutlass_kernels.rmsnorm",
            "cutlass_kernels.gemm.GemmSm90", "cutlass_kernels.rope_kv"} <= got


class _SiluMulWithAnObject(SiluMul):
    def __init__(self, intermediate: int) -> None:
        super().__init__(intermediate)
        self.extra = object()  # not a plain value: the key cannot say what it is


def test_a_kernel_with_an_unknown_attribute_compiles_uncached(cache: Path) -> None:
    before = _cache.STATS.copy()
    kernel = SIGNATURE.compile(_SiluMulWithAnObject(64))
    assert _cache.STATS - before == Counter(uncacheable=1, compiled=1)
    assert kernel.compiled.kernel_info and not cache.exists()


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate object", "garble object", "delete object",
                                    "truncate manifest", "empty manifest", "garble manifest"])
def test_a_corrupt_entry_is_compiled_again(cache: Path, damage: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    first, _, _ = _compile(112)
    manifest, _, obj = _entry(cache)
    what, target = damage.split()
    path = obj if target == "object" else manifest
    if what == "truncate":
        _truncate(path)
    elif what == "garble" and target == "object":
        _garble(path)
    elif what == "garble":
        path.write_text(path.read_text().replace('"size"', '"siz"'))
    elif what == "delete":
        path.unlink()
    else:
        path.write_text("")
    with caplog.at_level(logging.WARNING, logger="cutlass_kernels._cache"):
        fn, did, _ = _compile(112)
    assert did == Counter(rejected=1, compiled=1, stored=1)
    assert any("kernel cache: ignoring" in r.getMessage() for r in caplog.records)
    assert _outcome(fn) == _outcome(first)  # a valid function
    _, did, _ = _compile(112)
    assert did == Counter(loaded=1)  # and the entry was repaired


@pytest.mark.parametrize("field, value", [("dsl", "0.0.1"), ("source", "0" * 64),
                                          ("arch", "sm_100a"), ("format", 0)])
def test_a_stale_entry_is_compiled_again(cache: Path, field: str, value: object,
                                         caplog: pytest.LogCaptureFixture) -> None:
    _compile(128)
    manifest, entry, _ = _entry(cache)
    entry["key"][field] = value
    manifest.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="cutlass_kernels._cache"):
        _, did, _ = _compile(128)
    assert did == Counter(rejected=1, compiled=1, stored=1)
    assert any("key differs" in r.getMessage() for r in caplog.records)
    assert _entry(cache)[1]["key"][field] != value


def _fill(cache_root: str, barrier, results) -> None:  # in a spawned process
    import os

    os.environ["CUTEINFER_CACHE"] = cache_root
    os.environ.pop("CUTEINFER_KERNEL_CACHE", None)
    from cutlass_kernels import _cache
    from cutlass_kernels.silu_mul import SIGNATURE, SiluMul

    op = SiluMul(136)
    barrier.wait(timeout=120)
    kernel = SIGNATURE.compile(op)
    results.put((dict(_cache.STATS), list(kernel.compiled.kernel_info)))


def test_two_processes_fill_the_cache_at_once(cache: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_fill, args=(str(cache.parent), barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    answers = [results.get(timeout=5) for _ in procs]
    assert all(info for _, info in answers)
    assert not list(cache.glob(".tmp-*"))
    _, did, _ = _compile(136)
    assert did == Counter(loaded=1)


def test_disabled_by_the_environment(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTEINFER_KERNEL_CACHE", "0")
    _, did, _ = _compile(144)
    assert did == Counter(compiled=1)
    assert not cache.exists()
    monkeypatch.setenv("CUTEINFER_KERNEL_CACHE", "maybe")
    with pytest.raises(ValueError, match="CUTEINFER_KERNEL_CACHE must be 0 or 1"):
        _compile(144)


def test_an_unwritable_cache_compiles_and_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CUTEINFER_CACHE", str(tmp_path / "file"))  # kernels/ cannot be made
    monkeypatch.setattr(_cache, "_store_warned", False)
    with caplog.at_level(logging.WARNING, logger="cutlass_kernels._cache"):
        fn, did, _ = _compile(152)
    assert did == Counter(compiled=1)
    assert any("cannot store kernels" in r.getMessage() for r in caplog.records)
    assert fn.kernel_info


def _compile_then_fail(inter: int) -> None:  # a job, run in a worker and then here
    compile_silu_mul(inter)
    raise RuntimeError(f"job {inter} failed after compiling")


def test_compile_all_fills_the_cache_in_worker_processes(cache: Path) -> None:
    jobs = {"a": (compile_silu_mul, (160,), {}), "b": (compile_silu_mul, (168,), {}),
            "a_again": (compile_silu_mul, (160,), {})}
    before = _cache.STATS.copy()
    with pytest.raises(RuntimeError, match="job 184 failed after compiling"):  # raised here
        _parallel.compile_all({**jobs, "boom": (_compile_then_fail, (184,), {})}, workers=2)
    did = _cache.STATS - before
    # a, b and boom's kernel compiled in workers, then loaded here (before boom raised)
    assert did == Counter(worker_compiled=3, loaded=3)
    assert len(list(cache.glob("*.json"))) == 3

    done: list[str] = []
    before = _cache.STATS.copy()
    out = _parallel.compile_all(jobs, done.append, workers=2)  # all in memory now: no workers
    assert _cache.STATS - before == Counter()
    assert done == list(jobs)
    assert out["a"] is out["a_again"] and out["a"].inter == 160 and out["b"].inter == 168


def test_warmup_reports_what_it_did(monkeypatch: pytest.MonkeyPatch, cache: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from engine.commands import warmup
    from engine.executor.cuda_model import Kernels

    def fake_compile(mc, show=True, workers=None):
        _cache.STATS.update(loaded=5, worker_compiled=3, compiled=1)

    monkeypatch.setattr(Kernels, "compile", fake_compile)
    assert warmup.run(argparse.Namespace(preset="tiny-qwen3", model="", workers=None)) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen3: 6 kernels" in out and "2 were in the cache, 4 compiled (3 in worker" in out


def _compiles_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads ``cute.compile`` runs in, from now on."""
    import cutlass.cute as cute

    where: list[str] = []
    real = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *a, **k: where.append(
        threading.current_thread().name) or real(*a, **k))
    return where


def test_the_thread_loads_and_never_compiles(cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    compile_silu_mul(192)  # stored: the thread loads it
    where = _compiles_in(monkeypatch)
    done: list[tuple[str, str]] = []
    jobs = {"cached": (compile_silu_mul, (192,), {}), "new": (compile_silu_mul, (200,), {})}
    # one worker: no worker processes, so "new" compiles in result(), in this thread
    pending = _parallel.Compiling(lambda: jobs, lambda name: done.append(
        (name, threading.current_thread().name)), workers=1)
    out = pending.result()
    assert done == [("cached", "cuteinfer-kernels"), ("new", "MainThread")]
    assert where == ["MainThread"] and out["new"].inter == 200 and pending.ready_at


def test_a_job_that_fails_in_the_probe_raises_here_without_workers(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(_parallel.subprocess, "Popen", lambda *a, **k: started.append(a))
    jobs = {"fine": (compile_silu_mul, (208,), {}), "bad": (compile_silu_mul, (12,), {})}
    with pytest.raises(ValueError, match="intermediate=12 must be a multiple of 8"):
        _parallel.compile_all(jobs, workers=2)
    assert not started


def test_workers_that_cannot_start_leave_the_jobs_to_the_caller(
        cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_processes(*args: object, **kwargs: object) -> None:
        raise OSError("no fork here")

    monkeypatch.setattr(_parallel.subprocess, "Popen", no_processes)
    where = _compiles_in(monkeypatch)
    jobs = {"a": (compile_silu_mul, (216,), {}), "b": (compile_silu_mul, (224,), {})}
    with caplog.at_level(logging.WARNING, logger="cutlass_kernels._parallel"):
        out = _parallel.compile_all(jobs, workers=2)
    assert any("compiling here" in r.getMessage() for r in caplog.records)
    assert where == ["MainThread"] * 2 and out["b"].inter == 224


# -- the cuda executor's start-up order, with a fake GPU ------------------------------------------

def _fake_executor(monkeypatch: pytest.MonkeyPatch, widths: list[int], allocate) -> object:
    """A CudaExecutor over tiny-qwen3 whose kernels are SiLU-and-mul at ``widths`` (round-robin
    over the Kernels fields) and whose ``_allocate`` (context, plan, upload) is ``allocate``."""
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor import cuda_executor, cuda_model
    from engine.model.synthetic import hf_config

    fields = [f.name for f in dataclasses.fields(cuda_model.Kernels)]
    monkeypatch.setattr(cuda_model, "_jobs", lambda mc: {
        name: (compile_silu_mul, (widths[i % len(widths)],), {})
        for i, name in enumerate(fields)})
    monkeypatch.setattr(cuda_executor.CudaExecutor, "_allocate", allocate)
    mc = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    ec = EngineArgs(enforce_eager=True, num_gpu_blocks_override=8).create_engine_config(mc,
                                                                                        "cuda")
    return cuda_executor.CudaExecutor(SimpleNamespace(config=mc), ec, verbose=False)


def test_the_executor_uploads_while_the_workers_compile(cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    widths = [232, 240, 248]
    seen: dict[str, int] = {}

    def upload(self, ckpt, config, verbose) -> None:  # waits for the kernels, up to a minute
        deadline = time.monotonic() + 60
        while _cache.STATS["loaded"] - seen["before"] < len(widths):
            assert time.monotonic() < deadline, "no kernel loaded during the upload"
            time.sleep(0.05)
        seen["during"] = _cache.STATS["loaded"] - seen["before"]
        self.ctx, self.arena = SimpleNamespace(name="fake"), SimpleNamespace(capacity=0)
        self.num_pages, self.kv_bytes, self.mc = 8, 0, ckpt.config
        # the weights' norm fold runs once the kernels are in (nothing to fold here)
        self.weights, self.stream = SimpleNamespace(fold_norms=lambda fold, stream: None), None

    seen["before"] = _cache.STATS["loaded"]
    before = _cache.STATS.copy()
    ex = _fake_executor(monkeypatch, widths, upload)
    # compiled by two workers and loaded by the thread while "uploading"; nothing compiled here
    assert seen["during"] == len(widths)
    assert _cache.STATS - before == Counter(worker_compiled=3, loaded=3)
    assert ex.kernels.embed.inter == 232 and ex.kernels.gather_rows.inter == 240
    assert ex.kernel_wait_s < 1.0
    assert ex.compile_s > 0


def _record_workers(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """Every worker process compile_all starts, in order."""
    procs: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args, **kwargs) -> subprocess.Popen:
        procs.append(real(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(_parallel.subprocess, "Popen", popen)
    return procs


def test_a_failed_start_kills_the_workers(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cuda.driver import CudaError

    procs = _record_workers(monkeypatch)

    def out_of_memory(self, ckpt, config, verbose) -> None:
        deadline = time.monotonic() + 60
        while len(procs) < 2:  # the workers are compiling
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raise CudaError("no room for the KV cache")

    t0 = time.monotonic()
    with pytest.raises(CudaError, match="no room"):
        _fake_executor(monkeypatch, [256, 264, 272, 280], out_of_memory)
    assert all(p.poll() is not None for p in procs)  # killed, not left compiling
    assert time.monotonic() - t0 < 20
    assert not [t for t in threading.enumerate() if t.name == "cuteinfer-kernels"]
    assert not list(cache.glob("*.json"))  # nothing finished: they were killed mid-compile


def test_with_cores_to_spare_the_workers_start_before_the_probe(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    procs = _record_workers(monkeypatch)
    monkeypatch.setattr(_parallel, "_cpus", lambda: 8)  # 3 workers fit beside the caller
    monkeypatch.setattr(_parallel, "_dsl_loaded", lambda: False)  # as in a fresh process
    jobs = {f"j{w}": (compile_silu_mul, (w,), {}) for w in (288, 296, 304)}
    at_probe: list[int] = []

    def make_jobs() -> dict:
        at_probe.append(len(procs))
        return jobs

    before = _cache.STATS.copy()
    out = _parallel.Compiling(make_jobs, expect=3).result()
    assert at_probe == [3] and len(procs) == 3  # started first, and no more after the probe
    assert _cache.STATS - before == Counter(worker_compiled=3, loaded=3)
    assert out["j296"].inter == 296 and all(p.poll() is not None for p in procs)

    procs.clear()  # warm: the early workers are killed unused
    before = _cache.STATS.copy()
    _parallel.Compiling(make_jobs, expect=3).result()
    assert len(procs) == 3 and all(p.poll() is not None for p in procs)
    assert _cache.STATS - before == Counter()  # all in memory; nothing compiled anywhere

    procs.clear()  # a process that has the DSL already probes at once: no early workers
    monkeypatch.setattr(_parallel, "_dsl_loaded", lambda: True)
    _parallel.Compiling(make_jobs, expect=3).result()
    assert procs == []
