"""/v1/completions, /v1/chat/completions, /tokenize and /detokenize: request -> token ids +
SamplingParams -> the engine requests of its choices (``ChoiceGroup``: ``n`` per prompt) ->
OpenAI's response JSON, or its server-sent-event chunks (``data: {...}`` ... ``data: [DONE]``),
rendered by engine/server/responses.py.

A client that disconnects aborts its requests (pages freed at once), streaming or not.

Tokenizing and rendering the chat template run on worker threads (``asyncio.to_thread``): a long
prompt costs seconds of tokenizer time (about 1 s a MB), which on the event loop would stall every
route, /health included; and the tokenizer call is one that releases the GIL (``Tokenizer.encode``),
else even a worker thread stalls the loop. Prompt length is checked as early as it is known: token
ids by their count first; text by its UTF-8 size before tokenizing, against a bound no
tokenization can fit under (``max_prompt_bytes``).

The prefix-cache namespace of a request (``salt``): its API key's (engine/server/auth.py), then
its own ``cache_salt``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine import tracepoints
from engine.engine import RequestError
from engine.request import LogprobDict
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.async_engine import AsyncEngine
from engine.server.auth import request_salt
from engine.server.choices import ChoiceGroup, make_choices
from engine.server.protocol import (
    INVALID_TEXT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    server_error,
    unavailable,
)
from engine.server.responses import ChatRendering, CompletionRendering
from engine.server.stream import EngineDeadError, StreamDelta
from engine.server.tool_parsers import PARSERS, detect_parser
from engine.server.tools import conversation, plan_tools
from engine.tokenizer import Tokenizer

# A token covers at most the UTF-8 bytes of its longest vocabulary string (byte-level and
# SentencePiece spellings are no shorter than the bytes they stand for); the margin is for
# normalizers that shrink text (NFC composes up to 3 code points into one: at most 3x).
NORMALIZER_MARGIN = 4


def resolve_tool_parser(name: str, tokenizer: Tokenizer | None) -> str | None:
    """--tool-call-parser: "auto" (by the chat template), "none", or a format's name."""
    if name == "auto":
        return detect_parser(tokenizer.chat_template if tokenizer is not None else None)
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"tool call parser {name!r}: use auto, none or one of {sorted(PARSERS)}")
    return name


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str,
                 tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.engine.tokenizer  # encode / templates are thread-safe reads
        self.input_processor = engine.engine.input_processor
        config = engine.engine.config
        self.max_model_len: int = config.max_model_len or 0
        self.block_size: int = config.block_size
        self.prefix_caching: bool = config.enable_prefix_caching
        self.vocab_size = engine.engine.model_config.vocab_size
        self.tool_parser = resolve_tool_parser(tool_call_parser, self.tokenizer)
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
                              "shorten the prompt", field, code="context_length_exceeded")

    def need_tokenizer(self, what: str, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what}", field)
        return self.tokenizer

    @staticmethod
    def salt(body: Any, request: Request) -> str | None:
        return request_salt(request.scope.get("state", {}).get("key_salt"), body.cache_salt)

    async def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     n: int, salt: str | None) -> ChoiceGroup:
        # siblings wait for the first copy's prefill when they can then share its pages
        stagger = (n > 1 and self.prefix_caching and params.prompt_logprobs is None
                   and any((len(p) - 1) // self.block_size >= 1 for p in prompts))
        group = ChoiceGroup(self.engine, make_choices(request_id, prompts, params, n), salt,
                            stagger)
        try:
            await group.start()
        except (RequestError, SamplingParamsError) as e:
            raise bad_request(str(e), getattr(e, "field", None)) from None
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        return group

    # -- /v1/completions -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts()
        for p in prompts:  # token ids: their count is known before anything else
            if not isinstance(p, str):
                self.check_length(len(p), body.max_tokens, "max_tokens")
        self.check_model(body.model)
        body.check_supported()
        ids_list: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                tok = self.need_tokenizer("send the prompt as a list of token ids", "prompt")
                self.check_text_size(p, "prompt")
                ids = await asyncio.to_thread(tok.encode, p)
            else:
                ids = list(p)
            if not ids:
                raise bad_request("the prompt is empty: it must have at least one token",
                                  "prompt")
            self.check_length(len(ids), body.max_tokens, "max_tokens")
            ids_list.append(ids)
        params = body.sampling_params(body.max_tokens, body.logprobs, self.vocab_size)
        r = CompletionRendering(
            {}, ids_list, body.n or 1, body.logprobs, bool(body.return_tokens_as_token_ids),
            body.prompt_logprobs is not None, body.include_usage(), body.continuous_usage())
        if body.echo:
            tok = self.need_tokenizer("echo needs one to spell the prompt", "echo")
            r.echo_texts = [p if isinstance(p, str) else
                            await asyncio.to_thread(tok.decode, ids, False)
                            for p, ids in zip(prompts, ids_list, strict=True)]
            r.decode = lambda t: tok.decode([t], False)
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = await self._start(rid, ids_list, params, r.n, self.salt(body, request))
        r.head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                  "model": self.model_name}
        if body.stream:
            return _sse_response(r.chunks(group), group, request)
        finals = await _collect(group, request)
        return Response(status_code=499) if finals is None else JSONResponse(r.body(finals))

    # -- /v1/chat/completions --------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check_supported()
        tok = self.tokenizer
        if tok is None or not tok.chat_template:
            raise bad_request("this model has no chat template: use /v1/completions",
                              "messages")
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          self.tool_parser)
        messages = conversation(body.template_messages())
        kwargs = body.template_kwargs()
        ids = await asyncio.to_thread(self._render, tok, messages,
                                      body.add_generation_prompt is not False, kwargs,
                                      plan.tools, plan.prefill)
        if not ids:
            raise bad_request("the rendered conversation is empty", "messages")
        limit = body.output_limit()
        self.check_length(len(ids), limit, "max_completion_tokens"
                          if body.max_completion_tokens is not None else "max_tokens")
        params = body.sampling_params(limit, body.num_logprobs(), self.vocab_size)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        r = ChatRendering(
            {"id": rid, "object": "chat.completion", "created": int(time.time()),
             "model": self.model_name}, [ids], body.n or 1, body.num_logprobs(),
            bool(body.return_tokens_as_token_ids), body.prompt_logprobs is not None,
            body.include_usage(), body.continuous_usage(), plan=plan)
        group = await self._start(rid, [ids], params, r.n, self.salt(body, request))
        if body.stream:
            r.head["object"] = "chat.completion.chunk"
            return _sse_response(r.chunks(group), group, request)
        finals = await _collect(group, request)
        return Response(status_code=499) if finals is None else JSONResponse(r.body(finals))

    def _render(self, tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None,
                prefill: str = "", add_special_tokens: bool = False) -> list[int]:
        """Worker thread: the conversation through the chat template (``prefill`` opening the
        assistant turn), then the tokenizer."""
        try:
            text = self.input_processor.render_chat(messages, add_generation_prompt, tools=tools,
                                                    **kwargs)
        except RequestError:  # a template variable the checks did not reach
            raise bad_request(f"the rendered conversation is {INVALID_TEXT}", "messages") \
                from None
        except Exception as e:  # the template is user-facing input validation (raise_exception)
            raise bad_request(f"the chat template could not render these messages: {e}",
                              "messages") from None
        text += prefill
        self.check_text_size(text, "messages")
        return tok.encode(text, add_special_tokens=add_special_tokens)

    # -- /tokenize, /detokenize (vLLM's) ---------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        body.check_supported()
        if body.prompt is not None:
            tok = self.need_tokenizer("it cannot tokenize text", "prompt")
            self.check_text_size(body.prompt, "prompt")
            ids = await asyncio.to_thread(tok.encode, body.prompt,
                                          body.add_special_tokens is not False)
        else:
            tok = self.need_tokenizer("it cannot render messages", "messages")
            if not tok.chat_template:
                raise bad_request("this model has no chat template: send a prompt", "messages")
            try:
                chat = body.chat()
            except ValidationError as e:
                raise bad_request(f"messages: {e.errors()[0].get('msg')}", "messages") from None
            plan = plan_tools(chat.tools, "none", None, None)
            ids = await asyncio.to_thread(self._render, tok, conversation(
                chat.template_messages()), body.add_generation_prompt is not False,
                chat.template_kwargs(), plan.tools, "", bool(body.add_special_tokens))
        strs = None
        if body.return_token_strs:
            backend = tok.backend_tokenizer
            strs = [backend.id_to_token(t) or "" for t in ids]
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        tok = self.need_tokenizer("it cannot spell token ids", "tokens")
        if len(body.tokens) > self.max_model_len:
            raise bad_request(f"{len(body.tokens)} tokens: at most max_model_len "
                              f"({self.max_model_len}) at once", "tokens")
        vocab = min(self.vocab_size, tok.vocab_size)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens, False)}


# -- plumbing ------------------------------------------------------------------------------------


async def _abort_on_disconnect(request: Request, group: ChoiceGroup) -> None:
    """Waits for the client to go away (ASGI ``http.disconnect``), then aborts the requests."""
    while not group.finished:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.abort()
            return


async def _collect(group: ChoiceGroup, request: Request) -> dict[int, StreamDelta] | None:
    """Each choice's deltas merged into one; None if the client left. Raises the HTTP error a
    failed choice gets (500; 503 when the engine died)."""
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, group))
    text: dict[int, list[str]] = {}
    toks: dict[int, list[int]] = {}
    lps: dict[int, list[LogprobDict]] = {}
    prompt_lps: dict[int, list[LogprobDict | None]] = {}
    last: dict[int, StreamDelta] = {}
    try:
        async for i, d in group:
            text.setdefault(i, []).append(d.text)
            toks.setdefault(i, []).extend(d.token_ids)
            lps.setdefault(i, []).extend(d.logprobs or [])
            if d.prompt_logprobs is not None:
                prompt_lps[i] = d.prompt_logprobs
            last[i] = d
    finally:
        watcher.cancel()
        group.abort()
    if group.aborted or len(last) < len(group.choices):
        return None
    for d in last.values():
        if d.finish_reason == "error":
            msg = f"the request failed (finish_reason 'error'): {d.error}"
            raise unavailable(msg) if d.fatal else server_error(msg)
    for i, d in last.items():
        d.text, d.token_ids, d.logprobs = "".join(text[i]), toks[i], lps[i]
        d.prompt_logprobs = prompt_lps.get(i)
    return last


def _sse_response(chunks: AsyncIterator[bytes], group: ChoiceGroup,
                  request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        watcher = asyncio.ensure_future(_abort_on_disconnect(request, group))
        key = id(group)
        try:
            async for c in chunks:
                if tracepoints.mark is not None:
                    tracepoints.mark("sse", key)
                yield c
        finally:
            watcher.cancel()
            group.abort()  # no-op once finished

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
