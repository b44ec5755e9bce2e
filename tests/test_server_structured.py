"""The official ``openai`` client against ``cuteinfer serve`` (numpy backend, the tests' "chat"
checkpoint: a small random Qwen3 with the real tokenizer): structured output through
response_format json_schema / json_object, vLLM's structured_outputs and guided_* extras, holding
for 20 seeds of 20 at temperature 0.7; penalties and logit_bias in both routes; 400s naming the
field for what is malformed or unsupported."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import SERVER_CORE, make_engine, running_server  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "maxLength": 4}}}}
SEEDS = range(20)


def valid(obj: object) -> bool:
    """``SCHEMA``, checked by hand (no jsonschema dependency)."""
    if not isinstance(obj, dict) or not {"name", "age", "pet"} <= set(obj) <= {
            "name", "age", "pet", "tags"}:
        return False
    tags = obj.get("tags", [])
    return (isinstance(obj["name"], str) and len(obj["name"]) <= 8
            and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
            and 0 <= obj["age"] <= 120 and obj["pet"] in ("cat", "dog", "fish")
            and isinstance(tags, list) and len(tags) <= 2
            and all(isinstance(t, str) and len(t) <= 4 for t in tags))


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with pytest.MonkeyPatch.context() as mp:  # (the default: conftest turns it off elsewhere)
        mp.setenv("CUTEINFER_GRAMMAR_WARMUP", "1")
        engine = make_engine(chat_dir, core=SERVER_CORE, max_model_len=256, max_num_seqs=8)
    with running_server(engine, served_model_name="tiny-chat") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _chat(client: openai.OpenAI, **kw: object):
    return client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        **kw)


def test_json_schema_holds_for_20_seeds_of_20(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                 "strict": True}}
    for seed in SEEDS:
        r = _chat(client, response_format=rf, temperature=0.7, seed=seed, max_tokens=64,
                  extra_body=NO_THINK)
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        assert valid(json.loads(c.message.content)), (seed, c.message.content)


def test_choice_and_regex_hold_for_20_seeds_of_20(client: openai.OpenAI) -> None:
    choices = ["yes", "no", "maybe later"]
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    for seed in SEEDS:
        r = _chat(client, temperature=0.7, seed=seed, max_tokens=16,
                  extra_body={"structured_outputs": {"choice": choices}, **NO_THINK})
        assert r.choices[0].message.content in choices, seed
        c = client.completions.create(model="tiny-chat", prompt="Call me at", temperature=0.7,
                                      seed=seed, max_tokens=24,
                                      extra_body={"guided_regex": phone})
        assert re.fullmatch(phone, c.choices[0].text), (seed, c.choices)
        assert c.choices[0].finish_reason == "stop"


def test_json_object_and_guided_json_on_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-chat", prompt="{", temperature=0.7, seed=1,
                                  max_tokens=48, extra_body={"guided_json": SCHEMA})
    assert valid(json.loads(r.choices[0].text))
    r = client.completions.create(model="tiny-chat", prompt="x", temperature=0.0,
                                  max_tokens=24,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":  # a random model may leave it open at the limit
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_logit_bias_and_penalties_in_both_routes(client: openai.OpenAI) -> None:
    target = 12095  # any id: a bias of 100 makes it the greedy choice
    r = client.completions.create(model="tiny-chat", prompt="Hello", temperature=0,
                                  max_tokens=3, logit_bias={str(target): 100},
                                  extra_body={"ignore_eos": True})
    c = client.completions.create(model="tiny-chat", prompt="Hello", temperature=0,
                                  max_tokens=3, logprobs=1, logit_bias={str(target): 100},
                                  extra_body={"return_tokens_as_token_ids": True,
                                              "ignore_eos": True})
    assert r.choices[0].text == c.choices[0].text
    assert c.choices[0].logprobs.tokens == [f"token_id:{target}"] * 3
    plain = _chat(client, temperature=0, max_tokens=12, extra_body={"ignore_eos": True,
                                                                    **NO_THINK})
    pen = _chat(client, temperature=0, max_tokens=12, frequency_penalty=2.0,
                presence_penalty=2.0, extra_body={"ignore_eos": True, "repetition_penalty": 2.0,
                                                  "min_tokens": 4, **NO_THINK})
    assert pen.choices[0].message.content != plain.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "strin"}}, "structured_outputs.json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 50}, "min_tokens"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
])
def test_malformed_or_unsupported_fields_are_a_400_naming_them(client: openai.OpenAI, extra,
                                                               param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=8, extra_body=extra)
    body = e.value.body if isinstance(e.value.body, dict) else {}
    got = body.get("param") or body.get("error", {}).get("param")
    assert got == param or param in str(e.value), (got, str(e.value))
