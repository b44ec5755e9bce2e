"""/v1/completions and /v1/chat/completions: request -> token ids + SamplingParams -> engine ->
OpenAI's response JSON, or its server-sent-event chunks (``data: {...}`` ... ``data: [DONE]``).

A client that disconnects aborts its request (pages freed at once), streaming or not.

Tokenizing and rendering the chat template run on worker threads (``asyncio.to_thread``): a long
prompt costs seconds of tokenizer time (about 1 s a MB), which on the event loop would stall every
route, /health included; and the tokenizer call is one that releases the GIL (``Tokenizer.encode``),
else even a worker thread stalls the loop. Prompt length is checked as early as it is known: token
ids by their count first; text by its UTF-8 size before tokenizing, against a bound no
tokenization can fit under (``max_prompt_bytes``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.engine import RequestError
from engine.request import LogprobDict
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.async_engine import AsyncEngine
from engine.server.protocol import (
    INVALID_TEXT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    server_error,
    unavailable,
)
from engine.server.render import (
    chat_logprobs,
    completion_logprobs,
    error_event,
    sse,
    usage,
)
from engine.server.stream import EngineDeadError, RequestStream, StreamDelta
from engine.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
# A token covers at most the UTF-8 bytes of its longest vocabulary string (byte-level and
# SentencePiece spellings are no shorter than the bytes they stand for); the margin is for
# normalizers that shrink text (NFC composes up to 3 code points into one: at most 3x).
NORMALIZER_MARGIN = 4


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.engine.tokenizer  # encode / templates are thread-safe reads
        self.input_processor = engine.engine.input_processor
        self.max_model_len: int = engine.engine.config.max_model_len or 0
        self.vocab_size = engine.engine.model_config.vocab_size
        # text longer than this (UTF-8 bytes) cannot tokenize to fewer than max_model_len tokens
        self.max_prompt_bytes = 0 if self.tokenizer is None else (
            self.max_model_len * self.tokenizer.max_token_bytes * NORMALIZER_MARGIN)

    # -- shared checks ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"model {model!r} does not exist: this server serves "
                           f"{self.model_name!r} (see /v1/models)", 400, param="model",
                           code="model_not_found")

    def check_length(self, n_prompt: int, max_tokens: int | None, field: str) -> None:
        mml = self.max_model_len
        if n_prompt >= mml:
            raise bad_request(f"the prompt has {n_prompt} tokens, but this model's maximum "
                              f"context length is {mml} tokens and at least one must be left "
                              "to generate; shorten the prompt", "prompt",
                              "context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > mml:
            raise bad_request(f"this model's maximum context length is {mml} tokens, but "
                              f"{n_prompt + max_tokens} were requested ({n_prompt} in the "
                              f"prompt, {max_tokens} for the completion); reduce the prompt "
                              f"or {field}", field, "context_length_exceeded")

    def check_text_size(self, text: str, field: str) -> None:
        """Refuses text too large for any tokenization of it to fit, without tokenizing it."""
        limit = self.max_prompt_bytes
        if len(text) * 4 <= limit:  # UTF-8 takes at most 4 bytes a character
            return
        size = len(text.encode("utf-8"))
        if size > limit:
            what = "the prompt" if field == "prompt" else "the rendered conversation"
            raise bad_request(f"{what} is {size} bytes of text, more than any prompt that fits "
                              f"this model's maximum context length of {self.max_model_len} "
                              f"tokens can be (at most {limit} bytes with this vocabulary); "
                              "shorten the prompt", field, "context_length_exceeded")

    async def _start(self, ids: list[int], params: SamplingParams, rid: str) -> RequestStream:
        try:
            return await self.engine.add(ids, params, rid)
        except (RequestError, SamplingParamsError) as e:
            raise bad_request(str(e), getattr(e, "field", None)) from None
        except EngineDeadError as e:
            raise unavailable(str(e)) from None

    # -- /v1/completions -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompt = body.single_prompt()
        if not isinstance(prompt, str):  # token ids: their count is known before anything else
            self.check_length(len(prompt), body.max_tokens, "max_tokens")
        self.check_model(body.model)
        body.check_supported()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as a list of "
                                  "token ids", "prompt")
            self.check_text_size(prompt, "prompt")
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise bad_request("the prompt is empty: it must have at least one token", "prompt")
        self.check_length(len(ids), body.max_tokens, "max_tokens")
        params = body.sampling_params(body.max_tokens, body.logprobs, self.vocab_size)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._start(ids, params, rid)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            return _sse_response(self._completion_chunks(stream, head, body), stream, request)
        d = await _collect(stream, request)
        if d is None:
            return Response(status_code=499)
        lp = None
        if body.logprobs is not None:
            lp, _ = completion_logprobs(d.token_ids, d.logprobs or [], 0,
                                        bool(body.return_tokens_as_token_ids))
        choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                  "stop_reason": d.stop_reason}
        return JSONResponse({**head, "choices": [choice], "usage": usage(d)})

    async def _completion_chunks(self, stream: RequestStream, head: dict[str, Any],
                                 body: CompletionRequest) -> AsyncIterator[bytes]:
        offset = 0

        def choice(d: StreamDelta) -> dict[str, Any]:
            nonlocal offset
            lp = None
            if body.logprobs is not None:
                lp, offset = completion_logprobs(d.token_ids, d.logprobs or [], offset,
                                                 bool(body.return_tokens_as_token_ids))
            return {"index": 0, "text": d.text, "logprobs": lp,
                    "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

        async for chunk in _delta_chunks(stream, head, body.include_usage(), choice):
            yield chunk

    # -- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        tok = self.tokenizer
        if tok is None or not tok.chat_template:
            raise bad_request("this model has no chat template: use /v1/completions",
                              "messages")
        messages = body.template_messages()
        kwargs = body.template_kwargs()
        ids = await asyncio.to_thread(self._render, tok, messages,
                                      body.add_generation_prompt is not False, kwargs)
        if not ids:
            raise bad_request("the rendered conversation is empty", "messages")
        limit = body.output_limit()
        self.check_length(len(ids), limit, "max_completion_tokens"
                          if body.max_completion_tokens is not None else "max_tokens")
        params = body.sampling_params(limit, body.num_logprobs(), self.vocab_size)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._start(ids, params, rid)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return _sse_response(self._chat_chunks(stream, head, body), stream, request)
        d = await _collect(stream, request)
        if d is None:
            return Response(status_code=499)
        lp = None
        if body.logprobs:
            lp = {"content": chat_logprobs(d.token_ids, d.logprobs or [],
                                           body.top_logprobs or 0,
                                           bool(body.return_tokens_as_token_ids))}
        choice = {"index": 0, "message": {"role": "assistant", "content": d.text},
                  "logprobs": lp, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        return JSONResponse({**head, "choices": [choice], "usage": usage(d)})

    def _render(self, tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: dict[str, Any]) -> list[int]:
        """Worker thread: the conversation through the chat template, then the tokenizer."""
        try:
            text = self.input_processor.render_chat(messages, add_generation_prompt, **kwargs)
        except RequestError:  # a template variable the checks did not reach
            raise bad_request(f"the rendered conversation is {INVALID_TEXT}", "messages") \
                from None
        except Exception as e:  # the template is user-facing input validation (raise_exception)
            raise bad_request(f"the chat template could not render these messages: {e}",
                              "messages") from None
        self.check_text_size(text, "messages")
        return tok.encode(text, add_special_tokens=False)

    async def _chat_chunks(self, stream: RequestStream, head: dict[str, Any],
                           body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        extra = {"usage": None} if body.include_usage() else {}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield sse({**head, "choices": [first], **extra})

        def choice(d: StreamDelta) -> dict[str, Any]:
            lp = None
            if body.logprobs:
                lp = {"content": chat_logprobs(d.token_ids, d.logprobs or [],
                                               body.top_logprobs or 0,
                                               bool(body.return_tokens_as_token_ids))}
            return {"index": 0, "delta": {"content": d.text} if d.text else {},
                    "logprobs": lp, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason}

        async for chunk in _delta_chunks(stream, head, body.include_usage(), choice):
            yield chunk


# -- plumbing ------------------------------------------------------------------------------------


async def _delta_chunks(stream: RequestStream, head: dict[str, Any], with_usage: bool,
                        choice: Callable[[StreamDelta], dict[str, Any]]) -> AsyncIterator[bytes]:
    """The SSE events of a streamed completion or chat completion: one chunk per non-empty delta
    (``choice`` renders it), an error event if the request failed, the usage chunk when asked
    for, then ``[DONE]``."""
    extra = {"usage": None} if with_usage else {}
    async for d in stream:
        if d.finish_reason == "error":
            yield error_event(d)
            break
        if not (d.text or d.token_ids or d.finished):
            continue
        yield sse({**head, "choices": [choice(d)], **extra})
        if d.finished and with_usage:
            yield sse({**head, "choices": [], "usage": usage(d)})
    yield DONE
async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    """Waits for the client to go away (ASGI ``http.disconnect``), then aborts the request."""
    while not stream.finished:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.abort()
            return


async def _collect(stream: RequestStream, request: Request) -> StreamDelta | None:
    """All deltas of a non-streamed request merged into one; None if the client left.
    Raises the HTTP error a failed request gets (500; 503 when the engine died)."""
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, stream))
    text: list[str] = []
    toks: list[int] = []
    lps: list[LogprobDict] = []
    last: StreamDelta | None = None
    try:
        async for d in stream:
            text.append(d.text)
            toks += d.token_ids
            lps += d.logprobs or []
            last = d
    finally:
        watcher.cancel()
        stream.abort()
    if last is None or stream.aborted:
        return None
    if last.finish_reason == "error":
        msg = f"the request failed (finish_reason 'error'): {last.error}"
        raise unavailable(msg) if last.fatal else server_error(msg)
    last.text, last.token_ids, last.logprobs = "".join(text), toks, lps
    return last


def _sse_response(chunks: AsyncIterator[bytes], stream: RequestStream,
                  request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        watcher = asyncio.ensure_future(_abort_on_disconnect(request, stream))
        try:
            async for c in chunks:
                yield c
        finally:
            watcher.cancel()
            stream.abort()  # no-op once finished

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
