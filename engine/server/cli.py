"""``cuteinfer serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    cuteinfer serve [MODEL | --model MODEL] [--host H] [--port P] [--api-key KEY] [options]

With no model it serves the embedded default model (SmolLM2-135M-Instruct), as ``generate``
does. API keys: ``--api-key`` (repeatable, or a comma list), else ``CUTEINFER_API_KEY``.
SIGTERM / SIGINT drain (new requests 503, those in flight get up to --shutdown-grace seconds to
finish, the rest a 503) and exit 0; exits non-zero when the engine dies or stalls, so a
supervisor can restart it.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from engine import envs
from engine.args import EngineArgs
from engine.cli import CLIError, configure_logging
from engine.commands.generate import positive_int
from engine.core.client import MultiprocessEngine
from engine.engine import LLMEngine
from engine.server.app import DEFAULT_MAX_REQUEST_BYTES
from engine.server.auth import parse_api_keys
from engine.server.launch import OpenAIServer  # fastapi / uvicorn: the `server` extra
from engine.server.tools import TOOL_CALL_PARSERS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as --model takes it (vLLM's positional form)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health, "
                   "/ping, /version, the docs and /metrics; repeat it (or give a comma list) "
                   "for several keys (default: $CUTEINFER_API_KEY, else no auth)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="with --api-key, /metrics needs a key too")
    p.add_argument("--cache-isolation-per-key", action=argparse.BooleanOptionalAction,
                   default=True, help="with --api-key, give each key its own prefix-cache "
                   "namespace, so that one client cannot learn from cache hits (cached_tokens, "
                   "time to first token) what another sent (default: on)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template to use instead of the checkpoint's: a file, or "
                   "the template itself")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                   help="how tool calls are read from the output: hermes (Qwen3's <tool_call> "
                   "blocks), llama3_json (Llama 3.x JSON calls), auto (by the chat template, "
                   "default) or none (tools only with tool_choice 'none')")
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
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and engine (default info)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="process (default): the scheduler, KV cache and GPU in their own "
                   "process, so HTTP, tokenization and detokenization never hold up a step; "
                   "thread: all in this process (one GIL)")


def run(a: argparse.Namespace) -> int:
    configure_logging(getattr(a, "debug", False), a.log_level)  # --log-level; --debug wins
    keys, template = resolve_options(a)
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
                          access_log=a.access_log, max_request_bytes=a.max_request_bytes,
                          api_keys=keys, metrics_require_key=a.metrics_require_key,
                          cache_isolation=a.cache_isolation_per_key,
                          tool_call_parser=a.tool_call_parser, chat_template=template)
    code = server.run()
    if code:
        log.error("exiting with status %d: %s", code, server.async_engine.fatal)
    return code


def resolve_options(a: argparse.Namespace) -> tuple[list[str], str | None]:
    """The positional MODEL into ``a.model``; the API keys (--api-key, else CUTEINFER_API_KEY)
    and the --chat-template text. Raises CLIError for a conflict or a missing file."""
    if a.model_tag is not None:
        if a.model and a.model != a.model_tag:
            raise CLIError(f"two models given ({a.model_tag!r} and --model {a.model!r}): give "
                           "one")
        a.model = a.model_tag
    keys = parse_api_keys(a.api_key if a.api_key is not None else [envs.api_keys() or ""])
    if a.metrics_require_key and not keys:
        raise CLIError("--metrics-require-key needs --api-key (or CUTEINFER_API_KEY)")
    template = None if a.chat_template is None else load_chat_template(a.chat_template)
    return keys, template


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM's rule:
    it holds Jinja syntax); a path that does not exist is an error."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}%\n"):
        return value
    raise CLIError(f"--chat-template {value!r}: no such file (and it is no Jinja template)")
