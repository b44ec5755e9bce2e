"""Before the core: a prompt (text, token ids, or chat messages) -> validated token ids.

Every front end (``LLM``, ``cuteinfer generate``, the server) turns prompts into token ids here:
the chat template is applied in one place, text is checked to be valid Unicode, the model's
default sampling parameters fill what the request left unset, and a request that cannot fit (the
prompt alone, or the prompt plus its output budget in the KV pool) is refused with a
``RequestError`` that says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine refuses (too long, empty, bad token ids, no tokenizer...)."""


def check_text(text: str, field: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (``"\\ud800"``, which JSON and Python
    strings allow) cannot reach the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{field} is not valid text: {e.reason} at character {e.start} "
                           f"({text[e.start]!r}); send valid Unicode (lone surrogates are "
                           "not)") from None


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 block_size: int, num_pages: int, source: str,
                 sampling_defaults: Mapping[str, float | int] | None = None) -> None:
        self.tokenizer = tokenizer
        # the model's (ModelConfig.sampling_defaults): for the fields a request leaves unset
        self.sampling_defaults = dict(sampling_defaults or {})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_pages = num_pages
        self.source = source  # the model directory, for messages

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"{self.source} has no tokenizer.json: {what}")
        return self.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        """(token ids, prompt text or None)."""
        if isinstance(prompt, str):
            tok = self._need_tokenizer("pass token ids instead of a string prompt")
            check_text(prompt, "prompt")
            return tok.encode(prompt), prompt
        ids = list(prompt)
        if set(map(type, ids)) <= {int}:  # plain ints (JSON's): checked at C speed, kept as is
            return ids, None
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt must be a string or a list of integer token ids")
        return [int(t) for t in ids], None

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """A conversation through the checkpoint's chat template (the one place it is applied;
        template errors propagate: they are the client's)."""
        tok = self._need_tokenizer("chat needs one")
        text = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                       **template_kwargs)
        check_text(text, "messages")
        return text

    def chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
             **template_kwargs: Any) -> list[int]:
        """A conversation's token ids: the rendered template, tokenized as is."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self._need_tokenizer("chat needs one").encode(text, add_special_tokens=False)

    def process(self, prompt: str | Sequence[int], params: SamplingParams | None
                ) -> tuple[list[int], str | None, SamplingParams]:
        """Validated (token ids, prompt text, params) of one request."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be SamplingParams, got "
                               f"{type(params).__name__}")
        params = params.with_defaults(self.sampling_defaults)
        if params.has_processors:  # token ids in the vocabulary, a tokenizer where needed
            from engine.logits_processors import ProcessorError, check_params

            try:
                check_params(params, self.vocab_size, self.tokenizer)
            except ProcessorError as e:
                raise RequestError(str(e)) from None
        ids, text = self.encode(prompt)
        vocab, mml = self.vocab_size, self.max_model_len
        if not ids:
            raise RequestError("prompt is empty: it must have at least one token")
        bad = [] if ids and 0 <= min(ids) and max(ids) < vocab else [
            t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})")
        if len(ids) >= mml:
            raise RequestError(f"prompt has {len(ids)} tokens, but max_model_len is {mml} "
                               f"(it must leave room for at least one generated token); "
                               f"shorten the prompt or raise max_model_len")
        # the whole request (prompt + its output budget) must fit the pool alone, or it would
        # be accepted and fail part-way
        total = len(ids) + min(params.max_tokens or mml, mml - len(ids))
        need = -(-total // self.block_size)
        if need > self.num_pages:
            raise RequestError(f"the prompt ({len(ids)} tokens) and max_tokens need {need} KV "
                               f"pages but the cache has {self.num_pages}; lower max_tokens "
                               "or shorten the prompt")
        return ids, text, params
