"""API keys and cache isolation (issue 18): with ``--api-key`` every route but the open ones
answers 401 without a key, 401 with a wrong one and 2xx with a right one (streaming included, and
through the official openai client); /health, /ping and /version stay open, /metrics unless
``--metrics-require-key``. The prefix cache tells no client what another sent: with several keys
(or per-request ``cache_salt``) a right guess of another client's prompt gets 0 cached tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.routing import APIRoute  # noqa: E402

from engine.server.auth import OPEN_PATHS, APIKeys, parse_api_keys  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    http,
    make_engine,
    running_server,
    write_test_checkpoint,
)

KEYS = ["key-alpha-0123456789", "key-beta-9876543210"]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **NO_THINK}
# every route that needs a key, with a request it serves
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream": True}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [9707]}),
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(make_engine(chat_dir, core=SERVER_CORE), served_model_name="m",
                        api_keys=KEYS) as s:
        yield s


def test_every_route_401_401_2xx(server: OpenAIServer) -> None:
    served = {r.path for r in server.app.routes if isinstance(r, APIRoute)}
    assert served - OPEN_PATHS - {"/metrics"} == {path for _, path, _ in ROUTES}
    for method, path, body in ROUTES:
        url = f"{server.url}{path}"
        for headers in ({}, bearer("wrong-key"), {"Authorization": KEYS[0]},
                        {"Authorization": f"Basic {KEYS[0]}"}, bearer(KEYS[0] + "x")):
            status, err = http(method, url, body, headers=headers)
            assert status == 401, (path, headers, err)
            assert err["error"]["type"] == "invalid_request_error"
            assert err["error"]["code"] == "invalid_api_key"
            assert KEYS[0] not in str(err)
        for key in KEYS:
            status, out = http(method, url, body, headers=bearer(key))
            assert 200 <= status < 300, (path, out)
            if body and body.get("stream"):
                assert out.rstrip().endswith("data: [DONE]")
    # an unknown path tells a stranger nothing: 401, not 404
    assert http("GET", f"{server.url}/v1/no-such-route")[0] == 401
    assert http("GET", f"{server.url}/v1/no-such-route", headers=bearer(KEYS[1]))[0] == 404


def test_open_routes(server: OpenAIServer) -> None:
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                         ("GET", "/version"), ("GET", "/metrics"), ("GET", "/openapi.json")):
        assert http(method, f"{server.url}{path}")[0] == 200, path
    unauthorized = server.metrics.registry.get_sample_value(
        "cuteinfer:requests_total", {"model_name": "m", "outcome": "unauthorized"})
    assert unauthorized and unauthorized > 0


def test_openai_client_with_and_without_the_key(server: OpenAIServer) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="m", prompt="hi", max_tokens=1)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        list(wrong.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=1,
                                           stream=True))
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[1], max_retries=0)
    chunks = list(right.chat.completions.create(model="m", messages=CHAT["messages"],
                                                max_tokens=2, stream=True, extra_body=NO_THINK))
    assert chunks and chunks[0].choices[0].delta.role == "assistant"


def guess(server: OpenAIServer, key: str, prompt: list[int], **extra: Any) -> int:
    """cached_tokens of one request with ``key``."""
    status, out = http("POST", f"{server.url}/v1/completions",
                       {"prompt": prompt, "max_tokens": 1, **extra}, headers=bearer(key))
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def secret(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(40)]  # 2 full pages + 8 tokens


def test_another_keys_prompt_is_not_a_cache_hit(server: OpenAIServer) -> None:
    """Before: a right guess of another client's prompt came back as cached_tokens 32."""
    prompt = secret(1)
    assert guess(server, KEYS[0], prompt) == 0
    assert guess(server, KEYS[0], prompt) == 32  # the same key shares its own cache
    assert guess(server, KEYS[1], prompt) == 0  # another key's right guess: computed afresh
    assert guess(server, KEYS[1], prompt) == 32


def test_cache_salt_narrows_the_namespace(server: OpenAIServer) -> None:
    prompt = secret(2)
    assert guess(server, KEYS[0], prompt, cache_salt="alice") == 0
    assert guess(server, KEYS[0], prompt, cache_salt="bob") == 0
    assert guess(server, KEYS[0], prompt) == 0
    assert guess(server, KEYS[0], prompt, cache_salt="alice") == 32
    assert guess(server, KEYS[1], prompt, cache_salt="alice") == 0  # the key's namespace first


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    """Two keys, cache isolation off, /metrics behind the key (tiny model, in-process)."""
    tiny = write_test_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")
    with running_server(make_engine(tiny), served_model_name="m", api_keys=KEYS,
                        cache_isolation=False, metrics_require_key=True) as s:
        yield s


def test_isolation_off_and_metrics_behind_the_key(shared_server: OpenAIServer) -> None:
    prompt = [random.Random(3).randrange(1, 1000) for _ in range(40)]
    assert guess(shared_server, KEYS[0], prompt) == 0
    assert guess(shared_server, KEYS[1], prompt) == 32  # one namespace for all keys
    assert guess(shared_server, KEYS[1], prompt, cache_salt="x") == 0  # salts still apply
    url = f"{shared_server.url}/metrics"
    assert http("GET", url)[0] == 401 and http("GET", url, headers=bearer("no"))[0] == 401
    status, text = http("GET", url, headers=bearer(KEYS[0]))
    assert status == 200 and "cuteinfer:num_requests_running" in text
    assert http("GET", f"{shared_server.url}/health")[0] == 200


def test_key_parsing_and_matching() -> None:
    assert parse_api_keys(["a,b", " c ", "a", ""]) == ["a", "b", "c"]
    assert parse_api_keys(None) == []
    keys = APIKeys(["k1", "k2"])
    s1, s2 = keys.match(b"Bearer k1"), keys.match(b"bearer  k2 ")
    assert s1 and s2 and s1 != s2 and "k1" not in s1
    assert keys.match(None) is None and keys.match(b"Bearer k3") is None
    assert keys.match(b"k1") is None and keys.match(b"Bearer") is None
    assert APIKeys(["k1"], isolate_cache=False).match(b"Bearer k1") == ""
    for bad in (["has space"], ["caf\u00e9"], []):
        with pytest.raises(ValueError):
            APIKeys(bad)
