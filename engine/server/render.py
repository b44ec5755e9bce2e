"""OpenAI's JSON shapes for outputs: usage, logprobs (legacy completions and chat), SSE events."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from engine.request import Logprob, LogprobDict
from engine.server.stream import StreamDelta

MIN_LOGPROB = -9999.0  # -inf is not JSON; clients expect a number (vLLM's convention)


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def error_event(d: StreamDelta) -> bytes:
    """The stream's terminal event for a failed request (the openai client raises APIError)."""
    if d.fatal:
        kind, code = "service_unavailable_error", "engine_unavailable"
    else:
        kind, code = "server_error", "internal_error"
    return sse({"error": {"message": f"the request failed (finish_reason 'error'): {d.error}",
                          "type": kind, "param": None, "code": code}})


def usage(d: StreamDelta) -> dict[str, Any]:
    return usage_of(d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens)


def usage_of(prompt_tokens: int, completion_tokens: int,
             cached_tokens: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def _token(lp: Logprob | None, token_id: int, as_ids: bool = False) -> str:
    if as_ids or lp is None or lp.decoded_token is None:
        return f"token_id:{token_id}"  # no tokenizer: name the id, as vLLM does
    return lp.decoded_token


def completion_logprobs(token_ids: Sequence[int], lps: Sequence[LogprobDict],
                        offset: int, as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (the sampled token
    plus the top n, as a token -> logprob map), text_offset. Returns it and the next offset.
    ``as_ids``: tokens as "token_id:N" (vLLM's ``return_tokens_as_token_ids``)."""
    tokens: list[str] = []
    token_lps: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for tid, d in zip(token_ids, lps, strict=False):
        s = _token(d.get(tid), tid, as_ids)
        tokens.append(s)
        token_lps.append(_lp(d[tid].logprob) if tid in d else MIN_LOGPROB)
        tops.append({_token(v, t, as_ids): _lp(v.logprob) for t, v in d.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def echo_logprobs(prompt_ids: Sequence[int], lps: Sequence[LogprobDict | None],
                  decode: Callable[[int], str], as_ids: bool = False
                  ) -> tuple[dict[str, Any], int]:
    """The legacy completions shape of an echoed prompt: the first token has no logprob (null,
    as OpenAI and vLLM give it); ``decode`` spells tokens the logprobs do not. Returns it and the
    next text offset."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        d = lps[pos] if pos < len(lps) else None
        lp = None if d is None else d.get(tid)
        s = f"token_id:{tid}" if as_ids else (
            lp.decoded_token if lp is not None and lp.decoded_token is not None else decode(tid))
        tokens.append(s)
        token_lps.append(None if lp is None else _lp(lp.logprob))
        tops.append(None if d is None else {_token(v, t, as_ids): _lp(v.logprob)
                                            for t, v in d.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def join_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs blocks (the echoed prompt's, then the completion's) as one."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(lps: Sequence[LogprobDict | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position null (the first, and positions served
    from the prefix cache) or {token id: {logprob, rank, decoded_token}}."""
    if lps is None:
        return None
    return [None if d is None else {
        str(t): {"logprob": _lp(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
        for t, v in d.items()} for d in lps]


def _chat_entry(s: str, logprob: float) -> dict[str, Any]:
    return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], lps: Sequence[LogprobDict],
                  top_n: int, as_ids: bool = False) -> list[dict[str, Any]]:
    """The chat shape: per token {token, logprob, bytes, top_logprobs: the n most likely}."""
    out = []
    for tid, d in zip(token_ids, lps, strict=False):
        chosen = d.get(tid)
        entry = _chat_entry(_token(chosen, tid, as_ids),
                            chosen.logprob if chosen else MIN_LOGPROB)
        ranked = sorted((v.rank, t, v) for t, v in d.items()
                        if v.rank is not None and v.rank <= top_n)
        entry["top_logprobs"] = [_chat_entry(_token(v, t, as_ids), v.logprob)
                                 for _, t, v in ranked[:top_n]]
        out.append(entry)
    return out
