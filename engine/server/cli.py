"""``cuteinfer serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    cuteinfer serve [--model DIR] [--host H] [--port P] [engine options]

With no --model it serves the embedded default model (SmolLM2-135M-Instruct), as ``generate``
does. SIGTERM / SIGINT drain (new requests 503, those in flight get up to --shutdown-grace seconds
to finish, the rest a 503) and exit 0; exits non-zero when the engine dies or stalls, so a
supervisor can restart it.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from engine.args import EngineArgs
from engine.cli import configure_logging
from engine.commands.generate import positive_int
from engine.core.client import MultiprocessEngine
from engine.engine import LLMEngine
from engine.server.app import DEFAULT_MAX_REQUEST_BYTES
from engine.server.launch import OpenAIServer  # fastapi / uvicorn: the `server` extra

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint directory name, "
                   f"or {DEFAULT_MODEL_NAME} for the embedded default)")
    p.add_argument("--engine-step-timeout", type=float, default=120.0, metavar="S",
                   help="declare the engine dead when requests are in flight and it made no "
                   "progress (no step, no layer of a forward) for S seconds (default 120)")
    p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   metavar="N", help="refuse request bodies over N bytes with 413, before "
                   "parsing them (default 16 MiB)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGTERM / SIGINT, give requests in flight up to S seconds to finish "
                   "(new ones get 503) before failing the rest with 503 and exiting; after a "
                   "fatal engine error, keep answering 503 for S seconds before exiting "
                   "(default 5)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="process (default): the scheduler, KV cache and GPU in their own "
                   "process, so HTTP, tokenization and detokenization never hold up a step; "
                   "thread: all in this process (one GIL)")


def run(a: argparse.Namespace) -> int:
    configure_logging(getattr(a, "debug", False), a.log_level)  # --log-level; --debug wins
    t0 = time.perf_counter()
    args = EngineArgs.from_cli_args(a)
    eng = MultiprocessEngine(args) if a.engine_core == "process" else LLMEngine(args)
    log.info("model %s (%s) on backend %s, max_model_len %d, %d KV pages, engine core in a "
             "%s, ready in %.1fs", eng.model_dir.name, eng.model_config.architecture,
             eng.backend, eng.config.max_model_len, eng.num_pages, a.engine_core,
             time.perf_counter() - t0)
    # vLLM serves the model under the name it was given; the embedded default has a real name
    name = a.served_model_name or (Path(a.model).name if a.model else DEFAULT_MODEL_NAME)
    server = OpenAIServer(eng, host=a.host, port=a.port, served_model_name=name,
                          step_timeout_s=a.engine_step_timeout,
                          shutdown_grace_s=a.shutdown_grace, log_level=a.log_level,
                          access_log=a.access_log, max_request_bytes=a.max_request_bytes)
    code = server.run()
    if code:
        log.error("exiting with status %d: %s", code, server.async_engine.fatal)
    return code
