"""OpenAI's JSON shapes for outputs: usage, logprobs (legacy completions and chat), SSE events."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


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
