"""Logits processors on the numpy backend (the reference): vLLM's formulas written out again
independently, the step rows the engine builds, device-slot bookkeeping, structured output with
llguidance, and the typed errors of SamplingParams."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.api import LLM
from engine.logits_processors import LogitsProcessorState, bits_to_mask, token_bits
from engine.model.loader import load_checkpoint
from engine.model.reference import ReferenceModel
from engine.model.synthetic import write_checkpoint
from engine.request import Request
from engine.sampling import SlotState, process_logits
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.sampling_params import StructuredOutputsParams as SO
from engine.step import FLAG_PENALTY, FLAG_SAVE_RAW, FLAG_SPARSE
from tests.processor_cases import random_params


def vllm_penalties(logits: np.ndarray, prompt: list[int], output: list[int],
                   params: SamplingParams) -> np.ndarray:
    """vLLM's v1 sampler order and formulas, for one row (float32, as vLLM's float32 logits):
    allowed_token_ids, bad words (single tokens here), min_tokens, logit_bias, then
    ``apply_penalties``: repetition over prompt | output (``where(x > 0, x / r, x * r)``),
    ``x -= frequency * output_counts``, ``x -= presence * output_mask``."""
    v = logits.shape[0]
    x = logits.astype(np.float32).copy()
    if params.allowed_token_ids is not None:
        keep = np.zeros(v, bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = -np.inf
    if len(output) < params.min_tokens:
        x[list(params.stop_token_ids)] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += np.float32(b)
    counts = np.bincount(np.asarray(output, np.int64), minlength=v)[:v]
    out_mask = counts > 0
    prompt_mask = np.zeros(v, bool)
    prompt_mask[prompt] = True
    rep = np.full(v, np.float32(params.repetition_penalty), np.float32)
    rep[~(prompt_mask | out_mask)] = 1.0
    x = np.where(x > 0, x / rep, x * rep).astype(np.float32)
    x -= np.float32(params.frequency_penalty) * counts.astype(np.float32)
    x -= np.float32(params.presence_penalty) * out_mask.astype(np.float32)
    return x


def _request(i: int, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    req = Request(f"r{i}", prompt, params, seed=i, arrival=i, eos_token_ids=(),
                  max_model_len=4096)
    req.output_token_ids = list(output)
    return req


@pytest.mark.parametrize("seed", range(6))
def test_process_logits_is_vllms_formulas(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab, rows = 300, 12
    state = LogitsProcessorState(None, vocab, (), num_slots=rows)
    reqs, want = [], []
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[:, rng.integers(0, vocab, 10)] = -np.inf
    for i in range(rows):
        params = random_params(rng, vocab)
        prompt = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        output = rng.integers(0, vocab // 3, int(rng.integers(0, 30))).tolist()
        req = _request(i, prompt, output, params)
        state.attach(req)
        reqs.append(req)
        want.append(vllm_penalties(logits[i], prompt, output, params))
    rows_ = state.prepare(reqs)
    if rows_ is None:  # no row drew a processor
        assert all(r.procs is None for r in reqs)
        return
    slots = SlotState(vocab)
    slots.init(rows_.inits)
    steps = np.array([len(r.output_token_ids) for r in reqs], np.uint32)
    got, raw = process_logits(logits, rows_, steps, slots)
    np.testing.assert_array_equal(got, np.stack(want))  # the same float32 operations: exact
    np.testing.assert_array_equal(raw, logits)  # no grammar: logprobs see the model's logits
    # the step is idempotent: counting its tokens, then running it again, changes nothing
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    slots.count(rows_, steps, tokens)
    again, _ = process_logits(logits, rows_, steps, slots)
    np.testing.assert_array_equal(again, got)
    # and the next step sees each penalized row's token counted once
    for r in np.nonzero(rows_.flags & FLAG_PENALTY)[0]:
        s = int(rows_.slot[r])
        want_counts = np.bincount(reqs[r].output_token_ids + [int(tokens[r])], minlength=vocab)
        np.testing.assert_array_equal(slots.counts[s], want_counts)


def test_bits_roundtrip_and_flags() -> None:
    ids = [0, 1, 31, 32, 33, 999]
    bits = token_bits(ids, 1000)
    assert bits.dtype == np.uint32 and bits.shape == (32,)
    assert np.nonzero(bits_to_mask(bits, 1000))[0].tolist() == ids
    assert int(bits[0]) == (1 | 2 | 1 << 31) and int(bits[1]) == 3
    state = LogitsProcessorState(None, 1000, (), num_slots=4)
    plain = _request(0, [1, 2], [], SamplingParams())
    biased = _request(1, [1, 2], [], SamplingParams(logit_bias={"7": 500.0}, logprobs=1))
    for r in (plain, biased):
        state.attach(r)
    assert plain.procs is None and state.active
    assert state.prepare([plain]) is None  # no row with a processor: nothing per step
    rows = state.prepare([plain, biased])
    assert rows.flags.tolist() == [0, FLAG_SPARSE | FLAG_SAVE_RAW]
    assert rows.sparse_ids.tolist() == [7] and rows.sparse_vals.tolist() == [100.0]  # clamped
    assert rows.sparse_start.tolist() == [0, 0, 1] and rows.slot.tolist() == [-1, -1]
    biased.finish(biased.finish_reason or _stop())
    assert not state.active


def _stop():
    from engine.request import FinishReason

    return FinishReason.STOP


def test_slots_are_taken_over_and_rebuilt() -> None:
    """More penalized requests than slots: a request outside the step loses its slot and gets
    it back rebuilt from its token ids (its counts as before)."""
    vocab = 50
    state = LogitsProcessorState(None, vocab, (), num_slots=2)
    p = SamplingParams(frequency_penalty=1.0)
    reqs = [_request(i, [i], [i, i, 3], p) for i in range(3)]
    for r in reqs:
        state.attach(r)
    a = state.prepare(reqs[:2])
    assert sorted(a.slot.tolist()) == [0, 1] and len(a.inits) == 2
    b = state.prepare(reqs[1:])  # r2 takes r0's slot; r1 keeps its own
    assert b.slot.tolist()[0] == a.slot.tolist()[1] and len(b.inits) == 1
    assert reqs[0].procs.slot is None
    c = state.prepare(reqs[:1])  # r0 is rebuilt, with its three outputs counted
    assert len(c.inits) == 1 and c.inits[0].output_ids.tolist() == [0, 0, 3]
    slots = SlotState(vocab)
    slots.init(c.inits)
    assert slots.counts[c.inits[0].slot][[0, 3]].tolist() == [2, 1]
    assert slots.counted[c.inits[0].slot] == 3


def test_steady_rows_are_reused_only_while_they_hold() -> None:
    """``prepare`` over the same requests reuses the previous step's rows (the same arrays,
    read-only); random events between steps (a request finished, a slot taken over by a request
    outside the step, a failed step releasing slots, a request with a per-step sparse list, a
    different batch) make it rebuild. Every step's rows equal rows built from scratch."""
    from engine.request import RequestStatus

    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    vocab = 64
    state = LogitsProcessorState(None, vocab, (), num_slots=6)
    kinds = [dict(frequency_penalty=0.5), dict(logit_bias={3: 1.0}), dict(),
             dict(allowed_token_ids=[1, 2, 5]), dict(repetition_penalty=1.3, logprobs=2),
             dict(min_tokens=4, stop_token_ids=[7]), dict(bad_words=None)]
    reqs = []
    for i in range(10):
        kw = kinds[int(rng.integers(len(kinds)))] if i else kinds[0]
        r = _request(i, [i, 1], [2] * int(rng.integers(0, 6)), SamplingParams(**kw))
        state.attach(r)
        reqs.append(r)
    step = list(reqs[:5])
    reused = 0
    for t in range(60):
        ev = rng.random()
        if ev < 0.1:  # finish one
            r = step[int(rng.integers(len(step)))]
            r.status = RequestStatus.FINISHED
        elif ev < 0.2:  # a request outside the step takes slots
            state.prepare([r for r in reqs if r not in step][:3])
        elif ev < 0.25:
            state.step_failed(type("O", (), {"seqs": [type("S", (), {"request": r})()
                                                      for r in step]})())
        elif ev < 0.35:  # another batch
            step = [reqs[int(k)] for k in rng.choice(10, int(rng.integers(1, 7)), False)]
        prev = state._steady
        got = state.prepare(step)
        if got is None:
            continue
        if prev is not None and state._steady is prev:
            reused += 1
            assert got.flags is prev[2] and not got.flags.flags.writeable and not got.inits
        state._steady = None
        want = state.prepare(step)
        assert not want.inits, seed  # (got's step acquired the slots)
        for f in ("flags", "slot", "penalties", "grammar_row", "sparse_start", "sparse_ids",
                  "sparse_vals"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f),
                                          err_msg=f"seed {seed} step {t} {f}")
    # (how often the random events above left a steady batch depends on the seed) a steady
    # batch of fixed rows: the second step reuses the first's rows
    steady = []
    for i, kw in enumerate(kinds[:5]):
        r = _request(20 + i, [i, 1], [2], SamplingParams(**kw))
        state.attach(r)
        steady.append(r)
    state.prepare(steady)  # (takes their slots: rows with inits are not kept)
    second = state.prepare(steady)
    third = state.prepare(steady)
    assert third.flags is second.flags and third.sparse_ids is second.sparse_ids, (seed, reused)


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"bad_words": "bad"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"structured_outputs": {"regex": "a(", }}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ({"structured_outputs": 5}, "structured_outputs"),
])
def test_invalid_processor_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and f"SamplingParams.{field}" in str(e.value)


# ---- through the engine (numpy backend) --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("lp") / "m", "tiny-qwen3", quiet=True)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LLM:
    return LLM(model=str(tiny_dir), backend="numpy", max_model_len=128, max_num_seqs=4)


def test_greedy_penalties_follow_vllms_formulas_step_by_step(tiny: LLM, tiny_dir: Path) -> None:
    """Each greedy token with penalties is the argmax of vLLM's formulas applied to the
    reference model's logits of the sequence so far."""
    model = ReferenceModel(load_checkpoint(tiny_dir))
    prompt = [3, 17, 17, 40, 99, 3]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                       frequency_penalty=0.6, presence_penalty=0.4, logit_bias={5: 2.0})
    out = tiny.generate(prompt, p)[0].outputs[0].token_ids
    plain = tiny.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    assert out != plain  # the penalties changed the output
    for i, tok in enumerate(out):
        logits = model.forward(prompt + out[:i])[-1]
        want = vllm_penalties(logits, prompt, out[:i], p)
        assert tok == int(np.argmax(want)), i


def test_batched_equals_alone_with_few_slots(tiny: LLM) -> None:
    """Eight penalized requests through four slots (max_num_seqs=4): each output equals its
    output alone, so slots taken over and rebuilt hold the right counts."""
    prompts = [[5 + i, 9, 9, 12 + i] for i in range(8)]
    ps = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                         frequency_penalty=0.3 * (i % 3), bad_words=None,
                         allowed_token_ids=list(range(0, 600)) if i % 2 else None)
          for i in range(8)]
    batched = [o.outputs[0].token_ids for o in tiny.generate(prompts, ps)]
    alone = [tiny.generate(pr, p)[0].outputs[0].token_ids for pr, p in zip(prompts, ps,
                                                                           strict=True)]
    assert batched == alone
    assert all(t < 600 for i, toks in enumerate(batched) if i % 2 for t in toks)
    assert not tiny.engine.processors.active and not tiny.engine.processors.pool.holders


def test_min_tokens_masks_eos_and_stop_ids(tiny: LLM) -> None:
    eos = tiny.engine.eos_token_ids
    # force EOS / a stop id with a huge bias: they still cannot come before min_tokens
    stop = 7
    bias = {t: 100.0 for t in (*eos, stop)}
    p = SamplingParams(max_tokens=20, temperature=0, min_tokens=6, logit_bias=bias,
                       stop_token_ids=[stop])
    o = tiny.generate([1, 2, 3], p)[0].outputs[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "stop"  # six, then the stop
    assert o.token_ids[-1] in (*eos, stop) and not set(o.token_ids[:-1]) & {*eos, stop}


def test_logprobs_are_of_the_logits_before_the_processors(tiny: LLM) -> None:
    """vLLM's default (raw logprobs): a logit_bias changes the token, not its logprob."""
    base = SamplingParams(max_tokens=1, temperature=0, logprobs=3)
    plain = tiny.generate([4, 5, 6], base)[0].outputs[0]
    biased_p = SamplingParams(max_tokens=1, temperature=0, logprobs=3, logit_bias={11: 100.0})
    biased = tiny.generate([4, 5, 6], biased_p)[0].outputs[0]
    assert biased.token_ids == [11]
    lp_plain, lp_biased = plain.logprobs[0], biased.logprobs[0]
    top_plain = {t: v.logprob for t, v in lp_plain.items()}
    for t, v in lp_biased.items():
        if t in top_plain:
            assert v.logprob == pytest.approx(top_plain[t], abs=1e-6)


def test_processor_ids_outside_the_vocabulary_are_refused(tiny: LLM) -> None:
    from engine.input_processor import RequestError

    with pytest.raises(RequestError, match="logit_bias: token ids"):
        tiny.generate([1], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(RequestError, match="structured_outputs needs the model's tokenizer"):
        tiny.generate([1], SamplingParams(structured_outputs=SO(regex="a")))


# ---- structured output (a real tokenizer) --------------------------------------------------------


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]}}}


@pytest.fixture(scope="module", params=["in-process", "worker"])
def chat(chat_dir: Path, request: pytest.FixtureRequest) -> LLM:
    """The chat checkpoint's engine, its matchers in this process or in the grammar worker
    process (``CUTEINFER_GRAMMAR_PROCESS``)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CUTEINFER_GRAMMAR_PROCESS", "1" if request.param == "worker" else "0")
    try:
        llm = LLM(model=str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=8)
    finally:
        mp.undo()
    assert llm.engine.processors.remote == (request.param == "worker")
    yield llm
    llm.engine.processors.close()


def _valid(obj: object) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "pet"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
            and obj["pet"] in ("cat", "dog", "fish"))


def test_structured_json_regex_choice_hold_in_a_mixed_batch(chat: LLM) -> None:
    so = [SO(json=SCHEMA), SO(regex=r"[0-9]{3}-[a-z]{2}"), SO(choice=["left", "right"]), None]
    ps = [SamplingParams(max_tokens=48, temperature=0.9, seed=s, structured_outputs=so[s % 4],
                         logprobs=1 if s % 3 == 0 else None, repetition_penalty=1.1)
          for s in range(12)]
    outs = chat.generate(["Answer:"] * 12, ps)
    for s, o in enumerate(outs):
        text, fin = o.outputs[0].text, o.outputs[0].finish_reason
        kind = s % 4
        if kind == 0:
            assert _valid(json.loads(text)) and fin == "stop", text
        elif kind == 1:
            import re

            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and fin == "stop", text
        elif kind == 2:
            assert text in ("left", "right") and fin == "stop", text
    assert not chat.engine.processors.active


def test_grammar_that_cannot_continue_ends_with_an_error(chat: LLM) -> None:
    """A grammar whose every continuation another processor removes: the sampler has nothing
    left, the matcher rejects what it returns, and the request ends with finish_reason error,
    saying why; the engine serves on."""
    p = SamplingParams(max_tokens=8, temperature=0, structured_outputs=SO(regex="x+"),
                       allowed_token_ids=[0, 1, 2])  # "!", '"', "#": no x among them
    o = chat.generate(["Say x:"], p)[0].outputs[0]
    assert o.finish_reason == "error" and "structured output: the grammar cannot continue" \
        in (o.error or "")
    ok = chat.generate(["Say x:"], SamplingParams(max_tokens=8, temperature=0,
                                                  structured_outputs=SO(regex="x+")))
    assert set(ok[0].outputs[0].text) == {"x"} and not chat.engine.processors.active


def test_prepare_takes_early_masks_and_computes_what_they_lack(chat: LLM) -> None:
    """``prepare(..., early=)``: rows whose masks an early start computed point at them (the
    early rows of requests finished since stay unused); a constrained row the early start
    lacks makes ``prepare`` compute every mask itself. Both give the masks of a plain
    ``prepare``."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.logits_processors import EarlyMasks

    procs = chat.engine.processors
    sos = [SO(regex=r"[0-9]{3}"), SO(choice=["left", "right"]), None, SO(json=SCHEMA)]
    reqs = [_request(i, [1, 2, 3], [], SamplingParams(max_tokens=8, structured_outputs=so))
            for i, so in enumerate(sos)]
    for r in reqs:
        procs.attach(r)
    try:
        want = procs.prepare(reqs)
        want.fill_masks()
        want_rows = want.grammar_mask[want.grammar_row[want.grammar_row >= 0]]
        pool = ThreadPoolExecutor(1)
        # an early start over the step's rows plus one more request's (finished since)
        extra = _request(9, [1], [], SamplingParams(max_tokens=8, structured_outputs=sos[0]))
        procs.attach(extra)
        early = procs.start_early(_Out([]), np.zeros(0, np.int32), [extra, *reqs], pool.submit)
        assert early is not None and early.mask.shape[0] == 4
        got = procs.prepare(reqs, early)
        assert got.grammar_mask is early.mask and got.fill is None
        got.fill_masks()
        np.testing.assert_array_equal(got.grammar_mask[got.grammar_row[got.grammar_row >= 0]],
                                      want_rows)
        # an early start that lacks a constrained row of the step: computed here instead
        part = procs.start_early(_Out([]), np.zeros(0, np.int32), reqs[:1], pool.submit)
        got = procs.prepare(reqs, part)
        # (computed by ``fill``; the worker's: a job started now)
        assert got.grammar_mask is not part.mask
        assert (got.future if procs.remote else got.fill) is not None
        got.fill_masks()
        np.testing.assert_array_equal(got.grammar_mask[got.grammar_row[got.grammar_row >= 0]],
                                      want_rows)
        assert isinstance(part, EarlyMasks)
        pool.shutdown()
    finally:
        for r in [*reqs, extra]:
            if r.procs is not None:
                r.procs.release()
    assert not procs.active


class _Out:
    """A SchedulerOutput's shape for ``start_early``: its rows (``seqs``)."""

    def __init__(self, seqs: list) -> None:
        self.seqs = seqs
