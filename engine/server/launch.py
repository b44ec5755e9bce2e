"""Run the server: the engine thread, the FastAPI app and uvicorn, wired for clean and fatal exits.

``OpenAIServer(engine).run()`` serves in the calling thread and returns the process exit code:
0 after a normal shutdown (SIGINT / SIGTERM), 1 when the engine died or stalled. ``start()`` /
``stop()`` run it on a background thread instead (tests, embedding).

A signal (or ``begin_shutdown()``) drains: new requests get 503 and ``/health`` 503 "shutting
down" at once; requests in flight run on for up to ``shutdown_grace_s`` (the drain ends as soon
as none is left); then each one still in flight gets its terminal answer (a JSON 503, or an SSE
error event and ``[DONE]``), and only then is uvicorn told to exit, so it has nothing left to wait
for or cancel. A second signal ends the grace at once. On a fatal engine error the requests in
flight have already failed; the server keeps answering 503 for ``shutdown_grace_s`` (so a load
balancer sees /health go down), then exits with status 1 for a supervisor to restart it.

The signal handler runs on the main thread between two bytecodes of whatever it was running,
often the event loop inside ``AsyncEngine.add`` with its lock held: it takes no lock, and hands
the drain to the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from engine.core import freeze_heap
from engine.core.client import MultiprocessEngine
from engine.engine import LLMEngine
from engine.model.hub import model_name
from engine.server.app import DEFAULT_MAX_REQUEST_BYTES, build_app
from engine.server.async_engine import AsyncEngine
from engine.server.metrics import ServerMetrics

log = logging.getLogger("cuteinfer.server")

FLUSH_TIMEOUT_S = 3  # after the drain, uvicorn's wait for the last answers to be written
JOIN_TIMEOUT_S = 1.0  # for the engine thread at exit (a daemon: one mid-step dies with us)


class _Uvicorn(uvicorn.Server):
    """uvicorn, with SIGINT / SIGTERM handed to ``on_signal`` instead of stopping at once (it
    installs ``handle_exit`` while it serves; not re-raised after, as nothing was captured)."""

    def __init__(self, config: uvicorn.Config,
                 on_signal: Callable[[int, FrameType | None], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal(sig, frame)


class OpenAIServer:
    def __init__(self, engine: LLMEngine | MultiprocessEngine, *, host: str = "127.0.0.1",
                 port: int = 8000,
                 served_model_name: str | None = None, step_timeout_s: float = 120.0,
                 shutdown_grace_s: float = 5.0, log_level: str = "info",
                 access_log: bool = False,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_keys: list[str] | None = None, metrics_require_key: bool = False,
                 cache_isolation: bool = True, tool_call_parser: str = "auto",
                 chat_template: str | None = None) -> None:
        """``chat_template``: the template text that replaces the checkpoint's
        (``--chat-template``); the rest as ``build_app`` and ``cuteinfer serve --help`` say."""
        self.served_model_name = served_model_name or model_name(engine.config.model,
                                                                 engine.model_dir)
        if chat_template is not None:
            set_chat_template(engine, chat_template)
        self.async_engine = AsyncEngine(engine, step_timeout_s=step_timeout_s,
                                        on_fatal=self._on_fatal)
        self.metrics = ServerMetrics(self.async_engine.snapshot,
                                     lambda: self.async_engine.health()[0],
                                     model_name=self.served_model_name)
        self.async_engine.on_finish = self.metrics.on_finish
        self.async_engine.on_output = self.metrics.on_output
        self.app = build_app(self.async_engine, self.served_model_name, self.metrics,
                             max_request_bytes=max_request_bytes, api_keys=api_keys,
                             metrics_require_key=metrics_require_key,
                             cache_isolation=cache_isolation, tool_call_parser=tool_call_parser)
        self.shutdown_grace_s = shutdown_grace_s
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                access_log=access_log, lifespan="off",
                                timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
        self.uvicorn = _Uvicorn(config, self._on_signal)
        self._thread: threading.Thread | None = None
        self._drain_lock = threading.Lock()
        self._drainer: threading.Thread | None = None

    @property
    def engine(self) -> LLMEngine | MultiprocessEngine:
        return self.async_engine.engine

    def exit_code(self) -> int:
        return 1 if self.async_engine.fatal is not None else 0

    # -- graceful shutdown -----------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Drain and stop (any thread; returns at once). A second call fails what is still in
        flight now instead of at the end of the grace."""
        with self._drain_lock:
            first = self._drainer is None
            if first:
                self.async_engine.stop_accepting()
                self._drainer = threading.Thread(target=self._drain, name="cuteinfer-drain",
                                                 daemon=True)
                self._drainer.start()
        if not first:
            log.warning("stop requested again: failing the requests in flight now")
            self.async_engine.shutdown(timeout=0)

    def _drain(self) -> None:
        ae = self.async_engine
        n = ae.num_in_flight()
        if n:
            log.warning("shutting down: up to %.1fs for %d request(s) in flight to finish",
                        self.shutdown_grace_s, n)
        if not ae.wait_idle(self.shutdown_grace_s):
            log.warning("shutdown grace over: failing %d request(s) still in flight",
                        ae.num_in_flight())
        ae.shutdown(timeout=0)  # their terminal answers are posted before uvicorn is told
        self.uvicorn.should_exit = True

    def _on_signal(self, sig: int, frame: FrameType | None = None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving (uvicorn's loop not yet or no longer running)
            self.uvicorn.should_exit = True
            return
        loop.call_soon_threadsafe(self.begin_shutdown)

    def _on_fatal(self, reason: str) -> None:
        log.error("engine failure (%s): exiting after a %.1fs drain", reason,
                  self.shutdown_grace_s)
        t = threading.Timer(self.shutdown_grace_s, self._exit)
        t.daemon = True
        t.start()

    def _exit(self) -> None:
        self.uvicorn.should_exit = True

    # -- serving ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until shut down; returns the exit code (1 if the engine died)."""
        self.async_engine.start()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            # uvicorn installs its handlers only while it serves: these cover before and after
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        freeze_heap()  # this process's start-up objects out of its full collections
        try:
            self.uvicorn.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.async_engine.shutdown(timeout=JOIN_TIMEOUT_S)
            self._stop_core()
        return self.exit_code()

    def _stop_core(self) -> None:
        """A two-process engine: stop its core process (the in-process one has nothing)."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:
                log.exception("stopping the engine core failed")

    def start(self, timeout: float = 30.0) -> str:
        """Serve on a background thread; returns the base URL once it accepts connections."""
        self.async_engine.start()
        self._thread = threading.Thread(target=self.uvicorn.run, name="cuteinfer-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self.url

    @property
    def url(self) -> str:
        sock = self.uvicorn.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop now (no grace): requests in flight get their terminal 503 first."""
        self.async_engine.shutdown(timeout=0)
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.async_engine.shutdown(timeout=JOIN_TIMEOUT_S)
        self._stop_core()


def set_chat_template(engine: LLMEngine | MultiprocessEngine, template: str) -> None:
    """Serve with ``template`` instead of the checkpoint's chat template (the front end renders
    it, whichever process the core runs in); a template that does not compile is refused."""
    from jinja2 import TemplateSyntaxError

    from engine.tokenizer import TokenizerError, _compile

    tok = engine.tokenizer
    if tok is None:
        raise TokenizerError("--chat-template needs a tokenizer, and this checkpoint has no "
                             "tokenizer.json")
    try:
        _compile(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"--chat-template does not compile: {e} (line {e.lineno})") \
            from None
    tok.chat_template = template
