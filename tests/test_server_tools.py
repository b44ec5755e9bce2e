"""Tool calling (issue 18): the Qwen3/Hermes and Llama 3 JSON parsers, whole and streamed (every
split of the output streams to what the whole parse gives), the request's tools / tool_choice
checks, and the end-to-end path with the official openai client: a weather-function request comes
back as parsed ``tool_calls``, streamed and not, for auto, required and named choices, and
conversations holding assistant tool calls and tool results render through the model's template.

A random model writes no tool call by itself: ``script_outputs`` (an engine fault hook, run in the
engine core process when there is one) makes a request whose prompt names a script (SCRIPT-...)
sample that script's tokens, then EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.protocol import APIError  # noqa: E402
from engine.server.testing import SERVER_CORE, http, make_engine, running_server  # noqa: E402
from engine.server.tool_parsers import HermesParser, Llama3JsonParser, detect_parser  # noqa: E402
from engine.server.tools import ToolPlan, conversation, plan_tools  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCRIPTS = {
    "SCRIPT-HERMES": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city": "Paris"}}\n</tool_call>',
    "SCRIPT-TWO": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "SCRIPT-ARGS": '{"city": "Oslo"}}\n</tool_call>',  # after a named choice's prefill
    "SCRIPT-REQUIRED": '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "SCRIPT-LLAMA": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "SCRIPT-PLAIN": "It is sunny in Paris.",
}
# A Llama 3-style template (tools in a system turn, calls as {"name", "parameters"} JSON)
LLAMA_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}"
    "<|end_header_id|>\n\n"
    "{%- if message.tool_calls -%}{%- for tc in message.tool_calls -%}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{%- endfor -%}{%- else -%}{{ message.content }}{%- endif -%}<|eot_id|>"
    "{%- endfor -%}"
    "{%- if tools -%}<|start_header_id|>system<|end_header_id|>\n\nTools:"
    "{%- for t in tools %} {{ t | tojson }}{% endfor %}<|eot_id|>{%- endif -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif -%}")


def script_outputs(eng: Any) -> None:
    """Fault hook (``make_engine(fault="tests.test_server_tools:script_outputs")``, or called on
    an in-process engine): requests whose prompt holds a SCRIPTS key sample its tokens, then
    EOS; the others sample as the model does."""
    tok, eos = eng.tokenizer, eng.eos_token_ids[0]
    execute, scripts = eng.executor.execute, {}
    plan: list[Any] = []

    def hook(out: Any) -> None:
        plan[:] = [s.request for s in out.seqs if s.sample]

    def script_of(req: Any) -> list[int] | None:
        if req.request_id not in scripts:
            text = tok.decode(req.prompt_token_ids, False)
            name = next((k for k in SCRIPTS if k in text), None)
            scripts[req.request_id] = None if name is None else (
                tok.encode(SCRIPTS[name], add_special_tokens=False) + [eos])
        return scripts[req.request_id]

    def scripted(batch: Any) -> Any:
        step = execute(batch)
        for row, req in enumerate(plan):
            ids = script_of(req)
            if ids is not None:  # the row's step: its outputs before it (also under async
                n = int(batch.sample_steps[row])  # scheduling, where the host lags a step)
                step.sampled[row] = ids[n] if n < len(ids) else eos
        return step

    eng.fault_hook = hook
    eng.executor.execute = scripted


def scripted_engine(model_dir: Path) -> Any:
    if SERVER_CORE == "process":
        return make_engine(model_dir, core="process",
                           fault="tests.test_server_tools:script_outputs")
    eng = make_engine(model_dir)
    script_outputs(eng)
    return eng


# -- the parsers -----------------------------------------------------------------------------


def _calls(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(plan: ToolPlan, text: str, cuts: list[int]) -> tuple[str, list[Any]]:
    s = plan.stream()
    content, calls = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        c, k = s.feed(text[a:b])
        content, calls = content + c, calls + k
    c, k = s.finish()
    return content + c, calls + k


HERMES_CASES = [
    (SCRIPTS["SCRIPT-HERMES"], "Let me check.", [("get_weather", {"city": "Paris"})]),
    (SCRIPTS["SCRIPT-TWO"], None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("No tools needed <tool and all.", "No tools needed <tool and all.", []),
    ("Broken <tool_call>\n{not json}\n</tool_call>", "Broken <tool_call>\n{not json}\n</tool_call>",
     []),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # unclosed
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_streamed_at_every_split(text: str, content: str | None,
                                                  calls: list[tuple[str, Any]]) -> None:
    plan = plan_tools([WEATHER, TIME], "auto", None, "hermes")
    got_content, got_calls = plan.extract(text)
    assert got_content == content and _calls(got_calls) == calls
    for cut in range(len(text) + 1):
        s_content, s_calls = _streamed(plan, text, [cut])
        assert s_content == (content or "") and _calls(s_calls) == calls, cut
    assert _calls(_streamed(plan, text, list(range(1, len(text))))[1]) == calls  # per char


LLAMA_CASES = [
    (SCRIPTS["SCRIPT-LLAMA"], None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_time", "arguments": {}}',
     None, [("get_weather", {"city": "A"}), ("get_time", {})]),
    ("  The weather is fine.", "  The weather is fine.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(text: str, content: str | None,
                                        calls: list[tuple[str, Any]]) -> None:
    plan = plan_tools([WEATHER, TIME], "auto", None, "llama3_json")
    got_content, got_calls = plan.extract(text)
    assert got_content == content and _calls(got_calls) == calls
    for cut in range(len(text) + 1):
        s_content, s_calls = _streamed(plan, text, [cut])
        assert s_content == (content or "") and _calls(s_calls) == calls, cut


def test_named_and_required_prefill_and_limits() -> None:
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                       None, "hermes")
    assert named.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    content, calls = named.extract(SCRIPTS["SCRIPT-ARGS"])
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    assert named.finish_reason(True, "stop") == "stop"  # OpenAI's, for a named choice
    # arguments that do not parse come back as written
    assert named.extract('{"city": Oslo}}')[1][0].arguments == '{"city": Oslo}'
    required = plan_tools([WEATHER], "required", None, "llama3_json")
    assert required.prefill == '{"name": "'
    assert _calls(required.extract('get_weather", "parameters": {"city": "X"}}')[1]) == [
        ("get_weather", {"city": "X"})]
    assert required.finish_reason(True, "stop") == "tool_calls"
    one = plan_tools([WEATHER, TIME], "auto", False, "hermes")  # parallel_tool_calls false
    assert len(one.extract(SCRIPTS["SCRIPT-TWO"])[1]) == 1
    assert len(_streamed(one, SCRIPTS["SCRIPT-TWO"], [40])[1]) == 1
    assert not plan_tools([WEATHER], "none", None, "hermes").parses


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([{"type": "retrieval"}], "auto", "tools.0.type"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "auto", "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto",
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": "d" * 70_000}}], "auto",
     "tools.0"),
])
def test_bad_tools_are_400_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, None, "hermes")
    assert e.value.status == 400 and e.value.param == param


def test_unknown_format_refuses_auto_but_not_none() -> None:
    with pytest.raises(APIError) as e:
        plan_tools([WEATHER], None, None, None)
    assert e.value.param == "tools" and "--tool-call-parser" in e.value.message
    assert plan_tools([WEATHER], "none", None, None).tools == [WEATHER]


def test_detect_and_conversation() -> None:
    assert detect_parser("... <tool_call> ...") == "hermes"
    assert detect_parser(LLAMA_TEMPLATE) == "llama3_json"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None
    msgs = conversation([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                          "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                         {"role": "tool", "tool_call_id": "1"}])
    assert msgs[0]["content"] == "" and msgs[0]["tool_calls"][0]["function"]["arguments"] == \
        {"a": 1}
    assert msgs[1]["content"] == ""
    with pytest.raises(APIError) as e:
        conversation([{"role": "assistant", "tool_calls": [{"function": "f"}]}])
    assert e.value.param == "messages.0.tool_calls.0"
    with pytest.raises(APIError) as e:
        conversation([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}] * 129}])
    assert e.value.param == "messages.0.tool_calls" and "128" in e.value.message
    assert HermesParser().opening(None) == "<tool_call>\n"
    assert Llama3JsonParser().opening("f") == '{"name": "f", "parameters": '


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(scripted_engine(chat_dir), served_model_name="m") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def ask(script: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"Weather in Paris? {script}"}],
            "tools": [WEATHER, TIME], "max_tokens": 60, "extra_body": NO_THINK, **extra}


def collect_stream(chunks: Any) -> tuple[str, dict[int, dict[str, Any]], list[str | None]]:
    """Streamed chat chunks -> (content, tool calls by index, finish reasons)."""
    content, calls, finishes = "", {}, []
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return content, calls, finishes


def test_weather_tool_call_parsed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("SCRIPT-HERMES"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_weather_tool_call_streamed(client: openai.OpenAI) -> None:
    content, calls, finishes = collect_stream(client.chat.completions.create(
        **ask("SCRIPT-HERMES"), stream=True, stream_options={"include_usage": True}))
    assert content == "Let me check."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


def test_two_calls_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("SCRIPT-TWO"))
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather",
                                                                         "get_time"]
    assert r.choices[0].message.content is None
    _, calls, _ = collect_stream(client.chat.completions.create(**ask("SCRIPT-TWO"), stream=True))
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    r = client.chat.completions.create(**ask("SCRIPT-TWO"), parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_named_and_required_choices(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**ask("SCRIPT-ARGS"), tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"}
    assert r.choices[0].finish_reason == "stop"
    _, calls, _ = collect_stream(client.chat.completions.create(
        **ask("SCRIPT-ARGS"), tool_choice=named, stream=True))
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    r = client.chat.completions.create(**ask("SCRIPT-REQUIRED"), tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}


def test_no_call_and_tool_choice_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**ask("SCRIPT-PLAIN"))
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**ask("SCRIPT-HERMES"), tool_choice="none")
    assert r.choices[0].message.content == SCRIPTS["SCRIPT-HERMES"]
    assert not r.choices[0].message.tool_calls


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_conversation_with_tool_calls_renders_through_the_template(server: OpenAIServer,
                                                                    client: openai.OpenAI) -> None:
    status, out = http("POST", f"{server.url}/tokenize", {
        "messages": HISTORY, "tools": [WEATHER], **NO_THINK})
    assert status == 200, out
    text = server.engine.tokenizer.decode(out["tokens"], False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]  # the tools: system turn
    r = client.chat.completions.create(model="m", messages=[
        *HISTORY, {"role": "user", "content": "And tomorrow? SCRIPT-PLAIN"}], tools=[WEATHER],
        max_tokens=20, extra_body=NO_THINK)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.usage.prompt_tokens > out["count"]


@pytest.fixture(scope="module")
def llama_server(chat_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(scripted_engine(chat_dir), served_model_name="m",
                        chat_template=LLAMA_TEMPLATE) as s:
        yield s


def test_llama3_json_end_to_end(llama_server: OpenAIServer) -> None:
    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(**ask("SCRIPT-LLAMA"))
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"}
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    _, calls, finishes = collect_stream(client.chat.completions.create(**ask("SCRIPT-LLAMA"),
                                                                       stream=True))
    assert calls[0]["name"] == "get_weather" and finishes == ["tool_calls"]
    status, out = http("POST", f"{llama_server.url}/tokenize", {"messages": HISTORY})
    text = llama_server.engine.tokenizer.decode(out["tokens"], False)
    # the arguments reach the template parsed: its tojson writes an object, not a string
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>sunny, 21 C" in text
