"""SamplingParams, as vLLM names them. Invalid values raise a typed error naming the field.

Default sampling parameters (vLLM's ``--generation-config auto``): the model's
generation_config.json may recommend temperature, top_p, top_k and min_p (Qwen3: 0.6, 0.95, 20).
A request that leaves one of those unset (not passed, or None) gets the model's value, else the
built-in one (``BUILTIN_DEFAULTS``); a request that sets it, even to the built-in value, keeps
its own. ``SamplingParams.unset`` remembers which were left unset, so the defaults can be applied
later, in the input processor (``with_defaults``): every front end goes through it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range or of the wrong type. ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"SamplingParams.{field_name}: {message}")


MAX_LOGPROBS = 20
# Stop strings are searched in every new piece of text of the request: bounded, so that one
# request cannot slow down every request batched with it.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
# Logits processors (engine/logits_processors.py): sizes bounded for the same reason, and so the
# per-step device lists stay within their start-up buffers.
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_LIMIT = 100.0  # |bias| is clamped to this, as vLLM's OpenAI server does
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LEN = 256  # characters
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's and vLLM's range)
MAX_REPETITION_PENALTY = 100.0
# vLLM's rule: a temperature below this is greedy (1e-40 would be 0 or inf in float32).
GREEDY_TEMPERATURE = 1e-5
# Top-p below this keeps exactly the top token for any vocabulary under 10^8 tokens (the top
# token's probability is >= 1/V); clamping to it keeps the value normal in float32, where 1e-300
# would round to 0 and keep no token at all.
MIN_TOP_P = 1e-8


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


# The default of the fields below that the model may give defaults for: "not set by the request".
UNSET: Any = _Unset()
BUILTIN_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                            "min_p": 0.0}
# generation_config.json fields vLLM takes defaults from that cuteinfer cannot apply, and the
# value that means "no change" (no warning then)
UNSUPPORTED_DEFAULTS: dict[str, float | None] = {"repetition_penalty": 1.0,
                                                 "max_new_tokens": None}


@dataclass
class SamplingParams:
    """Unset temperature / top_k / top_p / min_p (the default, or None) become the model's
    defaults or ``BUILTIN_DEFAULTS`` (listed in ``unset``); after construction every field
    holds a concrete value."""

    max_tokens: int | None = 16
    temperature: float = UNSET  # 0 = greedy; 1.0 unless set or defaulted
    top_k: int = UNSET  # 0 (or -1) = off
    top_p: float = UNSET  # 1.0 = off
    min_p: float = UNSET  # 0.0 = off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0 = the chosen only)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    # logits processors, vLLM's names and semantics (engine/logits_processors.py)
    presence_penalty: float = 0.0  # -= p for every token that the output holds
    frequency_penalty: float = 0.0  # -= f * (times the output holds the token)
    repetition_penalty: float = 1.0  # prompt + output tokens: logit / r if > 0 else logit * r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids masked until this many tokens are out
    bad_words: list[str] | None = None  # never generated (each word's tokens, as vLLM)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    structured_outputs: StructuredOutputsParams | None = None
    stop_strs: list[str] = field(init=False, default_factory=list)
    unset: frozenset[str] = field(init=False, default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        unset = {k for k in BUILTIN_DEFAULTS if getattr(self, k) is UNSET or getattr(self, k)
                 is None}
        for k in unset:
            setattr(self, k, BUILTIN_DEFAULTS[k])
        self.unset = frozenset(unset)
        is_int, is_num = _is_int, _is_num
        if self.n != 1:
            raise SamplingParamsError("n", f"only n=1 is supported, got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens",
                                      f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not is_num(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise SamplingParamsError("temperature",
                                      f"must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise SamplingParamsError("top_k", f"must be an integer >= 0 (0 or -1 = off), got "
                                      f"{self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        self.top_p = max(self.top_p, MIN_TOP_P)
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise SamplingParamsError("seed", f"must be an integer in [0, 2^64), got "
                                      f"{self.seed!r}")
        stop = self.stop
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise SamplingParamsError("stop", f"must be a string or a list of strings, got "
                                      f"{stop!r}")
        if len(stops) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got "
                                      f"{len(stops)}")
        if any(s == "" for s in stops):
            raise SamplingParamsError("stop", "stop strings must not be empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_LEN:
            raise SamplingParamsError("stop", f"a stop string may have at most "
                                      f"{MAX_STOP_STRING_LEN} characters, got one of {longest}")
        self.stop_strs = stops
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "must be a list of non-negative "
                                      f"integers, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                                      f"{len(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise SamplingParamsError(name, f"must be None or an integer in [0, "
                                          f"{MAX_LOGPROBS}], got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be a bool, got {getattr(self, name)!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        """The logits processors' fields: types, ranges and bounded sizes (vocabulary bounds
        are the input processor's: it knows the vocabulary)."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingParamsError(name, f"must be a number in [-{MAX_PENALTY}, "
                                          f"{MAX_PENALTY}], got {v!r}")
            setattr(self, name, float(v))
        rp = self.repetition_penalty
        if not _is_num(rp) or not 0.0 < rp <= MAX_REPETITION_PENALTY:
            raise SamplingParamsError("repetition_penalty", f"must be a number in (0, "
                                      f"{MAX_REPETITION_PENALTY}] (1 = off), got {rp!r}")
        self.repetition_penalty = float(rp)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"must be an integer >= 0, got "
                                      f"{self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be <= max_tokens ({self.max_tokens}),"
                                      f" got {self.min_tokens}")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.bad_words is not None:
            bw = self.bad_words
            if not isinstance(bw, list | tuple) or not all(isinstance(w, str) for w in bw):
                raise SamplingParamsError("bad_words", f"must be a list of strings, got {bw!r:.80}")
            if len(bw) > MAX_BAD_WORDS:
                raise SamplingParamsError("bad_words", f"at most {MAX_BAD_WORDS} words, got "
                                          f"{len(bw)}")
            if any(not w.strip() or len(w) > MAX_BAD_WORD_LEN for w in bw):
                raise SamplingParamsError("bad_words", "each word must be non-blank and have at "
                                          f"most {MAX_BAD_WORD_LEN} characters")
            self.bad_words = list(bw)
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, list | tuple) or not all(_is_int(t) and t >= 0 for t in a):
                raise SamplingParamsError("allowed_token_ids", "must be a list of non-negative "
                                          f"integers, got {a!r:.80}")
            if not a or len(a) > MAX_ALLOWED_TOKEN_IDS:
                raise SamplingParamsError("allowed_token_ids", f"must hold 1 to "
                                          f"{MAX_ALLOWED_TOKEN_IDS} ids, got {len(a)}")
            self.allowed_token_ids = list(a)
        so = self.structured_outputs
        if isinstance(so, dict):  # as vLLM's extra_body sends it
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise SamplingParamsError("structured_outputs", str(e)) from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "must be StructuredOutputsParams, "
                                      f"got {type(so).__name__}")
        self.structured_outputs = so

    @property
    def has_processors(self) -> bool:
        """Any logits processor is on (the step builder skips the rest for the common case)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.bad_words or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_defaults(self, defaults: Mapping[str, float | int]) -> SamplingParams:
        """These params with ``defaults`` (the model's) in the fields the request left unset."""
        apply = {k: v for k, v in defaults.items() if k in self.unset}
        if not apply:
            return self
        keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        keep.update({k: None for k in self.unset}, **apply)
        return SamplingParams(**keep)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range
        return False


def _check_logit_bias(bias: object) -> dict[int, float]:
    """token id -> bias; ids may be strings of digits (OpenAI's JSON keys); values clamped to
    [-100, 100] as vLLM does."""
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"must be a dict of token id -> number, got "
                                  f"{type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got "
                                  f"{len(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tok = int(k) if isinstance(k, str) and k.isdigit() and len(k) < 12 else k
        if not _is_int(tok) or tok < 0:
            raise SamplingParamsError("logit_bias", f"keys must be token ids (integers >= 0), "
                                      f"got {k!r:.40}")
        if not _is_num(v):
            raise SamplingParamsError("logit_bias", f"values must be finite numbers, got "
                                      f"{v!r:.40} for token {tok}")
        out[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
    return out


@dataclass
class StructuredOutputsParams:
    """vLLM's structured output request: exactly one of ``json`` (a JSON schema, as a dict or
    its text), ``regex``, ``choice`` (one of these strings), ``grammar`` (a Lark grammar, as
    llguidance reads it) or ``json_object=True`` (any JSON object). ``whitespace_pattern``: a
    regex for the whitespace JSON may hold; by default JSON is written compactly with ``", "``
    and ``": "`` separators (``disable_any_whitespace``: with ``","`` and ``":"``).

    ``grammar_text`` is what llguidance compiles: built and checked here (no tokenizer needed),
    so a bad schema is a SamplingParamsError naming the field when the request is made."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    grammar_text: str = field(init=False, default="", repr=False)

    def __post_init__(self) -> None:
        from engine.structured.grammar import GrammarError, grammar_text

        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object not in (None, False, True):
            raise SamplingParamsError("structured_outputs.json_object", "must be a bool")
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise SamplingParamsError("structured_outputs", "set exactly one of json, regex, "
                                      f"choice, grammar, json_object; got {kinds or 'none'}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise SamplingParamsError("structured_outputs.whitespace_pattern", "must be a string")
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError("structured_outputs.disable_any_whitespace",
                                      "must be a bool")
        try:
            self.grammar_text = grammar_text(self)
        except GrammarError as e:
            raise SamplingParamsError(f"structured_outputs.{kinds[0]}", str(e)) from None

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


_warned: set[str] = set()


def _log_once(level: int, message: str, *args: object) -> None:
    key = message % args
    if key not in _warned:
        _warned.add(key)
        log.log(level, message, *args)


def resolve_generation_defaults(given: Mapping[str, float | int]) -> dict[str, float | int]:
    """The sampling defaults of a model's generation_config.json fields ``given`` (vLLM's
    ``get_diff_sampling_param``): the supported ones, checked as a request's would be; each
    field the engine cannot apply is dropped with a warning (once). Raises ValueError naming a
    field whose value no request could have."""
    out: dict[str, float | int] = {}
    for name, value in given.items():
        if name in BUILTIN_DEFAULTS:
            try:
                SamplingParams(**{name: value})
            except SamplingParamsError as e:
                raise ValueError(f"{name}: {str(e).split(': ', 1)[1]}") from None
            out[name] = value
        elif name in UNSUPPORTED_DEFAULTS and value != UNSUPPORTED_DEFAULTS[name]:
            _log_once(logging.WARNING, "the model's generation_config.json sets %s=%r, which "
                      "cuteinfer does not take as a default: that default is ignored (a "
                      "request may still set it)", name, value)
    if out:
        _log_once(logging.INFO, "default sampling parameters from the model's "
                  "generation_config.json: %s (request fields override them; "
                  "--generation-config vllm ignores the file)",
                  ", ".join(f"{k}={v}" for k, v in out.items()))
    return out
