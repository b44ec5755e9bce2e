"""One llguidance matcher per constrained request; token bitmasks for a step's rows.

The grammar of a request is compiled once per grammar text (``GrammarCache``: a template
matcher per text; a request gets a ``deep_copy``, which shares the compiled grammar), against an
``LLTokenizer`` built once per tokenizer from its ``tokenizer.json`` (~2 s for Qwen3's 151k
tokens, so it is built on the first constrained request and cached).

Per step: ``fill_bitmasks`` writes the allowed-token bitmask of every constrained sample row
(one bit per token id, ``uint32[ceil(V / 32)]`` per row, bit ``v & 31`` of word ``v >> 5``),
in parallel in llguidance's thread pool (it drops the GIL). After the step the sampled token
advances the matcher (``StructuredRequest.accept``); a matcher that is then stopped has completed
its grammar (the request finishes with ``stop``), one in error cannot continue (the request
finishes with ``error`` and llguidance's message).
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.structured.grammar import GrammarError

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


class GrammarCache:
    """Compiled grammars of one tokenizer, by grammar text (LRU)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Any = None
        self.words = bitmask_words(vocab_size)

    def ll_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer (tokenizer.json)")
        tk = self.tokenizer.backend_tokenizer
        return _ll_tokenizer(tk.to_str(), self.vocab_size, self.eos)

    def matcher(self, grammar: str) -> StructuredRequest:
        """A fresh matcher of ``grammar`` (compiled once per text). GrammarError if it fails."""
        from llguidance import LLMatcher

        with self._lock:
            tpl = self._templates.get(grammar)
            if tpl is None:
                tpl = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
                if tpl.is_error():
                    raise GrammarError(tpl.get_error())
                self._templates[grammar] = tpl
                if len(self._templates) > MAX_CACHED_GRAMMARS:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
            return StructuredRequest(tpl.deep_copy())

    def fill_bitmasks(self, reqs: list[StructuredRequest], out: np.ndarray) -> None:
        """Row i of ``out`` (uint32 [n, words], C-contiguous) = the bitmask of ``reqs[i]``."""
        if not reqs:
            return
        assert out.dtype == np.uint32 and out.flags.c_contiguous and out.shape[1] == self.words
        if len(reqs) == 1:
            reqs[0].matcher.unsafe_compute_mask_ptr(out.ctypes.data, self.words * 4)
            return
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(r.matcher, i) for i, r in enumerate(reqs)],
                                               out.ctypes.data, self.words * 4, out.shape[0])


class Advance(enum.Enum):
    CONTINUE = "continue"
    DONE = "done"  # the grammar is complete: nothing but EOS may follow
    ERROR = "error"  # the grammar cannot continue


class StructuredRequest:
    """A request's matcher: the tokens it has accepted so far are its state."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> Advance:
        m = self.matcher
        if not m.consume_token(token) or m.is_error():
            return Advance.ERROR
        return Advance.DONE if m.is_stopped() else Advance.CONTINUE

    @property
    def error(self) -> str:
        return self.matcher.get_error() or f"stopped: {self.matcher.stop_reason()}"
