"""OutputProcessor's text: a running request without stop strings is detokenized when a view
asks for it or when it finishes (one DecodeStream call for all the tokens since), and comes out
the same as per-step detokenization; an error found at that point still fails the request."""

from __future__ import annotations

import numpy as np
import pytest

from engine.output_processor import OutputProcessor
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams

MIXED = "Hello 世界! 🤖👩‍👩‍👧 こんにちは, naïve café — 日本語のテキスト 🎉 Ünïcödé ✓ 1234 done."


class _Sched:
    """The scheduler's ``finish`` as the output processor calls it (a finished request stays as
    it is, as ``Scheduler.finish`` leaves it)."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, FinishReason, str | None]] = []

    def __call__(self, req: Request, reason: FinishReason, stop_reason=None, error=None) -> None:
        self.finished.append((req.request_id, reason, error))
        if not req.is_finished:
            req.finish(reason, stop_reason=stop_reason, error=error)


def _req(rid: str, prompt: list[int], **kw) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=10_000, **kw), seed=0, arrival=0)
    r.status = RequestStatus.RUNNING
    return r


def _run(tok, ids: list[int], prompt: list[int], chunks: list[int], views: set[int],
         **kw) -> tuple[Request, list[str], OutputProcessor]:
    """Feed ``ids`` in steps of ``chunks`` tokens; call ``delta`` after the steps in ``views``;
    finish by length after the last. Returns the request, the deltas, the processor."""
    op = OutputProcessor(tok, _Sched())
    req = _req("r", prompt, **kw)
    op.add(req)
    deltas, at = [], 0
    for k, n in enumerate(chunks):
        req.output_token_ids.extend(ids[at:at + n])
        at += n
        if at >= len(ids):
            req.finish(FinishReason.LENGTH)
        op.process([req])
        if k in views or req.is_finished:
            deltas.append(op.delta(req).text)
    return req, deltas, op


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("skip", [True, False])
def test_lazy_text_equals_per_step_text(qwen3_tokenizer, seed: int, skip: bool) -> None:
    tok = qwen3_tokenizer
    rng = np.random.default_rng(seed)
    text = MIXED + "<|im_end|>" + MIXED[::-1]
    ids = tok.encode(text) + rng.integers(0, 151_000, 40).tolist()  # random ids too
    prompt = tok.encode("Translate: ")
    chunks, left = [], len(ids)
    while left:
        n = int(min(left, rng.integers(1, 5)))
        chunks.append(n)
        left -= n
    # the reference: a stop string that never matches makes every step detokenize
    ref, ref_deltas, _ = _run(tok, ids, prompt, chunks, set(range(len(chunks))),
                              stop=["\x00never\x00"], skip_special_tokens=skip)
    views = set(rng.choice(len(chunks), size=len(chunks) // 4, replace=False).tolist())
    lazy, deltas, op = _run(tok, ids, prompt, chunks, views, skip_special_tokens=skip)
    assert lazy.text == ref.text == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == "".join(ref_deltas) == lazy.text  # nothing lost or repeated
    assert lazy.finish_reason is FinishReason.LENGTH and lazy.error is None
    assert op.output(lazy).outputs[0].text == lazy.text


def test_running_steps_decode_nothing_until_asked(qwen3_tokenizer) -> None:
    tok = qwen3_tokenizer
    ids = tok.encode(MIXED)
    op = OutputProcessor(tok, _Sched())
    req = _req("r", [])
    op.add(req)
    for t in ids[:10]:
        req.output_token_ids.append(t)
        op.process([req])
    assert req.text == ""  # no view asked: the steps carried no detokenization
    assert op.visible_text(req) == tok.decode(ids[:10]).rstrip("\ufffd")
    assert req.text == op.visible_text(req)


def test_an_error_found_when_the_text_catches_up_fails_the_request(qwen3_tokenizer) -> None:
    tok = qwen3_tokenizer
    sched = _Sched()
    op = OutputProcessor(tok, sched)
    req = _req("r", [])
    op.add(req)
    req.output_token_ids.extend(tok.encode("fine so far"))
    op.process([req])
    req.output_token_ids.append(-1)  # not a token id: decoding it fails
    req.finish(FinishReason.LENGTH)  # the scheduler ended it on length in the same step
    op.process([req])
    assert req.finish_reason is FinishReason.ERROR
    assert "processing the output failed" in (req.error or "")
    out = op.output(req).outputs[0]
    assert out.finish_reason == "error" and out.error == req.error
