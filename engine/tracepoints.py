"""Admission tracepoints: where a request is between the HTTP server and the engine core.

``CUTEINFER_ADMIT_TRACE`` names a file; each process appends ``event time pid detail`` lines
to it (``time.perf_counter``: CLOCK_MONOTONIC, the clock of the step trace and of the benchmark
clients), line-buffered. Events: ``http`` (the ASGI app got a request), ``add`` (the handler
queued it for the engine thread), ``drain`` (the engine thread added it), ``flush`` (the front
end sent N commands to the core), ``core`` (the core received N commands), ``admitted`` (the
core added them); and where a token is on its way out: ``deliver`` (the engine thread handed
N streams their step's deltas), ``sse`` (a stream's handler yields a chunk; detail: the
stream's key). Unset: ``mark`` is None and the call sites test that, nothing else runs."""

from __future__ import annotations

import os
import time
from typing import Any

from engine import envs

_file: Any = None


def _mark(event: str, detail: object = "") -> None:
    global _file
    if _file is None:
        _file = open(envs.admit_trace_path(), "a", buffering=1)  # noqa: SIM115 (process-long)
    _file.write(f"{event} {time.perf_counter():.6f} {os.getpid()} {detail}\n")


mark = _mark if envs.admit_trace_path() is not None else None
