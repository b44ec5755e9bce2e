"""OpenAI request bodies (pydantic, strict types), the error JSON, and the mapping of a request's
sampling fields onto ``SamplingParams``.

Types are strict, as OpenAI's API is: ``"max_tokens": "5"`` is a 400, not a coerced 5. Unknown
fields are accepted and ignored (clients send vendor extras); fields the engine cannot honor
(``n`` > 1, penalties, ``logit_bias``, ``echo``, tools...) are refused with a 400 that names them.

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
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)

# MAX_STOP_* and MAX_LOGPROBS are the engine's (SamplingParams checks them too); these the API's
MAX_LOGIT_BIAS = 1024  # entries (refused anyway while logit_bias is unsupported)
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256  # per message
MAX_NAME_LEN = 1024  # model, user, message name (characters)
MAX_ROLE_LEN = 64  # role and content part type
MAX_TOOLS = 128  # refused anyway while tools are unsupported
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


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: Name | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Name | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = None  # refused unless 1 (a model default is ignored)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N"

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request(f"n={self.n} is not supported: this server returns one choice per "
                              "request (n=1); send separate requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported; leave it at 0", name)
        if self.repetition_penalty not in (None, 1.0):
            raise bad_request("repetition_penalty is not supported; leave it at 1",
                              "repetition_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        vocab_size: int) -> SamplingParams:
        top_k = self.top_k
        if top_k is not None and top_k >= vocab_size:  # keeps every token: the same as off
            top_k = 0  # (and fits the int32 batch)
        try:  # None = unset: the model's default, else the built-in one
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=top_k, min_p=self.min_p, seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens is not False,
                include_stop_str_in_output=bool(self.include_stop_str_in_output))
        except SamplingParamsError as e:
            raise bad_request(str(e), e.field) from None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a one-element list of
    either (batches of prompts are refused: send one request per prompt)."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported (only 1)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise bad_request(f"got {len(p)} prompts: this server takes one prompt per "
                                  "request", "prompt")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


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
    response_format: dict[str, Any] | None = None
    # vLLM's extras: template variables (Qwen3: enable_thinking) and the generation prompt
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    add_generation_prompt: bool | None = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        rf = self.response_format
        if rf and rf.get("type") not in (None, "text"):
            raise bad_request("response_format other than {'type': 'text'} is not supported",
                              "response_format")
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
