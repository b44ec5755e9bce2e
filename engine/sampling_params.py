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
    stop_strs: list[str] = field(init=False, default_factory=list)
    unset: frozenset[str] = field(init=False, default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        unset = {k for k in BUILTIN_DEFAULTS if getattr(self, k) is UNSET or getattr(self, k)
                 is None}
        for k in unset:
            setattr(self, k, BUILTIN_DEFAULTS[k])
        self.unset = frozenset(unset)
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

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
                      "cuteinfer does not support: that default is ignored", name, value)
    if out:
        _log_once(logging.INFO, "default sampling parameters from the model's "
                  "generation_config.json: %s (request fields override them; "
                  "--generation-config vllm ignores the file)",
                  ", ".join(f"{k}={v}" for k, v in out.items()))
    return out
