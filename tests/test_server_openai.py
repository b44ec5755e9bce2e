"""The official ``openai`` client, unmodified, against ``cuteinfer serve`` (in-process uvicorn on
a loopback port, numpy backend, a tiny random Qwen3 with the real tokenizer and chat template):
completions and chat, streamed and not, usage, logprobs, stop, seed, vLLM extras, 400s, metrics,
and disconnect-aborts."""

from __future__ import annotations

import http.client as httpclient
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from engine.api import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    http,
    make_engine,
    running_server,
    wait_for,
    wait_idle,
)

MAX_MODEL_LEN = 256
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(chat_dir: Path) -> Path:
    return chat_dir


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(make_engine(model_dir, core=SERVER_CORE, max_model_len=MAX_MODEL_LEN),
                        served_model_name="tiny-chat") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLM:
    """The same checkpoint through the embedded API: what greedy output must be."""
    return LLM(model=str(model_dir), backend="numpy", max_model_len=MAX_MODEL_LEN)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-chat"]


def test_completion_matches_embedded_api(client: openai.OpenAI, reference: LLM) -> None:
    r = client.completions.create(model="tiny-chat", prompt="The capital of France is",
                                  max_tokens=12, temperature=0)
    want = reference.generate("The capital of France is",
                              SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    args = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in text_chunks)


def test_completion_token_ids_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-chat", prompt=[9707, 11, 1879], max_tokens=6,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0 and 3 <= len(top) <= 4
        assert top[tok] == pytest.approx(val)
        assert val == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat(client: openai.OpenAI, reference: LLM) -> None:
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="tiny-chat", messages=msgs, temperature=0,
                                       max_completion_tokens=8, extra_body=NO_THINK)
    want = reference.chat(msgs, SamplingParams(temperature=0, max_tokens=8),
                          chat_template_kwargs={"enable_thinking": False})[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # enable_thinking reaches the template: without it, the prompt differs
    r2 = client.chat.completions.create(model="tiny-chat", messages=msgs, temperature=0,
                                        max_tokens=1)
    assert r2.usage.prompt_tokens != r.usage.prompt_tokens


def test_chat_stream_with_logprobs(client: openai.OpenAI) -> None:
    args = dict(model="tiny-chat", messages=[{"role": "user", "content": "Hi!"}],
                temperature=0, max_tokens=7, logprobs=True, top_logprobs=2,
                extra_body={**NO_THINK, "ignore_eos": True})
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == \
        full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == \
        ["length"]
    streamed_lp = [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed_lp) == len(full.choices[0].logprobs.content) == 7
    for a, b in zip(streamed_lp, full.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob)
        assert len(b.top_logprobs) == 2 and b.top_logprobs[0].logprob >= b.top_logprobs[1].logprob
        assert bytes(b.bytes) == b.token.encode()
    assert chunks[-1].usage.completion_tokens == 7


def test_seed_and_sampling_extras(client: openai.OpenAI) -> None:
    args = dict(model="tiny-chat", prompt="Random words:", max_tokens=8, temperature=1.0,
                top_p=0.9, seed=1234, extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 8
    c = client.completions.create(**{**args, "seed": 4321})
    assert c.usage.completion_tokens == 8
    # top_k beyond the vocabulary keeps every token (it once overflowed the step's int32 batch)
    d = client.completions.create(**{**args, "extra_body": {"top_k": 2**40, "ignore_eos": True}})
    assert d.usage.completion_tokens == 8


def test_stop_string(client: openai.OpenAI) -> None:
    args = dict(model="tiny-chat", prompt="Count: 1 2 3", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    assert len(full) > 4
    stop = full[3:5]
    r = client.completions.create(**args, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": 3.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": ["a"] * 33}, "prompt"),
    ("completions", {"prompt": ["a"] * 8, "n": 9}, "n"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, 2, 10**7]}, None),
    ("completions", {"prompt": "word " * 300}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": "hello"}, "messages"),
])
def test_bad_requests_get_openai_400(server: OpenAIServer, path: str, body: dict,
                                     param: str | None) -> None:
    status, resp = http("POST", f"{server.url}/v1/{path}", body)
    assert status == 400, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_bad_request_through_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 400 and "does not exist" in e.value.message


def test_malformed_json_and_unknown_route(server: OpenAIServer) -> None:
    status, resp = http("POST", f"{server.url}/v1/completions", raw=b"{not json")
    assert status == 400 and resp["error"]["type"] == "invalid_request_error"
    status, resp = http("GET", f"{server.url}/v1/nothing-here")
    assert status == 404 and "error" in resp


def test_bodies_msgspec_refuses_are_read_as_the_standard_library_reads_them(
        server: OpenAIServer) -> None:
    """The server decodes JSON bodies with msgspec and falls back to ``json.loads`` for what
    msgspec refuses: a UTF-8 BOM gives the same answer as the plain body (greedy); a lone
    surrogate escape reaches the field check, which names the field; token ids work too."""
    model = server.served_model_name
    base = {"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    want = http("POST", f"{server.url}/v1/completions", base)
    assert want[0] == 200, want
    bom = b"\xef\xbb\xbf" + json.dumps(base).encode()
    got = http("POST", f"{server.url}/v1/completions", raw=bom)
    assert got[0] == 200 and got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
    surrogate = json.dumps({**base, "user": "x"}).replace('"x"', '"\\ud800"').encode()
    got = http("POST", f"{server.url}/v1/completions", raw=surrogate)
    assert got[0] == 400 and got[1]["error"]["param"] == "user", got
    ids = http("POST", f"{server.url}/v1/completions", {**base, "prompt": [5, 6, 7, 8]})
    assert ids[0] == 200 and ids[1]["usage"]["prompt_tokens"] == 4


def test_disconnect_aborts_and_frees_pages(server: OpenAIServer) -> None:
    """A streaming client that goes away mid-generation: its request is aborted and its KV
    pages return; so does a non-streaming one."""
    u = urlparse(server.url)
    def aborted() -> float:
        return server.metrics.registry.get_sample_value(
            "cuteinfer:requests_total", {"outcome": "abort", "model_name": "tiny-chat"})

    before = aborted()
    for stream in (True, False):
        conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": "Tell me a long story", "max_tokens": 200, "stream": stream,
            "ignore_eos": True, "temperature": 0}), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.readline().startswith(b"data: ")  # generation is under way
        else:
            assert wait_for(lambda: server.async_engine.snapshot()["running"] == 1)
        conn.sock.shutdown(2)
        conn.close()
        assert wait_idle(server, timeout=20)
    assert aborted() == before + 2


def test_health_and_metrics(server: OpenAIServer, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
    status, body = http("GET", f"{server.url}/health")
    assert status == 200 and body["status"] == "ok"
    status, text = http("GET", f"{server.url}/metrics")
    assert status == 200
    for name in ("cuteinfer:requests_total", "cuteinfer:time_to_first_token_seconds_bucket",
                 "cuteinfer:request_time_per_output_token_seconds_bucket",
                 "cuteinfer:e2e_request_latency_seconds_bucket",
                 "cuteinfer:num_requests_running", "cuteinfer:num_requests_waiting",
                 "cuteinfer:kv_pages", "cuteinfer:prefix_cache_hit_rate",
                 "cuteinfer:num_preemptions_total", "cuteinfer:engine_steps_total",
                 "cuteinfer:engine_healthy"):
        assert name in text, name
    m = {"model_name": "tiny-chat"}
    get = server.metrics.registry.get_sample_value
    assert get("cuteinfer:requests_total", {**m, "outcome": "length"}) >= 1
    assert get("cuteinfer:requests_total", {**m, "outcome": "rejected"}) >= 1
    for state in ("live", "cached", "reclaimable"):
        assert get("cuteinfer:kv_pages", {**m, "state": state}) is not None
    for kind in ("graph", "eager"):
        assert get("cuteinfer:engine_steps_total", {**m, "kind": kind}) is not None
    assert get("cuteinfer:engine_healthy", m) == 1.0
    # prompts repeated above hit the prefix cache
    rate = server.metrics.registry.get_sample_value("cuteinfer:prefix_cache_hit_rate",
                                                    {"model_name": "tiny-chat"})
    assert rate is not None and 0.0 < rate < 1.0
