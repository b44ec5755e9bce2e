"""Compiling a model's kernels in parallel: worker processes fill the disk cache (_cache.py).

``compile_all`` runs a model's ``compile_*`` calls (jobs): first each one here while probing the
cache (its kernels load; the first missing one stops the job, nothing is compiled), then the
jobs left over in worker processes that compile them and store them in the cache, then those
jobs again here, loading what the workers stored (and compiling here what they could not: the
error, if any, is raised here, as without workers). Workers are ``python -c`` processes fed
pickled jobs on stdin, so a user's ``__main__`` is never re-run (as ``multiprocessing``'s spawn
would), and each is handed the next job as it answers. Threads cannot do this: the DSL's MLIR
location context is per thread, and tracing in two threads at once fails.
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


def compile_all(jobs: dict[str, Job], on_done: Callable[[str], None] = lambda name: None,
                workers: int | None = None) -> dict[str, Any]:
    """``{name: fn(*args, **kwargs)}`` for jobs that call ``compile_*`` functions. Jobs whose
    kernels are all in the disk cache load here; the others are compiled by up to ``workers``
    processes (default ``envs.compile_workers()``, else one per CPU core), which store them in
    the cache, and then load here. Without a writable cache, or with one worker, they compile
    here one after another. ``on_done(name)`` once per job, as each is ready."""
    results: dict[str, Any] = {}
    missing: list[str] = []
    for name, (fn, args, kwargs) in jobs.items():
        try:
            with probing():
                results[name] = fn(*args, **kwargs)
        except CacheMiss:
            missing.append(name)
            continue
        on_done(name)
    distinct: dict[str, list[str]] = {}  # one compile per distinct call
    for name in missing:
        fn, args, kwargs = jobs[name]
        distinct.setdefault(f"{fn.__module__}.{fn.__qualname__}{args!r}{sorted(kwargs.items())!r}",
                            []).append(name)
    groups = list(distinct.values())
    n = min(workers or envs.compile_workers() or _cpus(), len(groups))
    reported: set[str] = set()
    if n > 1 and envs.kernel_cache_enabled() and _writable(envs.kernel_cache_dir()):

        def finished(index: int) -> None:
            for name in groups[index]:
                reported.add(name)
                on_done(name)

        try:
            _compile_in_workers([jobs[g[0]] for g in groups], n, finished)
        except Exception as e:  # no worker could start (an embedded interpreter, no fork)
            log.warning("kernel cache: compiling in worker processes failed (%s: %s); "
                        "compiling here", type(e).__name__, e)
    for name in missing:  # loads what the workers stored; compiles what they could not
        fn, args, kwargs = jobs[name]
        results[name] = fn(*args, **kwargs)
        if name not in reported:
            on_done(name)
    return results


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


def _compile_in_workers(jobs: list[Job], n: int, finished: Callable[[int], None]) -> None:
    """Run ``jobs`` in ``n`` worker processes, handing each the next job as it answers. A job that
    fails or whose worker dies is logged (debug) and left to the caller."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    queue = [pickle.dumps((i, pickle.dumps(job))) for i, job in enumerate(jobs)]
    queue.reverse()  # pop() from the end hands them out in the caller's order
    sel = selectors.DefaultSelector()
    procs: list[subprocess.Popen[bytes]] = []
    failed = False

    def send(p: subprocess.Popen[bytes]) -> bool:
        assert p.stdin is not None
        try:
            if queue:
                p.stdin.write(queue.pop())
                p.stdin.flush()
                return True
            p.stdin.close()
        except OSError:  # the worker is gone
            pass
        return False

    done = False
    with tempfile.TemporaryFile() as errors:
        try:
            for _ in range(n):
                p = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=errors, env=env)
                procs.append(p)
                if send(p):
                    sel.register(p.stdout, selectors.EVENT_READ, p)  # type: ignore[arg-type]
            while sel.get_map():
                for sk, _ in sel.select():
                    p = sk.data
                    try:
                        index, error, seconds, stats = pickle.load(p.stdout)
                    except (EOFError, pickle.UnpicklingError, ValueError):
                        failed = True
                        sel.unregister(sk.fileobj)
                        continue
                    STATS["worker_compiled"] += stats.get("compiled", 0)
                    if error is None:
                        log.debug("kernel job %d compiled in a worker in %.1fs", index, seconds)
                        finished(index)
                    else:
                        failed = True
                        log.debug("kernel job %d failed in a worker: %s", index, error)
                    if not send(p):
                        sel.unregister(sk.fileobj)
            done = True
        finally:
            sel.close()
            for p in procs:
                if not done:  # interrupted: the caller is not waiting for their kernels
                    p.kill()
                if p.stdin is not None:
                    with contextlib.suppress(OSError):
                        p.stdin.close()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                failed = failed or p.returncode != 0
            if failed:
                errors.seek(0)
                log.debug("kernel compile workers' stderr:\n%s",
                          errors.read()[-4000:].decode(errors="replace"))


def _worker() -> None:
    """A compile worker: reads (index, pickled job) from stdin, runs each job (storing what it
    compiles in the cache), answers (index, error or None, seconds, stats) on its stdout."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the DSL prints goes to stderr, not into the answers
    sys.stdout = sys.stderr
    # CUTE_DSL_ARCH comes from the parent, and each job's module imports _common before cutlass
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
