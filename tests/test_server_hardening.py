"""``cuteinfer serve`` against careless or hostile clients (issue 11), over real HTTP on loopback
(numpy backend, tiny checkpoints): request-body limit (413 before anything parses the body),
tokenization off the event loop and the byte-size bound on text prompts, bounds on every list,
dict and string a client controls, lone surrogates, no host path in /v1/models, and 500 bodies that
carry an error id instead of the exception.

Timing bounds are loose against the failure they catch: what they refuse took seconds before
(a 50 MB prompt froze every route for 77 s).
"""

from __future__ import annotations

import http.client as httpclient
import json
import logging
import random
import string
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from engine.server.app import build_app  # noqa: E402
from engine.server.async_engine import AsyncEngine  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    http,
    make_engine,
    running_server,
    serve_subprocess,
    write_test_checkpoint,
)

MAX_MODEL_LEN = 1024  # the chat checkpoint's max_position_embeddings
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MB = 1024 * 1024


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(make_engine(chat_dir, core=SERVER_CORE, max_model_len=MAX_MODEL_LEN),
                        served_model_name="tiny-chat") as s:
        yield s


@pytest.fixture(scope="module")
def served(chat_dir: Path) -> Iterator[str]:
    """The same server as ``server``, in its own process (``cuteinfer serve``): the timing tests
    then measure the server, not pauses of this test process (its GC, its client threads)."""
    with serve_subprocess(chat_dir, "--served-model-name", "tiny-chat", "--max-model-len",
                          str(MAX_MODEL_LEN)) as url:
        yield url


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An app from build_app on uvicorn, 127.0.0.1 and a free port (as launch.py serves it)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    host, port = srv.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def post(url: str, path: str, body: bytes, chunked: bool = False,
         timeout: float = 30.0) -> tuple[int, Any, float]:
    """POST raw bytes (Content-Length, or chunked in 1 MiB pieces); (status, JSON, seconds)."""
    u = urlparse(url)
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            pieces = (body[i:i + MB] for i in range(0, len(body), MB))
            conn.request("POST", path, body=pieces, headers=headers, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    return r.status, json.loads(data), time.perf_counter() - t0


@contextmanager
def health_probe(url: str) -> Iterator[list[float]]:
    """Probes /health from another thread while the block runs; yields the gaps between
    successive answers (a request's latency plus the pause before it). Gaps, not latencies: a
    stall that holds the GIL also stops this thread, which would then time only the requests
    around it, never the stall."""
    gaps: list[float] = []
    stop = threading.Event()

    def run() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            status, _ = http("GET", f"{url}/health", timeout=30)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            assert status == 200
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield gaps
    finally:
        stop.set()
        thread.join(60)


def random_words(n_bytes: int, seed: int = 0) -> str:
    """ASCII text of about n_bytes that the tokenizer's word cache does not make cheap."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
             for _ in range(20000)]
    return " ".join(rng.choices(words, k=n_bytes // 6 + 1))[:n_bytes]


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "prompt": prompt, "max_tokens": 1, **extra}


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "messages": [{"role": "user", "content": content}],
            "max_tokens": 1, **NO_THINK, **extra}


# -- 1. the request body limit ------------------------------------------------------------------


def test_oversized_body_is_refused_at_once_while_health_answers(served: str) -> None:
    """A 50 MB body (default limit 16 MiB) gets 413 in OpenAI's error JSON, naming the limit and
    the flag, without the server reading it: within 1 s, /health fast throughout; by
    Content-Length or, chunked, once the bytes pass the limit. Before: parsed and tokenized on the
    event loop (every route frozen for over a minute)."""
    body = json.dumps(completion("a" * (50 * MB))).encode()
    with health_probe(served) as gaps:
        for chunked in (False, True):
            status, err, seconds = post(served, "/v1/completions", body, chunked=chunked,
                                        timeout=10)
            assert status == 413, err
            assert seconds < 1.0
            e = err["error"]
            assert e["type"] == "invalid_request_error" and e["code"] == "request_too_large"
            assert str(16 * MB) in e["message"] and "--max-request-bytes" in e["message"]
    assert gaps and max(gaps) < 0.1, max(gaps)
    assert http("GET", f"{served}/health")[0] == 200


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(write_test_checkpoint(tmp_path_factory.mktemp("tiny"))))
    engine.start()
    yield engine
    engine.shutdown()


def test_body_limit_is_exact_and_configurable(tiny_engine: AsyncEngine) -> None:
    """build_app(max_request_bytes=64 KiB): a body of exactly the limit is served, one byte more
    is 413, whether sent with Content-Length or chunked; a non-positive limit is refused."""
    limit = 64 * 1024
    base = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "pad": ""}).encode()

    def sized(n: int) -> bytes:  # a valid request of exactly n bytes (an ignored extra field)
        return base.replace(b'"pad": ""', b'"pad": "' + b"x" * (n - len(base)) + b'"')

    with serve_app(build_app(tiny_engine, "tiny", max_request_bytes=limit)) as url:
        for chunked in (False, True):
            status, out, _ = post(url, "/v1/completions", sized(limit), chunked=chunked)
            assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
            status, err, _ = post(url, "/v1/completions", sized(limit + 1), chunked=chunked)
            assert status == 413 and f"limit of {limit} bytes" in err["error"]["message"], err
        assert http("GET", f"{url}/health")[0] == 200
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_request_bytes"):
            build_app(tiny_engine, "tiny", max_request_bytes=bad)


# -- 2. tokenization off the event loop; the text-size bound ------------------------------------


def test_tokenizing_a_long_prompt_does_not_stall_other_routes(served: str) -> None:
    """Text under the size bound (1 MiB here) is tokenized (most of a second) on a worker thread:
    /health keeps answering fast meanwhile; the prompt is then refused by its token count."""
    prompt = random_words(900_000)
    for path, body in (("/v1/completions", completion(prompt)),
                       ("/v1/chat/completions", chat(prompt))):
        with health_probe(served) as gaps:
            t0 = time.perf_counter()
            status, err = http("POST", f"{served}{path}", body)
            seconds = time.perf_counter() - t0
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
        assert "the prompt has" in err["error"]["message"], err  # counted, so tokenized
        # Tokenizing on the event loop stalls /health for about the whole request; on a worker
        # thread that releases the GIL the gaps are scheduling noise. Judged relative to the
        # request's own time, so that a loaded machine (everything slower) does not fail it.
        assert len(gaps) >= 5 and max(gaps) < max(0.1, seconds / 3), (path, max(gaps), seconds)


def test_text_over_the_size_bound_is_refused_without_tokenizing(server: OpenAIServer) -> None:
    """4 MiB of text: more bytes than any 1024-token prompt of this vocabulary can have, so a 400
    context_length_exceeded without tokenizing it (that takes seconds: the tokenizer is spied
    on). Token ids: by their count."""
    text = random_words(4 * MB)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", completion(text), "prompt"),
        ("/v1/completions", completion([text]), "prompt"),
        ("/v1/chat/completions", chat(text), "messages"),
        ("/v1/chat/completions", chat([{"type": "text", "text": text}]), "messages"),
        ("/v1/completions", completion([1] * 200_000), "prompt"),
    ]
    tok = server.engine.tokenizer
    encoded: list[int] = []  # lengths of the texts the server tokenized
    encode = tok.encode

    def spy(text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(len(text))
        return encode(text, *args, **kwargs)

    tok.encode = spy  # type: ignore[method-assign]
    try:
        for path, body, param in cases:
            status, err = http("POST", f"{server.url}{path}", body)
            assert status == 400, err
            assert err["error"]["code"] == "context_length_exceeded"
            assert err["error"]["param"] == param
    finally:
        del tok.encode
    assert not [n for n in encoded if n >= MB], f"oversized text was tokenized: {encoded}"


# -- 3. bounds on what a client controls ---------------------------------------------------------

BOUNDS: list[tuple[str, Callable[[], dict[str, Any]], str, str]] = [
    # (path, body, the param named, a word of the message naming the bound)
    ("/v1/completions", lambda: completion("hi", stop=["ab"] * 2_000_000), "stop", "64"),
    ("/v1/completions", lambda: completion("hi", stop=[str(i) for i in range(65)]), "stop", "64"),
    ("/v1/completions", lambda: completion("hi", stop="x" * 1025), "stop", "1024"),
    ("/v1/chat/completions", lambda: chat("hi", stop=["a", "b" * 1025]), "stop.1", "1024"),
    ("/v1/completions", lambda: completion("hi", stop_token_ids=[5] * 1025), "stop_token_ids",
     "1024"),
    ("/v1/completions", lambda: completion("hi", logit_bias={str(i): 1 for i in range(1025)}),
     "logit_bias", "1024"),
    ("/v1/completions", lambda: completion("hi", user="u" * 1025), "user", "1024"),
    ("/v1/completions", lambda: completion("hi", model="m" * 1025), "model", "1024"),
    ("/v1/chat/completions",
     lambda: {"messages": [{"role": "user", "content": "hi"}] * 4097, "max_tokens": 1},
     "messages", "4096"),
    ("/v1/chat/completions", lambda: chat([{"type": "text", "text": "a"}] * 257),
     "messages.0.content", "256"),
    ("/v1/chat/completions",
     lambda: {"messages": [{"role": "r" * 65, "content": "hi"}], "max_tokens": 1},
     "messages.0.role", "64"),
    ("/v1/chat/completions",
     lambda: {"messages": [{"role": "user", "content": "hi", "name": "n" * 1025}],
              "max_tokens": 1},
     "messages.0.name", "1024"),
    ("/v1/chat/completions",
     lambda: chat("hi", chat_template_kwargs={f"k{i}": 1 for i in range(65)}),
     "chat_template_kwargs", "64"),
    ("/v1/chat/completions",
     lambda: chat("hi", chat_template_kwargs={"enable_thinking": False, "x": "y" * 70_000}),
     "chat_template_kwargs", "65536"),
    ("/v1/chat/completions", lambda: chat("hi", tools=[{"type": "function"}] * 129), "tools",
     "128"),
    # already refused before issue 11: kept
    ("/v1/completions", lambda: completion("hi", n=17), "n", "16"),
    ("/v1/completions", lambda: completion("hi", logprobs=21), "logprobs", "20"),
    ("/v1/chat/completions", lambda: chat("hi", logprobs=True, top_logprobs=21), "top_logprobs",
     "20"),
]


@pytest.mark.parametrize("path,make_body,param,bound", BOUNDS,
                         ids=[f"{b[2]}-{i}" for i, b in enumerate(BOUNDS)])
def test_client_controlled_sizes_are_bounded(server: OpenAIServer, path: str,
                                             make_body: Callable[[], dict[str, Any]],
                                             param: str, bound: str) -> None:
    """Each over its bound: 400 naming the field and the bound, quickly (2,000,000 stop strings
    once made every request batched with them 40x slower)."""
    t0 = time.perf_counter()
    status, err = http("POST", f"{server.url}{path}", make_body())
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert bound in err["error"]["message"], err
    assert time.perf_counter() - t0 < 5.0


def test_bounds_leave_ordinary_requests_alone(server: OpenAIServer) -> None:
    """At the bounds: served."""
    status, out = http("POST", f"{server.url}/v1/completions",
                       completion("hi", stop=["x" * 1024] + [f"s{i}" for i in range(63)],
                                  stop_token_ids=list(range(1024)), user="u" * 1024))
    assert status == 200, out
    status, out = http("POST", f"{server.url}/v1/chat/completions",
                       chat([{"type": "text", "text": "a"}] * 256, user="u"))
    assert status == 200, out


# -- 4. lone surrogates --------------------------------------------------------------------------

S = '"\\ud800"'  # JSON's escape for a lone high surrogate, sent as those six characters
SURROGATES: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": [%s], "max_tokens": 1}', "prompt.0"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": %s}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": ["a", %s]}', "stop.1"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "user": %s}', "user"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "model": %s}', "model"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "suffix": %s}', "suffix"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 1}',
     "messages.0.content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": '
     '[{"type": "text", "text": "b"}, {"type": "text", "text": %s}]}], "max_tokens": 1}',
     "messages.1.content.1.text"),
    ("/v1/chat/completions", '{"messages": [{"role": %s, "content": "hi"}], "max_tokens": 1}',
     "messages.0.role"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi", "name": %s}], "max_tokens": 1}',
     "messages.0.name"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "assistant", "content": "a", "reasoning_content": %s}, '
     '{"role": "user", "content": "hi"}], "max_tokens": 1}', "messages.0.reasoning_content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": [%s]}',
     "stop.0"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
     '"chat_template_kwargs": {"enable_thinking": false, "x": {"y": [1, %s]}}}',
     "chat_template_kwargs.x.y.1"),
]


@pytest.mark.parametrize("path,template,param", SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogates_are_a_400_naming_the_field(server: OpenAIServer, path: str,
                                                    template: str, param: str) -> None:
    """Invalid text anywhere it would reach the tokenizer, the template or the engine: 400 naming
    the field (before: 500 with two tracebacks, or accepted)."""
    status, err = http("POST", f"{server.url}{path}", raw=(template % S).encode())
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert "surrogate" in err["error"]["message"]


def test_surrogate_pairs_are_text(server: OpenAIServer) -> None:
    """An escaped pair is one character (U+1F600): served, and usable as a stop string."""
    pair = '"\\ud83d\\ude00"'
    for path, template in (("/v1/completions",
                            '{"prompt": %s, "max_tokens": 2, "stop": [%s]}'),
                           ("/v1/chat/completions",
                            '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2, '
                            '"stop": %s, "chat_template_kwargs": {"enable_thinking": false}}')):
        status, out = http("POST", f"{server.url}{path}", raw=(template % (pair, pair)).encode())
        assert status == 200, out


# -- 5. /v1/models --------------------------------------------------------------------------------


def test_models_show_no_host_path(server: OpenAIServer) -> None:
    status, out = http("GET", f"{server.url}/v1/models")
    assert status == 200
    (model,) = out["data"]
    assert model["id"] == model["root"] == "tiny-chat"
    assert str(server.engine.model_dir) not in json.dumps(out)
    assert str(server.engine.model_dir.parent) not in json.dumps(out)


# -- 6. 500s -------------------------------------------------------------------------------------


def test_internal_errors_carry_an_id_not_the_exception(server: OpenAIServer,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A bug (here: the engine's intake raising) is a 500 whose body says only that, with an
    error id; the exception and its traceback are in the server log under that id."""
    secret = "/home/someone/models/secret-path"

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError(secret)

    monkeypatch.setattr(server.async_engine, "add", broken)
    with caplog.at_level(logging.ERROR, logger="cuteinfer.server"):
        status, err = http("POST", f"{server.url}/v1/completions", completion([1, 2, 3]))
    assert status == 500
    e = err["error"]
    assert e["type"] == "server_error" and e["code"] == "internal_error"
    text = json.dumps(err)
    assert secret not in text and "KeyError" not in text and "Traceback" not in text
    error_id = e["message"].split("error id ")[1].split(")")[0]
    assert error_id.startswith("err-") and len(error_id) > 8
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert secret in caplog.text and "KeyError" in caplog.text
    monkeypatch.undo()
    assert http("POST", f"{server.url}/v1/completions", completion([1, 2, 3]))[0] == 200
