"""One llguidance matcher per constrained request; token bitmasks for a step's rows.

The grammar of a request is compiled per grammar text (``GrammarCache``: template matchers
per text; a request gets a ``deep_copy`` of one), against an ``LLTokenizer`` built once per
tokenizer from its ``tokenizer.json`` (~2 s for Qwen3's 151k tokens, so it is built on the first
constrained request and cached).

Shards: a matcher's lexer (its lazily built DFA, most of a mask's cost) sits behind a mutex that
every ``deep_copy`` of the template shares, held for the whole mask computation: copies of one
template compute their masks one at a time, whatever the thread pool (16 requests of one schema
took as long on 16 cores as on 2). So a grammar has up to ``max_shards`` templates (one per
executor thread), each compiled on its own with its own lexer; a request gets a copy of the one
with the fewest live requests (a new one is compiled while every one has some), so up to
``max_shards`` concurrent requests compute in parallel, and a later request still finds the DFA
its shard's earlier ones built. A grammar whose compile is slow (``MAX_SHARD_COMPILE_S``) keeps one.

Per step: ``fill_bitmasks`` writes the allowed-token bitmask of every constrained sample row
(one bit per token id, ``uint32[ceil(V / 32)]`` per row, bit ``v & 31`` of word ``v >> 5``),
in place, in parallel in llguidance's thread pool (it drops the GIL). After the step the sampled
token advances the matcher (``StructuredRequest.accept``); a matcher that is then stopped has
completed its grammar (the request finishes with ``stop``), one in error cannot continue (the
request finishes with ``error`` and llguidance's message).
"""

from __future__ import annotations

import enum
import os
import threading
import time
import weakref
from collections import OrderedDict
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import envs
from engine.structured.grammar import GrammarError

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256
MAX_SHARD_COMPILE_S = 0.05  # a grammar that compiles slower than this keeps a single template


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def default_threads() -> int:
    """The mask pool's size: every CPU this process may run on, 1 to 32. (llguidance's own
    default is 80%: on the 16-core H200 host that is 12 threads for 12 lexers, so 16
    constrained rows took two rounds; 16 threads cut qwen3-0.6b's structured step from 1.36x
    to 1.23x a plain one, tools/bench_structured.py, docs/perf.md v19.)"""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(32, n))


class _Shards:
    """The templates of one grammar text, each with its own lexer, and their live requests."""

    __slots__ = ("templates", "live", "compile_s")

    def __init__(self, template: Any, compile_s: float) -> None:
        self.templates = [template]
        self.live: list[weakref.WeakSet[StructuredRequest]] = [weakref.WeakSet()]
        self.compile_s = compile_s


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    from llguidance import LLTokenizer

    try:
        return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))
    except TypeError:  # older llguidance (1.6.1) takes one EOS id: the grammar ends on the first
        return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos[0])


class GrammarCache:
    """Compiled grammars of one tokenizer, by grammar text (LRU), sharded (module docstring).

    ``threads``: the mask pool's size (None: llguidance's default, ``default_threads()``);
    ``max_shards``: templates per grammar (None: ``CUTEINFER_GRAMMAR_SHARDS``, else ``threads``;
    1: every request of a grammar shares one lexer, as a plain ``deep_copy`` does)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], threads: int | None = None,
                 max_shards: int | None = None) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self._templates: OrderedDict[str, _Shards] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Any = None
        self._ll_tok: Any = None
        self.words = bitmask_words(vocab_size)
        self.threads = threads or default_threads()
        self.max_shards = max(1, max_shards or envs.grammar_shards() or self.threads)

    def ll_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer (tokenizer.json)")
        if self._ll_tok is None:  # (to_str alone is ~0.2 s for Qwen3: once, not per grammar)
            tk = self.tokenizer.backend_tokenizer
            self._ll_tok = _ll_tokenizer(tk.to_str(), self.vocab_size, self.eos)
        return self._ll_tok

    def _shards(self, grammar: str) -> _Shards:
        """``grammar``'s cached shards, compiled now if it is not cached (GrammarError if it
        does not compile); the caller holds the lock."""
        sh = self._templates.get(grammar)
        if sh is not None:
            self._templates.move_to_end(grammar)
            return sh
        tpl, dt = self._compile(grammar)
        if tpl.is_error():
            raise GrammarError(tpl.get_error())
        sh = self._templates[grammar] = _Shards(tpl, dt)
        if len(self._templates) > MAX_CACHED_GRAMMARS:
            self._templates.popitem(last=False)
        return sh

    def matcher(self, grammar: str) -> StructuredRequest:
        """A fresh matcher of ``grammar``, a copy of its least loaded shard (a new shard is
        compiled while every one has live requests, up to ``max_shards``). GrammarError if the
        grammar does not compile."""
        with self._lock:
            sh = self._shards(grammar)
            loads = [len(live) for live in sh.live]
            k = loads.index(min(loads))
            if (loads[k] and len(sh.templates) < self.max_shards
                    and sh.compile_s <= MAX_SHARD_COMPILE_S):
                tpl, _ = self._compile(grammar)
                if not tpl.is_error():
                    k = len(sh.templates)
                    sh.templates.append(tpl)
                    sh.live.append(weakref.WeakSet())
            tpl = sh.templates[k]
            req = StructuredRequest(tpl.deep_copy(), id(tpl))
            sh.live[k].add(req)
            return req

    def _compile(self, grammar: str) -> tuple[Any, float]:
        from llguidance import LLMatcher

        tok = self.ll_tokenizer()  # (built on first use: not the grammar's compile time)
        t0 = time.perf_counter()
        tpl = LLMatcher(tok, grammar, log_level=0)
        return tpl, time.perf_counter() - t0

    def shard_loads(self, grammar: str) -> list[int]:
        """Live requests per shard of ``grammar`` ([] when it is not cached)."""
        sh = self._templates.get(grammar)
        return [] if sh is None else [len(live) for live in sh.live]

    def fill_bitmasks(self, reqs: list[StructuredRequest], out: np.ndarray) -> None:
        """Row i of ``out`` (uint32 [n, words], C-contiguous) = the bitmask of ``reqs[i]``,
        computed in place."""
        if not reqs:
            return
        assert out.dtype == np.uint32 and out.flags.c_contiguous and out.shape[1] == self.words
        assert out.shape[0] >= len(reqs)
        if len(reqs) == 1:
            reqs[0].matcher.unsafe_compute_mask_ptr(out.ctypes.data, self.words * 4)
            return
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(self.threads)
        # rows of one shard (one lexer, one lock) adjacent: the pool's split keeps them together
        jobs = sorted(((r.matcher, i) for i, r in enumerate(reqs)),
                      key=lambda j: reqs[j[1]].lexer)
        self._executor.unsafe_compute_mask_ptr(jobs, out.ctypes.data, self.words * 4,
                                               out.shape[0])


class Advance(enum.Enum):
    CONTINUE = "continue"
    DONE = "done"  # the grammar is complete: nothing but EOS may follow
    ERROR = "error"  # the grammar cannot continue


class StructuredRequest:
    """A request's matcher: the tokens it has accepted so far are its state."""

    __slots__ = ("matcher", "lexer", "__weakref__")

    def __init__(self, matcher: Any, lexer: int = 0) -> None:
        self.matcher = matcher
        self.lexer = lexer  # id() of the template it copies: requests of one lexer share its lock

    def accept(self, token: int) -> Advance:
        m = self.matcher
        if not m.consume_token(token) or m.is_error():
            return Advance.ERROR
        return Advance.DONE if m.is_stopped() else Advance.CONTINUE

    @property
    def error(self) -> str:
        return self.matcher.get_error() or f"stopped: {self.matcher.stop_reason()}"
