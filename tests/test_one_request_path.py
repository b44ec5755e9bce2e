"""One request, every front end: ``LLM.generate``, ``LLM.stream``, the server (completions and
chat, streamed and not) and ``cuteinfer generate`` all go through the same input processor, core
and output processor, so they give the same token ids and the same text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from engine import LLM, SamplingParams  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    http,
    make_engine,
    running_server,
)

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm(chat_dir: Path) -> LLM:
    return LLM(str(chat_dir), backend="numpy", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def url(chat_dir: Path) -> Iterator[str]:
    # its own engine: the server's engine thread owns it (LLM calls would race with it)
    with running_server(make_engine(chat_dir, core=SERVER_CORE, max_model_len=MAX_MODEL_LEN),
                        served_model_name="m") as s:
        yield s.url


SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
BODY = {"model": "m", "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 0,
        "return_tokens_as_token_ids": True}
CHAT_BODY = {"model": "m", "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True,
             "return_tokens_as_token_ids": True}


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.split(":")[1]) for t in tokens]


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, text = http("POST", url, {**body, "stream": True})
    assert status == 200, text
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _cli(chat_dir: Path, *extra: str, prompt: str) -> str:
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", prompt, "--model",
                        str(chat_dir), "--backend", "numpy", "--max-tokens", str(MAX_TOKENS),
                        "--max-model-len", str(MAX_MODEL_LEN), *extra],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n = int(re.search(r"\[cuteinfer\] (\d+) tokens in", r.stderr).group(1))  # type: ignore[union-attr]
    text = r.stdout[:-1] if r.stdout.endswith("\n") else r.stdout  # the CLI ends the line
    return f"{n}:{text}"


def test_completion_is_the_same_through_every_front_end(llm: LLM, url: str,
                                                        chat_dir: Path) -> None:
    ref = llm.generate(PROMPT, SP)[0].outputs[0]
    assert ref.token_ids, "no token generated"
    streamed = list(llm.stream(PROMPT, SP))
    assert [t for e in streamed for t in e.delta_token_ids] == ref.token_ids
    assert "".join(e.delta_text for e in streamed) == ref.text
    assert streamed[-1].finish_reason == ref.finish_reason

    status, body = http("POST", f"{url}/v1/completions", {**BODY, "prompt": PROMPT})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert _ids(choice["logprobs"]["tokens"]) == ref.token_ids

    chunks = _sse(f"{url}/v1/completions", {**BODY, "prompt": PROMPT})
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert [t for c in chunks for t in _ids(c["choices"][0]["logprobs"]["tokens"])] \
        == ref.token_ids

    assert _cli(chat_dir, "--raw", prompt=PROMPT) == f"{len(ref.token_ids)}:{ref.text}"


def test_chat_is_the_same_through_every_front_end(llm: LLM, url: str, chat_dir: Path) -> None:
    ref = llm.chat(MESSAGES, SP)[0].outputs[0]
    assert ref.token_ids, "no token generated"
    status, body = http("POST", f"{url}/v1/chat/completions", {**CHAT_BODY,
                                                                "messages": MESSAGES})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == ref.text
    assert choice["finish_reason"] == ref.finish_reason
    assert _ids([e["token"] for e in choice["logprobs"]["content"]]) == ref.token_ids

    chunks = _sse(f"{url}/v1/chat/completions", {**CHAT_BODY, "messages": MESSAGES})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    ids = [t for c in chunks if c["choices"][0].get("logprobs")
           for t in _ids([e["token"] for e in c["choices"][0]["logprobs"]["content"]])]
    assert text == ref.text and ids == ref.token_ids

    assert _cli(chat_dir, prompt=MESSAGES[0]["content"]) == f"{len(ref.token_ids)}:{ref.text}"
