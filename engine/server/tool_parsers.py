"""The tool-call formats a model writes, parsed from its output whole (``extract``) or as it
streams (``stream()``: ``feed`` each text delta, then ``finish``) into OpenAI tool calls. Every
split of an output streams to what the whole parse gives (tests/test_server_tools.py).

    hermes       Qwen3 (and Qwen2.5, Hermes): <tool_call>\n{"name": N, "arguments": {...}}\n
                 </tool_call>, one block per call; text before the first block is the content
    llama3_json  Llama 3.x: {"name": N, "parameters": {...}}, optionally after <|python_tag|>,
                 several separated by ";"; the whole output is the calls (no content)

``opening(function)`` is the text that starts a call (of ``function``: up to its arguments), the
prefill of a required or named tool choice (engine/server/tools.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.to_json()}


def _call(obj: Any) -> ToolCall | None:
    """{"name": N, "arguments" | "parameters": {...}} -> ToolCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False))


def json_or_none(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


class Parser(Protocol):
    name: str

    def opening(self, function: str | None) -> str: ...
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]: ...
    def stream(self) -> ToolStream: ...


class ToolStream(Protocol):
    def feed(self, text: str) -> tuple[str, list[ToolCall]]: ...
    def finish(self) -> tuple[str, list[ToolCall]]: ...


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def opening(self, function: str | None) -> str:
        if function is None:
            return f"{self.START}\n"
        return f'{self.START}\n{{"name": {json.dumps(function)}, "arguments": '

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.START)
        if first < 0:
            return text, []
        calls = []
        for piece in text[first + len(self.START):].split(self.START):
            call = self.parse_block(piece.split(self.END, 1)[0])
            if call is None:  # not the format after all: all of it is content (vLLM's rule)
                return text, []
            calls.append(call)
        return text[:first].rstrip() or None, calls

    @staticmethod
    def parse_block(block: str) -> ToolCall | None:
        return _call(json_or_none(block.strip()))

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """Content until a ``<tool_call>`` (a tail that could start one is held back, and trailing
    whitespace, which the whole-output parse strips before a call), then one call per block, as
    soon as its ``</tool_call>`` arrives; text between and after calls is dropped. A block that
    does not parse is content after all, as the whole-output parse says."""

    def __init__(self, parser: HermesParser) -> None:
        self.p = parser
        self.buf = ""  # unread: a possible marker's start, or the open block
        self.held = ""  # whitespace before what comes next (dropped if a call comes)
        self.in_call = False
        self.seen_call = False

    def _content(self, text: str) -> str:
        """Emit ``held + text`` but its trailing whitespace, which is held."""
        text = self.held + text
        stripped = text.rstrip()
        self.held = text[len(stripped):]
        return stripped

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, calls = "", []
        start, end = self.p.START, self.p.END
        while True:
            if not self.in_call:
                i = self.buf.find(start)
                cut = i if i >= 0 else len(self.buf) - _held_tail(self.buf, start)
                if not self.seen_call:
                    content += self._content(self.buf[:cut])
                if i < 0:
                    self.buf = self.buf[cut:]
                    break
                self.buf, self.in_call = self.buf[i + len(start):], True
                continue
            j = self.buf.find(end)
            if j < 0:
                break
            call = self.p.parse_block(self.buf[:j])
            if call is not None:
                calls.append(call)
                self.seen_call, self.held = True, ""
            elif not self.seen_call:
                content += self._content(start + self.buf[:j + len(end)])
            self.buf, self.in_call = self.buf[j + len(end):], False
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, held, self.buf, self.held = self.buf, self.held, "", ""
        if self.in_call:  # cut off (length) or never closed: parse what is there
            call = self.p.parse_block(buf)
            if call is not None:
                return "", [call]
            return ("" if self.seen_call else held + self.p.START + buf), []
        return ("" if self.seen_call else held + buf), []


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def opening(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function)}, "parameters": '

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        t = text.strip()
        if t.startswith(self.TAG):
            t = t[len(self.TAG):].lstrip()
        if not t.startswith("{"):
            return text, []
        calls, pos = [], 0
        while pos < len(t):
            try:
                obj, pos = _DECODER.raw_decode(t, pos)
            except ValueError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(t) and (t[pos].isspace() or t[pos] == ";"):
                pos += 1
        return None, calls

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)


class Llama3JsonStream:
    """Undecided while the output is whitespace or a prefix of ``<|python_tag|>``; then either
    plain content (streamed as it comes) or JSON calls (held, parsed at the end)."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        self.p = parser
        self.buf = ""
        self.mode: str | None = None  # None (undecided), "content" or "json"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "content":
            return text, []
        self.buf += text
        if self.mode is None:
            t = self.buf.lstrip()
            if not t or (self.p.TAG.startswith(t) and t != self.p.TAG):
                return "", []
            self.mode = "json" if t.startswith(("{", self.p.TAG)) else "content"
            if self.mode == "content":
                out, self.buf = self.buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self.buf = self.buf, ""
        if self.mode == "content" or not buf:
            return buf, []
        content, calls = self.p.extract(buf)
        return (content or "", calls)


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser}


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes, or None."""
    if not chat_template:
        return None
    if HermesParser.START in chat_template:
        return "hermes"
    if Llama3JsonParser.TAG in chat_template or (
            '"parameters"' in chat_template and "<|start_header_id|>" in chat_template):
        return "llama3_json"
    return None
