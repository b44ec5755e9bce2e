"""OpenAI request bodies (pydantic, strict types), the error JSON, and the mapping of a request's
sampling fields onto ``SamplingParams``.

Types are strict, as OpenAI's API is: ``"max_tokens": "5"`` is a 400, not a coerced 5. Unknown
fields are accepted and ignored (clients send vendor extras); fields the engine cannot honor
(``suffix``, beam search...) are refused with a 400 that names them.

Sampling fields a request leaves out (or sends as null) stay unset in ``SamplingParams``: the
model's generation_config.json defaults fill them (``--generation-config auto``, as vLLM), else
the built-in ones; a field that is sent, even with the built-in value, is the request's.

Everything a client controls is bounded (the MAX_* below; the body as a whole by
``--max-request-bytes``), so one request cannot make a step slow for the batch it joins, and every
string that reaches the tokenizer, the chat template or the engine is valid Unicode: JSON can spell
a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode (400, naming the field).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)
from engine.server.structured_outputs import (
    FieldError,
    check_unsupported,
    processor_kwargs,
    structured_outputs,
)

# MAX_STOP_* and MAX_LOGPROBS are the engine's (SamplingParams checks them too); these the API's
MAX_LOGIT_BIAS = 1024  # entries (SamplingParams' bound too)
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256  # per message
MAX_NAME_LEN = 1024  # model, user, message name (characters)
MAX_ROLE_LEN = 64  # role and content part type
MAX_TOOLS = 128
MAX_N = 16  # choices per prompt (each one its own engine request)
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_COMPLETIONS = 64  # prompts x n: the engine requests one API request may start
MAX_TEMPLATE_KWARGS = 64  # keys of chat_template_kwargs
MAX_TEMPLATE_KWARGS_SIZE = 65536  # chat_template_kwargs: string characters + one per value


class APIError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, status: int = 400, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(message, 503, type="service_unavailable_error", code="engine_unavailable")


def server_error(message: str) -> APIError:
    return APIError(message, 500, type="server_error", code="internal_error")


INVALID_TEXT = ("invalid text: it contains a lone UTF-16 surrogate (such as \\ud800), which is "
                "not a Unicode character; send valid Unicode text")


def is_text(s: str) -> bool:
    """True unless ``s`` holds a lone surrogate (what no UTF-8 encoder, hence no tokenizer,
    accepts)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(s: str) -> str:
    if not is_text(s):
        raise PydanticCustomError("invalid_text", INVALID_TEXT)
    return s


Text = Annotated[str, AfterValidator(_text)]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_LEN), AfterValidator(_text)]
Role = Annotated[str, StringConstraints(max_length=MAX_ROLE_LEN), AfterValidator(_text)]
Salt = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LEN),
                 AfterValidator(_text)]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_LEN),
                       AfterValidator(_text)]


def check_json_text(value: Any, where: str, max_size: int | None = None) -> None:
    """Free-form JSON a client sends on to the chat template (``chat_template_kwargs``, message
    fields the model does not declare): valid text throughout, and at most ``max_size`` (string
    characters plus one per value) when given. Iterative: JSON may nest deeper than the stack."""
    stack: list[tuple[str, Any]] = [(where, value)]
    size = 0
    while stack:
        path, v = stack.pop()
        size += 1
        if isinstance(v, str):
            size += len(v)
            if not is_text(v):
                raise bad_request(f"{path}: {INVALID_TEXT}", path)
        elif isinstance(v, dict):
            size += len(v)
            for k in v:
                if not is_text(k):
                    raise bad_request(f"{path}: a key is {INVALID_TEXT}", path)
                size += len(k)
            stack.extend((f"{path}.{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            size += len(v)
            stack.extend((f"{path}.{i}", x) for i, x in enumerate(v))
        if max_size is not None and size > max_size:
            raise bad_request(f"{where} is too large: at most {max_size} (string characters plus "
                              "one per value) is allowed", where)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk (with the above)


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: Name | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Name | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    # logits processors and structured output (engine/server/structured_outputs.py; vLLM's
    # structured_outputs and guided_* extras are read from the extra fields there)
    min_tokens: int | None = Field(None, ge=0)
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    response_format: dict[str, Any] | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the prefix-cache namespace (vLLM's): prompts cached under another salt are not reused
    cache_salt: Salt | None = None

    def check_supported(self) -> None:
        try:  # vLLM fields this server does not implement; one structured-output source
            check_unsupported(self.model_extra)
            structured_outputs(self)
        except FieldError as e:
            raise bad_request(str(e), e.param) from None
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, with include_usage."""
        return self.include_usage() and bool(self.stream_options
                                             and self.stream_options.continuous_usage_stats)

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        vocab_size: int) -> SamplingParams:
        top_k = self.top_k
        if top_k is not None and top_k >= vocab_size:  # keeps every token: the same as off
            top_k = 0  # (and fits the int32 batch)
        try:  # None = unset: the model's default, else the built-in one
            return SamplingParams(
                **processor_kwargs(self),
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=top_k, min_p=self.min_p, seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                prompt_logprobs=self.num_prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens is not False,
                include_stop_str_in_output=bool(self.include_stop_str_in_output))
        except SamplingParamsError as e:
            raise bad_request(str(e), e.field) from None
        except FieldError as e:
            raise bad_request(str(e), e.param) from None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a list of either
    (up to MAX_PROMPTS prompts, each with its ``n`` choices)."""

    prompt: (Text | list[int] | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
             | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise bad_request(f"best_of={self.best_of} with n={n}: best_of must equal n (this "
                              "server returns every choice it samples)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids; at least one, none empty-listed."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty: send a string, token ids, or a list of them",
                              "prompt")
        if isinstance(p[0], str | list):
            if len(p) * (self.n or 1) > MAX_COMPLETIONS:
                raise bad_request(f"{len(p)} prompts x n={self.n or 1} is more than "
                                  f"{MAX_COMPLETIONS} completions in one request; send fewer",
                                  "n")
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def num_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs (vLLM's)
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ContentPart(_Body):
    type: Role
    text: Text | None = None


class ChatMessage(_Body):
    role: Role
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions, rendered with the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None  # checked by engine.server.tools
    parallel_tool_calls: bool | None = None
    # vLLM's extras: template variables (Qwen3: enable_thinking) and the generation prompt
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    add_generation_prompt: bool | None = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, checked: the template sees them as variables."""
        kwargs = dict(self.chat_template_kwargs or {})
        for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs may not set {reserved!r}",
                                  "chat_template_kwargs")
        check_json_text(kwargs, "chat_template_kwargs", MAX_TEMPLATE_KWARGS_SIZE)
        return kwargs

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: content parts joined into text."""
        out = []
        for i, m in enumerate(self.messages):
            if m.model_extra:  # e.g. reasoning_content, tool_calls: the template may read them
                check_json_text(m.model_extra, f"messages.{i}")
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"content part of type {part.type!r}: only text parts "
                                          "are supported", f"messages.{i}.content")
                    texts.append(part.text)
                d["content"] = "\n".join(texts)
            out.append(d)
        return out


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat template
    as /v1/chat/completions renders them (``tools`` and ``chat_template_kwargs`` included)."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None \
        = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool | None = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of prompt and messages", "prompt")

    def chat(self) -> ChatCompletionRequest:
        """The messages as a chat request, for the chat path's rendering and checks."""
        return ChatCompletionRequest(messages=self.messages or [],
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     tools=self.tools, tool_choice="none",
                                     add_generation_prompt=self.add_generation_prompt)


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids -> text."""

    model: Name | None = None
    tokens: list[int]
