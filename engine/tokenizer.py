"""Tokenizer: the ``tokenizers`` library on a checkpoint's ``tokenizer.json``, plus what a serving
engine needs around it: special tokens from ``tokenizer_config.json`` and the checkpoint's jinja2
chat template rendered as transformers renders it. Streaming detokenization is tokenizers'
``DecodeStream`` over ``backend_tokenizer`` (engine/output_processor.py).

A checkpoint directory without ``tokenizer.json`` has no tokenizer (``from_pretrained`` returns
None); the engine then takes token-id prompts only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.jsonfile import json_type, read_json


class TokenizerError(ValueError):
    """A tokenizer file cuteinfer cannot use."""


class ChatTemplateError(TokenizerError):
    """No chat template, or the template refused the conversation (its ``raise_exception``)."""


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self, tokenizer: HFTokenizer, config: dict[str, Any], chat_template: str | None = None
    ) -> None:
        self._tk = tokenizer
        self.config = config
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            tok = _token_str(config.get(name))
            if tok is not None:
                self.special_tokens[name] = tok
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos = self._id_of(self.special_tokens.get("eos_token"))
        # Only tokenizer_config's eos: callers merge generation_config's ids (ModelConfig has them).
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids = tuple(sorted(i for i, t in added.items() if t.special))
        # BOS the post-processor adds by itself (Llama 3's tokenizer.json does); add_bos_token asks
        # for it, as transformers' Llama tokenizers do, when the post-processor does not.
        prefix = tokenizer.encode("a", add_special_tokens=True).ids
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        post_adds_bos = self.bos_token_id in prefix[: len(prefix) - len(plain)]
        self._prepend_bos = (
            bool(config.get("add_bos_token", False))
            and self.bos_token_id is not None
            and not post_adds_bos
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no ``tokenizer.json``."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise TokenizerError(f"{path / 'tokenizer.json'} cannot be loaded: {e}") from e
        config: dict[str, Any] = {}
        cfg_path = path / "tokenizer_config.json"
        if cfg_path.is_file():
            config = read_json(cfg_path, TokenizerError)
            _check_config(config, cfg_path)
        template = config.get("chat_template")
        jinja_path = path / "chat_template.jinja"
        if jinja_path.is_file():  # transformers >= 4.43 saves it apart
            try:
                template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_path}: cannot be read as UTF-8 text ({e})") from None
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return cls(tk, config, template)

    @property
    def backend_tokenizer(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (transformers' name for it)."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest string in the vocabulary, added tokens included: no
        token covers more bytes of text than that."""
        vocab = self._tk.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8")) for t in vocab), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call, on one text: tokenizers' ``encode`` holds the GIL for the whole call (a
        # second per MB, every other thread stopped); ``encode_batch_fast`` (no character
        # offsets: half the time) releases it while it works. Same ids.
        tk = self._tk
        encode_batch = getattr(tk, "encode_batch_fast", tk.encode_batch)
        ids: list[int] = encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the checkpoint's template, as transformers does.

        ``kwargs`` reach the template as variables (Qwen3: ``enable_thinking=False``); so do the
        special tokens (``bos_token``, ``eos_token``, ...) unless ``kwargs`` override them.
        """
        if not self.chat_template:
            raise ChatTemplateError(
                "this checkpoint has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja): pass a plain prompt string or token ids instead"
            )
        # As transformers does: keys whose value is None are dropped (OpenAI sends content=None).
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=chat,
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e


def _check_config(config: Any, path: Path) -> None:
    """Refuse a tokenizer_config.json whose fields would be misread (``"add_bos_token":
    "false"`` is true to Python), naming the field."""
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: must hold a JSON object ({{...}}), got {json_type(config)}")
    problems = []
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = config.get(name)
        if v is not None and _token_str(v) is None:
            problems.append(f"{name} must be a string or an object with a string \"content\", "
                            f"got {v!r:.60}")
    v = config.get("add_bos_token")
    if v is not None and not isinstance(v, bool):
        problems.append(f"add_bos_token must be a JSON boolean (true or false), got {v!r:.60} "
                        f"({json_type(v)})")
    t = config.get("chat_template")
    named_ok = isinstance(t, list) and all(
        isinstance(x, dict) and isinstance(x.get("name"), str)
        and isinstance(x.get("template"), str) for x in t)
    if t is not None and not isinstance(t, str) and not named_ok:
        problems.append("chat_template must be a string or an array of {\"name\": ..., "
                        f"\"template\": ...}} objects of strings, got {t!r:.60}")
    if problems:
        raise TokenizerError(f"{path}: " + "; ".join(problems))


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # The environment transformers builds: templates come from the Hub and are untrusted.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)

