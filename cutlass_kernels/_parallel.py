"""Compiling a model's kernels in parallel: worker processes fill the disk cache (_cache.py).

``Compiling(make_jobs)`` starts a background thread that runs a model's ``compile_*`` calls
(jobs): first each one while probing the cache (its kernels load; the first missing one stops the
job, nothing is compiled), then the jobs left over in worker processes that compile them and
store them in the cache, loading each one as its worker answers. The caller meanwhile does what
needs no kernel (on the cuda backend: allocate and upload the weights) and then ``result()``
waits for the thread and runs here, in the calling thread, whatever is still missing (a job whose
worker failed, or every one when no worker could start): it compiles, or raises the job's error,
as without workers. ``compile_all`` is both in one call.

The thread never traces or compiles: the DSL's MLIR location context is per thread and tracing in
two threads at once fails, so a job only ever compiles in ``result()`` or in a worker. Importing
the DSL and loading exported kernels (``load_module``: JIT-linking a host object; the cubin
reaches the GPU at the first launch) work from any thread. Workers are ``python -c`` processes fed
pickled jobs on stdin, so a user's ``__main__`` is never re-run (as ``multiprocessing``'s spawn
would), and each is handed the next job as it answers. With cores to spare they start with the
thread, before the probe, and import the DSL while it runs (killed, unused, if nothing is
missing): a cold start's first compile then waits for one DSL import, not two in a row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cutlass_kernels._cache import STATS, CacheMiss, probing
from engine import envs

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent
Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]  # fn(*args, **kwargs)
POLL_S = 0.1  # how often the thread looks for a cancel while workers compile


def compile_all(jobs: dict[str, Job], on_done: Callable[[str], None] = lambda name: None,
                workers: int | None = None) -> dict[str, Any]:
    """``{name: fn(*args, **kwargs)}`` for jobs that call ``compile_*`` functions: ``Compiling``
    started and waited for."""
    return Compiling(lambda: jobs, on_done, workers).result()


class Compiling:
    """The jobs ``make_jobs()`` returns (called in the thread: importing the kernel modules is
    most of a warm start), under way in a background thread. Jobs whose kernels are all in the
    disk cache load there; the others are compiled by up to ``workers`` processes (default
    ``envs.compile_workers()``, else one per CPU core), which store them in the cache, and load
    as each is stored. Without a writable cache, or with one worker, ``result()`` compiles them
    one after another. ``on_done(name)`` once per job, as each is ready, from either thread.

    ``expect``: how many distinct jobs there will be. In a process that has not imported the DSL
    yet, on a host with cores to spare beyond the caller's two threads, that many workers (at
    most) start at once, importing the DSL while the thread does and probes the cache, and are
    killed if nothing is missing: a cold start then does not wait for two DSL imports one after
    the other (here, then in each worker)."""

    def __init__(self, make_jobs: Callable[[], dict[str, Job]],
                 on_done: Callable[[str], None] = lambda name: None,
                 workers: int | None = None, expect: int = 0) -> None:
        self._make_jobs, self._on_done, self._expect = make_jobs, on_done, expect
        self._limit = workers or envs.compile_workers() or _cpus()
        self._jobs: dict[str, Job] = {}
        self._results: dict[str, Any] = {}
        self._broken: str | None = None  # a job that raised while probing: result() reruns it
        self._error: BaseException | None = None  # make_jobs or the thread itself failed
        self._cancel = threading.Event()
        self._pool: _Pool | None = None
        self.ready_at: float | None = None  # perf_counter() when every job had its result
        self._thread = threading.Thread(target=self._run, name="cuteinfer-kernels", daemon=True)
        self._thread.start()

    def result(self) -> dict[str, Any]:
        """Wait for the thread; compile here what it could not load; ``{name: result}``."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        left = [n for n in self._jobs if n not in self._results]
        if self._broken in left:  # its error first, as a probe here would have raised it
            left.remove(self._broken)
            left.insert(0, self._broken)
        for name in left:  # loads what the workers stored; compiles what they could not
            fn, args, kwargs = self._jobs[name]
            self._results[name] = fn(*args, **kwargs)
            self._on_done(name)
        if left:
            self.ready_at = time.perf_counter()
        return {name: self._results[name] for name in self._jobs}

    def cancel(self) -> None:
        """Stop (the caller failed and will not want the kernels): workers are killed, no more
        jobs load. Waits for the thread, which may be inside an import."""
        self._cancel.set()
        self._thread.join()

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            early = min(self._expect, self._limit, _cpus() - 2)
            if early >= 2 and not _dsl_loaded() and _cache_writable():
                with contextlib.suppress(Exception):  # tried again (and reported) on a miss
                    self._pool = _Pool(early)
            with probing():  # contextvars are per thread: this thread only ever probes
                self._jobs = self._make_jobs()
                missing: list[str] = []
                for name in self._jobs:
                    if self._cancel.is_set() or self._broken is not None:
                        return  # result() runs the broken job first and raises its error
                    if not self._load(name):
                        missing.append(name)
                if missing and self._broken is None:
                    self._compile_missing(missing)
        except BaseException as e:  # noqa: BLE001 -- raised again by result()
            self._error = e
        finally:
            if self._pool is not None:
                self._pool.close()
            if len(self._results) == len(self._jobs):
                self.ready_at = time.perf_counter()

    def _load(self, name: str) -> bool:
        """Job ``name`` from the cache alone; False when a kernel of it is missing (or it
        raised: then ``result()`` runs it first and raises its error there)."""
        if name in self._results:
            return True
        fn, args, kwargs = self._jobs[name]
        try:
            self._results[name] = fn(*args, **kwargs)
        except CacheMiss:
            return False
        except Exception as e:
            log.debug("kernel job %s failed while probing the cache: %s", name, e)
            self._broken = self._broken or name
            return False
        self._on_done(name)
        return True

    def _compile_missing(self, missing: list[str]) -> None:
        distinct: dict[str, list[str]] = {}  # one compile per distinct call
        for name in missing:
            fn, args, kwargs = self._jobs[name]
            key = f"{fn.__module__}.{fn.__qualname__}{args!r}{sorted(kwargs.items())!r}"
            distinct.setdefault(key, []).append(name)
        groups = list(distinct.values())
        n = min(self._limit, len(groups))
        if n <= 1 or not _cache_writable():
            return  # result() compiles them, one after another
        try:
            if self._pool is None:
                self._pool = _Pool(n)
            self._pool.grow(n)
        except Exception as e:  # no worker could start (an embedded interpreter, no fork)
            log.warning("kernel cache: compiling in worker processes failed (%s: %s); "
                        "compiling here", type(e).__name__, e)
            if self._pool is None or not self._pool.procs:
                return

        def stored(index: int) -> None:
            for name in groups[index]:
                self._load(name)

        self._pool.run([self._jobs[g[0]] for g in groups], stored, self._cancel)
        for name in missing:  # stored by another group's worker (a kernel two jobs share)
            if not self._cancel.is_set():
                self._load(name)


def _dsl_loaded() -> bool:
    """True when this process has imported the DSL already: its probe takes no import then, so
    workers started before it would gain nothing (a second executor in a test or a tool)."""
    return "cutlass" in sys.modules


def _cache_writable() -> bool:
    return envs.kernel_cache_enabled() and _writable(envs.kernel_cache_dir())


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _writable(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            return True
    except OSError:
        return False


_WORKER = "from cutlass_kernels._parallel import _worker; _worker()"


class _Pool:
    """Compile worker processes, handed the next job as each answers. Started before the jobs
    are known, each imports the DSL while it waits for its first job (what a worker spends
    before it compiles anything: ~1.5 s)."""

    def __init__(self, n: int) -> None:
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(PACKAGE.parent)] + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH")
                                     else []))
        self.errors = tempfile.TemporaryFile()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failed = False
        try:
            self.grow(n)
        except BaseException:
            self.close()
            raise

    def grow(self, n: int) -> None:
        """Up to ``n`` workers."""
        while len(self.procs) < n:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self.errors, env=self.env))

    def run(self, jobs: list[Job], finished: Callable[[int], None],
            cancel: threading.Event) -> None:
        """Run ``jobs`` (a worker without one is told to exit); ``finished(index)`` as each
        succeeds. A job that fails or whose worker dies is logged (debug) and left to the
        caller. Returns early when ``cancel`` is set."""
        queue = [pickle.dumps((i, pickle.dumps(job))) for i, job in enumerate(jobs)]
        queue.reverse()  # pop() from the end hands them out in the caller's order

        def send(p: subprocess.Popen[bytes]) -> bool:
            assert p.stdin is not None
            job = queue.pop() if queue else None
            try:
                if job is not None:
                    p.stdin.write(job)
                    p.stdin.flush()
                    return True
                p.stdin.close()
            except OSError:  # the worker is gone: its job goes to another
                if job is not None:
                    queue.append(job)
                    self.failed = True
            return False

        with selectors.DefaultSelector() as sel:
            for p in self.procs:
                if send(p):
                    sel.register(p.stdout, selectors.EVENT_READ, p)  # type: ignore[arg-type]
            while sel.get_map() and not cancel.is_set():
                for sk, _ in sel.select(POLL_S):
                    p = sk.data
                    try:
                        index, error, seconds, stats = pickle.load(p.stdout)
                    except (EOFError, pickle.UnpicklingError, ValueError):
                        self.failed = True
                        sel.unregister(sk.fileobj)
                        continue
                    if not send(p):  # its next job first: it compiles while this one loads
                        sel.unregister(sk.fileobj)
                    STATS["worker_compiled"] += stats.get("compiled", 0)
                    if error is None:
                        log.debug("kernel job %d compiled in a worker in %.1fs", index, seconds)
                        finished(index)
                    else:
                        self.failed = True
                        log.debug("kernel job %d failed in a worker: %s", index, error)

    def close(self) -> None:
        """Kill the workers that are left (those that ran out of jobs are exiting; nobody wants
        more kernels from the others) and reap them; their stderr goes to the debug log if one
        failed."""
        for p in self.procs:
            p.kill()
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        if self.failed:
            self.errors.seek(0)
            log.debug("kernel compile workers' stderr:\n%s",
                      self.errors.read()[-4000:].decode(errors="replace"))
        self.errors.close()


def _worker() -> None:
    """A compile worker: reads (index, pickled job) from stdin, runs each job (storing what it
    compiles in the cache), answers (index, error or None, seconds, stats) on its stdout."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the DSL prints goes to stderr, not into the answers
    sys.stdout = sys.stderr
    # CUTE_DSL_ARCH comes from the parent; _common sets it before cutlass loads. The DSL loads
    # now, before the first job arrives (started early, a worker waits for its jobs here).
    import cutlass_kernels._common  # noqa: F401

    while True:
        try:
            index, job = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        t0, before = time.perf_counter(), Counter(STATS)
        try:
            fn, args, kwargs = pickle.loads(job)
            fn(*args, **kwargs)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        pickle.dump((index, error, time.perf_counter() - t0, dict(STATS - before)), answers)
        answers.flush()
