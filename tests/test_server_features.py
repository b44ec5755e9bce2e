"""The OpenAI surface of issue 18 with the official openai client (numpy backend, the small Qwen3
checkpoint with the real tokenizer): n choices (seeded copies, sharing the prompt's pages), best_of,
echo with logprobs, prompt lists and token-id prompts, prompt logprobs, usage in the last chunk and
continuous usage, /tokenize -> /detokenize, /version, /ping, /v1/models; and every new bound, one
past its limit, answered 400 naming it while the server keeps serving."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import engine  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import SERVER_CORE, http, make_engine, running_server  # noqa: E402

MAX_MODEL_LEN = 256
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(make_engine(chat_dir, core=SERVER_CORE, max_model_len=MAX_MODEL_LEN),
                        served_model_name="m") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def fresh_ids(n: int, seed: int) -> list[int]:
    """A token-id prompt no other test sent (so nothing of it is cached yet)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def metric(server: OpenAIServer, name: str) -> float:
    v = server.metrics.registry.get_sample_value(name, {"model_name": "m"})
    return 0.0 if v is None else v


# -- n, best_of, seeds ---------------------------------------------------------------------------


def test_n_gives_three_choices(client: openai.OpenAI) -> None:
    args = dict(model="m", prompt="Random words:", n=3, max_tokens=6, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == 3
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # the copies' seeds are seed, seed + 1, seed + 2
    assert [c.text for c in client.completions.create(**args).choices] == texts  # reproducible
    one = client.completions.create(**{**args, "n": 1})
    assert one.choices[0].text == texts[0]
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                          n=3, max_tokens=4, extra_body=NO_THINK)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in chat.choices)
    assert client.completions.create(**{**args, "best_of": 3}).usage.completion_tokens == 18


def test_n_copies_share_the_prompt_pages(server: OpenAIServer, client: openai.OpenAI) -> None:
    """The first copy computes the 40-token prompt; its two siblings find its 2 full pages
    (32 tokens) in the prefix cache."""
    hits = metric(server, "cuteinfer:prefix_cache_hits_total")
    r = client.completions.create(model="m", prompt=fresh_ids(40, 1), n=3, max_tokens=3,
                                  temperature=0.8, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3 and r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == 40 and r.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(server, "cuteinfer:prefix_cache_hits_total") - hits == 2 * 32


def test_n_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model="m", prompt=fresh_ids(40, 2), n=2, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    finishes = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes.append((choice.index, choice.finish_reason))
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert texts[0] == texts[1] and texts[0]  # greedy: the same text
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10


# -- echo, prompt lists, logprobs ----------------------------------------------------------------


def test_echo_returns_prompt_and_completion(client: openai.OpenAI) -> None:
    args = dict(model="m", prompt="Hello there", max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    r = client.completions.create(**args, echo=True, logprobs=1)
    assert r.choices[0].text == "Hello there" + plain
    lp = r.choices[0].logprobs
    assert lp.tokens[:2] == ["Hello", " there"] and len(lp.tokens) == 2 + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    streamed = list(client.completions.create(**args, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "Hello there" + plain
    ids = client.completions.create(model="m", prompt=[9707, 1052], max_tokens=2, echo=True)
    assert ids.choices[0].text.startswith("Hello there")


def test_prompt_lists_and_token_ids(client: openai.OpenAI) -> None:
    args = dict(model="m", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=p, **args).choices[0].text
               for p in ("One two", "Three four five")]
    r = client.completions.create(prompt=["One two", "Three four five"], n=2, **args)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.prompt_tokens == 2 + 3 and r.usage.completion_tokens == 12
    r = client.completions.create(prompt=[[9707, 11], [1879]], **args)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 3


def test_prompt_logprobs(server: OpenAIServer, client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="Hello there friend", max_tokens=2,
                                  extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == 3 and plp[0] is None
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 2 and all(v["logprob"] <= 0 for v in entry.values())
    assert "1052" in plp[1]  # " there": the prompt's own token, with its rank
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={**NO_THINK,
                                                                    "prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None


# -- usage in streams ----------------------------------------------------------------------------


def test_usage_in_the_last_chunk(client: openai.OpenAI) -> None:
    for create in (client.completions.create, client.chat.completions.create):
        body: dict[str, Any] = {"prompt": "Count:"} if create == client.completions.create else {
            "messages": [{"role": "user", "content": "Count"}]}
        chunks = list(create(model="m", **body, max_tokens=5, stream=True,
                             stream_options={"include_usage": True},
                             extra_body={**NO_THINK, "ignore_eos": True}))
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
        assert all(c.usage is None for c in chunks[:-1])
        cont = list(create(model="m", **body, max_tokens=5, stream=True,
                           stream_options={"include_usage": True,
                                           "continuous_usage_stats": True},
                           extra_body={**NO_THINK, "ignore_eos": True}))
        assert all(c.usage is not None for c in cont)
        running = [c.usage.completion_tokens for c in cont[:-1]]
        assert running == sorted(running) and running[-1] == 5


# -- tokenize, version, ping, models -------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server: OpenAIServer, client: openai.OpenAI) -> None:
    text = "The quick brown fox — jumps over 12 lazy dogs."
    status, tok = http("POST", f"{server.url}/tokenize",
                       {"model": "m", "prompt": text, "return_token_strs": True})
    assert status == 200, tok
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    status, detok = http("POST", f"{server.url}/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}
    # messages: the prompt a chat request with them gets
    msgs = [{"role": "user", "content": "Hello!"}]
    status, chat_tok = http("POST", f"{server.url}/tokenize", {"messages": msgs, **NO_THINK})
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=1, extra_body=NO_THINK)
    assert status == 200 and chat_tok["count"] == r.usage.prompt_tokens
    status, err = http("POST", f"{server.url}/tokenize", {"prompt": "a", "messages": msgs})
    assert status == 400 and err["error"]["param"] == "prompt"
    status, err = http("POST", f"{server.url}/detokenize", {"tokens": [10**7]})
    assert status == 400 and err["error"]["param"] == "tokens"


def test_version_ping_models(server: OpenAIServer, client: openai.OpenAI) -> None:
    assert http("GET", f"{server.url}/version") == (200, {"version": engine.__version__})
    assert http("GET", f"{server.url}/ping")[0] == 200
    assert http("POST", f"{server.url}/ping")[0] == 200
    (model,) = client.models.list().data
    assert model.id == "m" and model.model_extra["max_model_len"] == MAX_MODEL_LEN


def test_user_and_cache_salt_are_accepted(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="hi", max_tokens=1, user="someone",
                                  extra_body={"cache_salt": "s" * 43})
    assert r.usage.completion_tokens == 1


# -- bounds --------------------------------------------------------------------------------------


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": 1, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            **extra}


def tool(name: str = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BOUNDS: list[tuple[str, Callable[[], dict[str, Any]], str, str]] = [
    # (path, body one past the bound, the param named, the bound as the message says it)
    ("/v1/completions", lambda: completion(n=17), "n", "16"),
    ("/v1/chat/completions", lambda: chat(n=17), "n", "16"),
    ("/v1/completions", lambda: completion(n=2, best_of=17), "best_of", "16"),
    ("/v1/completions", lambda: completion(n=2, best_of=3), "best_of", "best_of must equal n"),
    ("/v1/completions", lambda: completion(prompt=["a"] * 33), "prompt", "32"),
    ("/v1/completions", lambda: completion(prompt=[[1]] * 33), "prompt", "32"),
    ("/v1/completions", lambda: completion(prompt=["a"] * 5, n=13), "n", "64"),
    ("/v1/completions", lambda: completion(cache_salt="s" * 1025), "cache_salt", "1024"),
    ("/v1/completions", lambda: completion(cache_salt=""), "cache_salt", "at least 1"),
    ("/v1/completions", lambda: completion(prompt_logprobs=21), "prompt_logprobs", "20"),
    ("/v1/chat/completions", lambda: chat(prompt_logprobs=21), "prompt_logprobs", "20"),
    ("/v1/chat/completions", lambda: chat(tools=[tool()] * 129), "tools", "128"),
    ("/v1/chat/completions", lambda: chat(tools=[tool("x" * 65)]), "tools.0.function.name",
     "64"),
    ("/v1/chat/completions", lambda: chat(tools=[tool(description="d" * 65536)]), "tools.0",
     "65536"),
    ("/v1/chat/completions", lambda: chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [CALL] * 129}]),
     "messages.1.tool_calls", "128"),
    ("/v1/chat/completions", lambda: chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "f" * 1025, "arguments": "{}"}}]}]),
     "messages.1.tool_calls.0", "1024"),
    ("/v1/chat/completions", lambda: chat(messages=[
        {"role": "tool", "tool_call_id": "c" * 1025, "content": "x"}]),
     "messages.0.tool_call_id", "1024"),
    ("/tokenize", lambda: {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages",
     "4096"),
    ("/tokenize", lambda: {"prompt": "x", "tools": [tool()] * 129}, "tools", "128"),
    ("/detokenize", lambda: {"tokens": [1] * (MAX_MODEL_LEN + 1)}, "tokens",
     str(MAX_MODEL_LEN)),
]


@pytest.mark.parametrize("path,make_body,param,bound", BOUNDS,
                         ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BOUNDS)])
def test_each_new_bound_one_past_its_limit(server: OpenAIServer, path: str,
                                           make_body: Callable[[], dict[str, Any]], param: str,
                                           bound: str) -> None:
    status, err = http("POST", f"{server.url}{path}", make_body())
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert bound in err["error"]["message"], err
    status, ok = http("POST", f"{server.url}/v1/completions", completion())
    assert status == 200, ok  # and the server keeps serving


def test_bounds_themselves_are_served(server: OpenAIServer) -> None:
    for path, body in (("/v1/completions", completion(prompt=["a"] * 4, n=16, best_of=16)),
                       ("/v1/completions", completion(cache_salt="s" * 1024, prompt_logprobs=20)),
                       ("/detokenize", {"tokens": [1] * MAX_MODEL_LEN})):
        status, out = http("POST", f"{server.url}{path}", body, timeout=120)
        assert status == 200, out
