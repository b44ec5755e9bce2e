"""Run the server: the engine thread, the FastAPI app and uvicorn, wired for fatal exits.

``OpenAIServer(engine).run()`` serves in the calling thread and returns the process exit code:
0 after a normal shutdown (SIGINT / SIGTERM), 1 when the engine died or stalled. On a fatal
engine error the server keeps answering for ``shutdown_grace_s`` (``/health`` 503, new requests
503, in-flight requests already failed), then uvicorn shuts down gracefully and ``run`` returns 1,
so a supervisor restarts the process. ``start()`` / ``stop()`` run it on a background thread
instead (tests, embedding).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from engine.engine import LLMEngine
from engine.server.app import build_app
from engine.server.async_engine import AsyncEngine
from engine.server.metrics import ServerMetrics

log = logging.getLogger("cuteinfer.server")


class OpenAIServer:
    def __init__(self, engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, step_timeout_s: float = 120.0,
                 shutdown_grace_s: float = 5.0, log_level: str = "info",
                 access_log: bool = False) -> None:
        self.served_model_name = served_model_name or engine.model_dir.name
        self.async_engine = AsyncEngine(engine, step_timeout_s=step_timeout_s,
                                        on_fatal=self._on_fatal)
        self.metrics = ServerMetrics(self.async_engine.snapshot,
                                     lambda: self.async_engine.health()[0])
        self.async_engine.on_finish = self.metrics.on_finish
        self.app = build_app(self.async_engine, self.served_model_name, self.metrics)
        self.shutdown_grace_s = shutdown_grace_s
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                access_log=access_log, lifespan="off",
                                timeout_graceful_shutdown=max(5, int(shutdown_grace_s) + 5))
        self.uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    def _on_fatal(self, reason: str) -> None:
        log.error("engine failure (%s): exiting after a %.1fs drain", reason,
                  self.shutdown_grace_s)
        t = threading.Timer(self.shutdown_grace_s, self._exit)
        t.daemon = True
        t.start()

    def _exit(self) -> None:
        self.uvicorn.should_exit = True

    def exit_code(self) -> int:
        return 1 if self.async_engine.fatal is not None else 0

    def run(self) -> int:
        """Serve until shut down; returns the exit code (1 if the engine died)."""
        self.async_engine.start()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            # uvicorn handles SIGINT / SIGTERM, then re-raises them to the handlers it found:
            # these make that a normal stop (exit 0), not a KeyboardInterrupt or death by signal.
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._stop_on_signal)
        try:
            self.uvicorn.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.async_engine.shutdown()
        return self.exit_code()

    def _stop_on_signal(self, sig: int, frame: object) -> None:
        self.uvicorn.should_exit = True

    # -- background thread -----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> str:
        """Serve on a background thread; returns the base URL once it accepts connections."""
        self.async_engine.start()
        self._thread = threading.Thread(target=self.uvicorn.run, name="cuteinfer-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self.url

    @property
    def url(self) -> str:
        sock = self.uvicorn.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.async_engine.shutdown()
