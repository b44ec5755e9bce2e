"""Tool calling: a request's ``tools`` / ``tool_choice`` checked and turned into what the chat
template renders and what starts the assistant turn; the model's output parsed into OpenAI
``tool_calls``, whole (``ToolPlan.extract``) or as a stream (``ToolPlan.stream``).

Formats (``--tool-call-parser``, vLLM's names ``hermes`` for Qwen3 and ``llama3_json``; ``auto``
picks by the chat template's text) are engine/server/tool_parsers.py's.

``tool_choice`` (OpenAI's; default "auto" with tools, "none" without):

    none      tools are still rendered into the prompt (as vLLM does); the output is not parsed
    auto      the output is parsed: tool calls if the model wrote them, else plain content
    required  the assistant turn is prefilled with the format's opening (hermes "<tool_call>\\n",
              llama3_json '{"name": "'), so the model writes a call
    named     {"type": "function", "function": {"name": N}}: prefilled up to the arguments, so
              the model writes only those; finish_reason stays "stop" (OpenAI's)

vLLM constrains required and named choices with a JSON schema (structured output); here the turn
is prefilled and the output parsed, so a model may still write arguments that are not valid JSON
(OpenAI's own caveat): a named call's arguments are then returned as written. A required call
that cannot be parsed comes back as content.

The conversation: an assistant message's ``tool_calls`` arguments (a JSON string, as OpenAI sends
them) reach the template parsed (as vLLM does: Llama 3's template writes them with ``tojson``), and
an assistant message with tool calls but no content gets content "" (templates concatenate it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.server.protocol import MAX_NAME_LEN, bad_request, check_json_text
from engine.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Parser,
    ToolCall,
    json_or_none,
)

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
MAX_TOOL_NAME_LEN = 64  # OpenAI's limit on a function name
MAX_TOOL_SIZE = 65536  # one tool definition: string characters + one per value
MAX_TOOL_CALLS = 128  # tool calls in one assistant message


@dataclass
class ToolPlan:
    """What one chat request does with tools: ``tools`` for the template, ``prefill`` appended to
    the rendered prompt, and how (whether) the output is parsed."""

    tools: list[dict[str, Any]] | None = None
    parser: Parser | None = None  # None: the output is not parsed
    prefill: str = ""
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.parser is not None

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named call
        keeps the engine's reason."""
        return "tool_calls" if called and self.named is None else reason

    def extract(self, output: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output (the prefill is part of the call it opens)."""
        assert self.parser is not None
        content, calls = self.parser.extract(self.prefill + output)
        if self.named is not None and not calls:
            calls, content = [ToolCall(self.named, _raw_arguments(output))], None
        elif self.prefill and not calls:
            content = output  # required, unparsable: what the model wrote
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> PlannedStream:
        return PlannedStream(self)


class PlannedStream:
    """A plan's streaming parse: the prefill fed first; named and one-call limits applied."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.parser is not None
        self.plan = plan
        self.inner = plan.parser.stream()
        self.raw: list[str] = []
        self.sent = 0  # calls emitted
        if plan.prefill:
            self.inner.feed(plan.prefill)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.raw.append(text)
        content, calls = self._limit(*self.inner.feed(text))
        # prefilled (required, named): the output is inside a call; what fails to parse comes
        # back at the end, as written
        return ("" if self.plan.prefill else content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._limit(*self.inner.finish())
        plan = self.plan
        if plan.prefill:
            content = ""
        if plan.named is not None and not self.sent and not calls:
            calls, content = [ToolCall(plan.named, _raw_arguments("".join(self.raw)))], ""
            self.sent = 1
        elif plan.prefill and not self.sent and not calls:
            content = "".join(self.raw)
        return content, calls

    def _limit(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        if not self.plan.parallel or self.plan.named is not None:
            calls = calls[:max(0, 1 - self.sent)]
        self.sent += len(calls)
        return content, calls


def _raw_arguments(output: str) -> str:
    """A named call's arguments when they do not parse: the output without the call's close."""
    t = output.strip()
    for close in (HermesParser.END,):
        if t.endswith(close):
            t = t[:-len(close)].rstrip()
    if t.endswith("}") and t.count("{") < t.count("}"):  # the outer call object's brace
        t = t[:-1].rstrip()
    return t


# -- the request side ----------------------------------------------------------------------------


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """OpenAI's function tools, checked (400 naming the field)."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported",
                              f"{where}.type")
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"{where}.function must be an object with a 'name'",
                              f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_TOOL_NAME_LEN:
            raise bad_request(f"{where}.function.name must be a string of 1 to "
                              f"{MAX_TOOL_NAME_LEN} characters", f"{where}.function.name")
        if not isinstance(f.get("description", ""), str | None):
            raise bad_request(f"{where}.function.description must be a string",
                              f"{where}.function.description")
        if not isinstance(f.get("parameters", {}), dict | None):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              f"{where}.function.parameters")
        check_json_text(t, where, MAX_TOOL_SIZE)
    return list(tools)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None) -> ToolPlan:
    """The plan of one request; ``parser_name`` is the server's (None: no known format)."""
    checked = check_tools(tools)
    names = [t["function"]["name"] for t in checked or ()]
    named = None
    if tool_choice is None:
        mode = "auto" if checked else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {tool_choice[:64]!r}: use 'none', 'auto', "
                              "'required' or {'type': 'function', 'function': {'name': ...}}",
                              "tool_choice")
        mode = tool_choice
    elif isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        named = f.get("name") if isinstance(f, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(named, str):
            raise bad_request("tool_choice must name a function: {'type': 'function', "
                              "'function': {'name': ...}}", "tool_choice")
        if named not in names:
            raise bad_request(f"tool_choice names function {named[:MAX_TOOL_NAME_LEN]!r}, "
                              "which is not among the request's tools", "tool_choice")
        mode = "named"
    else:
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
    if mode != "none" and not checked:
        raise bad_request(f"tool_choice {mode!r} needs tools: send the functions in 'tools'",
                          "tool_choice")
    if mode == "none":
        return ToolPlan(checked)
    if parser_name is None:
        raise bad_request("this server knows no tool-call format for this model (its chat "
                          "template writes neither Qwen3/Hermes <tool_call> blocks nor Llama 3 "
                          "JSON calls): start it with --tool-call-parser, or send "
                          "tool_choice 'none'", "tools")
    parser = PARSERS[parser_name]()
    prefill = "" if mode == "auto" else parser.opening(named)
    return ToolPlan(checked, parser, prefill, named, parallel_tool_calls is not False)


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tool calls as chat templates read them (see the module docstring)."""
    out = []
    for i, m in enumerate(messages):
        tcid = m.get("tool_call_id")
        if tcid is not None and (not isinstance(tcid, str) or len(tcid) > MAX_NAME_LEN):
            raise bad_request(f"messages.{i}.tool_call_id must be a string of at most "
                              f"{MAX_NAME_LEN} characters", f"messages.{i}.tool_call_id")
        calls = m.get("tool_calls")
        if calls is not None:
            m = {**m, "tool_calls": _template_calls(calls, f"messages.{i}.tool_calls")}
            if m.get("content") is None:
                m["content"] = ""
        elif m.get("role") == "tool" and m.get("content") is None:
            m = {**m, "content": ""}
        out.append(m)
    return out


def _template_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise bad_request(f"{where} must be a list of at most {MAX_TOOL_CALLS} tool calls", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", ""), str | dict) \
                or not isinstance(c.get("id", ""), str | None):
            raise bad_request(f"{where}.{j} must be {{'type': 'function', 'function': {{'name': "
                              "..., 'arguments': '<JSON>'}}}}", f"{where}.{j}")
        if len(f["name"]) > MAX_NAME_LEN or len(c.get("id") or "") > MAX_NAME_LEN:
            raise bad_request(f"{where}.{j}: a tool call's id and function name may have at most "
                              f"{MAX_NAME_LEN} characters", f"{where}.{j}")
        args = f.get("arguments", "")
        if isinstance(args, str):
            parsed = json_or_none(args)
            args = parsed if isinstance(parsed, dict) else args
        out.append({**c, "type": "function", "function": {**f, "arguments": args}})
    return out
