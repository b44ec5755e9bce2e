"""After each step: token ids -> text. Incremental detokenization, stop strings, decoded logprob
tokens, the text safe to show, and ``RequestOutput``.

The scheduler has already appended the step's tokens and finished requests on EOS, a stop token
or length. Here each new token's text is added; a stop string that appears (it may straddle
tokens: vLLM's rule) cuts the text before it (after it with ``include_stop_str_in_output``) and
ends the request with ``finish_reason "stop"`` and the string as ``stop_reason`` -- aborting it in
the core if it was still running (``finish``), overriding length/EOS if the same token ended it
(as vLLM v1 does). While a request runs, the text that could start a stop string is held back.

Detokenization is tokenizers' ``DecodeStream`` (vLLM's prefix/read offsets, in Rust): each new
token is decoded after the tokens of the previous chunk, so a SentencePiece word boundary or a
byte-level character split across tokens comes out right; text that ends in an incomplete
character (U+FFFD) is held back until a later token completes it.

A running request without stop strings is detokenized only when its text is asked for (a view:
``delta``, ``output``, ``visible_text``) or when it finishes, all its new tokens in one
``DecodeStream`` call: ``LLM.generate`` reads text once, so its steps carry no detokenization
(dev box, 64 rows: the engine thread's step 1.20-1.28 ms against 1.77-1.87, docs/perf.md v35).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from engine.outputs import CompletionOutput, RequestDelta, RequestOutput
from engine.request import FinishReason, LogprobDict, Request, RequestStatus
from engine.tokenizer import Tokenizer

_NO_TEXT = frozenset((FinishReason.ERROR, FinishReason.ABORT))  # (an enum tuple is slow)

Finish = Callable[..., None]  # scheduler.finish(req, reason, stop_reason=..., error=...)
PROMPT_CONTEXT = 5  # prompt tokens the first output token is decoded after (vLLM's 5)


class Detokenizer:
    """Text deltas of a growing token sequence: a ``DecodeStream`` primed with the prompt's last
    tokens, plus ``finish()``, which flushes the held-back tokens (a truncated character) decoded
    after the last chunk's tokens, so the concatenated deltas are the text of the whole output.

    Where DecodeStream cannot go, vLLM's offsets rule (which the stream implements, and which
    this engine keeps) is applied by hand until the next delta: the text of the chunk and the
    new tokens, beyond as many characters as the chunk alone decodes to. That is (1) a chunk
    whose text ends inside a character (a token-id prompt cut mid-character): the stream would
    emit the chunk's own text too; (2) the stream's "Invalid prefix" error, when the chunk's
    text is no prefix of the longer one (byte-fallback tokens merged into one invalid sequence
    by Llama 2-style decoders). Both are rare; the rule gives what it always gave.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tk = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._held: list[int] = []  # tokens whose text is not out yet (DecodeStream's None)
        self.text = ""
        n = len(prompt_token_ids)
        self._start(list(prompt_token_ids[max(n - PROMPT_CONTEXT, 0):]))

    def _decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=self._skip)

    def _start(self, chunk: list[int]) -> None:
        """Decode what follows ``chunk`` (the tokens of the last delta, or the prompt's tail)."""
        self._chunk = chunk
        self._stream: DecodeStream | None = (
            None if self._decode(chunk).endswith("\ufffd")  # case (1)
            else DecodeStream(ids=chunk, skip_special_tokens=self._skip))

    def step(self, token_ids: int | Iterable[int]) -> str:
        """Append token(s); return the new text that is now complete (possibly "")."""
        one = type(token_ids) is int  # (one id, the usual case, goes to the stream as an int:
        ids = [token_ids] if one else list(token_ids)  # ~1.5 us less a call than a list)
        self._held += ids
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tk, token_ids if one else ids)
            except Exception:  # case (2): "Invalid prefix"; a bad id fails below as before
                self._stream = None
            else:
                if delta is None:
                    return ""
                self._chunk, self._held = self._held, []
                self.text += delta
                return delta
        head = self._decode(self._chunk)
        text = self._decode(self._chunk + self._held)
        if len(text) <= len(head) or text.endswith("\ufffd"):
            return ""
        delta = text[len(head):]
        held, self._held = self._held, []
        self._start(held)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Text still held back at the end of the sequence (e.g. a truncated character)."""
        if not self._held:
            return ""
        chunk, self._chunk, self._held = self._chunk, self._held, []
        delta = self._decode(chunk + self._chunk)[len(self._decode(chunk)):]
        self.text += delta
        return delta


@dataclass
class _State:
    detok: Detokenizer | None
    tokens: int = 0  # output tokens whose text is in req.text
    logprobs: int = 0  # logprob entries whose tokens are decoded
    prompt_logprobs: int = 0
    sent_text: int = 0  # the delta cursor: what the request's consumer was given so far
    sent_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, finish: Finish) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, req.prompt_token_ids,
                                req.params.skip_special_tokens)
        self._states[req.request_id] = _State(detok)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, changed: list[Request]) -> None:
        """Text for the new tokens of ``changed``; an error fails that request only. A running
        request without stop strings gets its text later, when a view asks for it (``delta``,
        ``output``, ``visible_text``) or when it finishes, in one call for all the tokens since:
        ``LLM.generate`` reads text once, at the end, so its steps carry no detokenization."""
        for req in changed:
            if req.params.stop_strs or req.is_finished:
                self._update(req)
            elif req.params.logprobs is not None or req.params.prompt_logprobs is not None:
                self._update(req, text=False)

    def _update(self, req: Request, text: bool = True) -> None:
        """Bring ``req``'s decoded logprobs (and its text) up to its tokens."""
        st = self._states.get(req.request_id)
        if st is None or req.finish_reason in _NO_TEXT:
            return
        if req.params.logprobs is not None or req.params.prompt_logprobs is not None:
            if not self._guarded(req, st, self._decode_logprobs):
                return
        if text:
            self._guarded(req, st, self._text)

    def _guarded(self, req: Request, st: _State,
                 fn: Callable[[Request, _State], None]) -> bool:
        try:
            fn(req, st)
            return True
        except Exception as e:
            why = f"processing the output failed: {type(e).__name__}: {e}"
            if req.is_finished:  # (its text caught up at the end: the error still shows)
                req.finish(FinishReason.ERROR, error=why)
            else:
                self.finish(req, FinishReason.ERROR, error=why)
            return False

    # -- text ------------------------------------------------------------------------------------
    def _text(self, req: Request, st: _State) -> None:
        if st.detok is None:
            st.tokens = len(req.output_token_ids)
            return
        stops = req.params.stop_strs
        if not stops:  # every new token at once (one DecodeStream call), then a flush at the end
            toks = req.output_token_ids
            n = len(toks) - st.tokens
            if n:
                req.text += st.detok.step(toks[-1] if n == 1 else toks[st.tokens:])
                st.tokens = len(toks)
            if req.status is RequestStatus.FINISHED:
                req.text += st.detok.finish()
            return
        while st.tokens < len(req.output_token_ids):
            delta = st.detok.step(req.output_token_ids[st.tokens])
            st.tokens += 1
            req.text += delta
            if delta:
                s = self._cut_at_stop_string(req, len(delta))
                if s is not None:
                    if req.is_finished:  # the same token also hit length / EOS: the string wins
                        req.finish(FinishReason.STOP, stop_reason=s)
                    else:
                        self.finish(req, FinishReason.STOP, stop_reason=s)
                    return
        if req.is_finished:
            req.text += st.detok.finish()
            self._cut_at_stop_string(req, len(req.text))

    @staticmethod
    def _cut_at_stop_string(req: Request, new_chars: int) -> str | None:
        """Search the tail that could hold a stop string ending in the new text; cut the text
        before it (or after it with include_stop_str_in_output). Returns the string found."""
        text = req.text
        for s in req.params.stop_strs:
            start = max(0, len(text) - new_chars - len(s) + 1)
            i = text.find(s, start)
            if i >= 0:
                req.text = text[:i + len(s) if req.params.include_stop_str_in_output else i]
                return s
        return None

    def _decode_logprobs(self, req: Request, st: _State) -> None:
        decode = self._decode_one
        for d in req.logprobs[st.logprobs:]:
            _fill(d, decode)
        st.logprobs = len(req.logprobs)
        for d in req.prompt_logprobs[st.prompt_logprobs:]:
            if d is not None:
                _fill(d, decode)
        st.prompt_logprobs = len(req.prompt_logprobs)

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], False)

    # -- renderings ------------------------------------------------------------------------------
    def visible_text(self, req: Request) -> str:
        """Text safe to show now: while running, hold back what could start a stop string."""
        st = self._states.get(req.request_id)
        if st is not None and st.tokens < len(req.output_token_ids):
            self._update(req)  # a running request's text is brought up to date when asked for
        if req.is_finished or not req.params.stop_strs or req.params.include_stop_str_in_output:
            return req.text
        hold = max(len(s) for s in req.params.stop_strs) - 1
        return req.text[:max(0, len(req.text) - hold)]

    def delta(self, req: Request) -> RequestDelta:
        """What the request's consumer has not been given yet (one cursor per request)."""
        st = self._states[req.request_id]
        text = self.visible_text(req)
        toks = req.output_token_ids
        new_text = text[st.sent_text:]
        st.sent_text = max(st.sent_text, len(text))
        new_toks = toks[st.sent_tokens:]
        lps = req.logprobs[st.sent_tokens:] if req.params.logprobs is not None else None
        st.sent_tokens = len(toks)
        return RequestDelta(
            new_text, new_toks, lps, req.is_finished,
            req.finish_reason.value if req.finish_reason else None, req.stop_reason, req.error,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(toks),
            num_cached_tokens=req.num_cached_tokens)

    def output(self, req: Request) -> RequestOutput:
        want_lp = req.params.logprobs is not None
        comp = CompletionOutput(
            index=0, text=self.visible_text(req), token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if want_lp else None,
            logprobs=list(req.logprobs) if want_lp else None,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason, error=req.error)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=list(req.prompt_logprobs) if req.wants_prompt_logprobs else None,
            outputs=[comp], finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
            metrics=dict(req.metrics))


def _fill(d: LogprobDict, decode: Callable[[int], str | None]) -> None:
    for t, lp in d.items():
        if lp.decoded_token is None:
            lp.decoded_token = decode(t)
