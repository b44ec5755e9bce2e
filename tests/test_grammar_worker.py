"""The grammar worker process (engine/structured/remote.py, ``CUTEINFER_GRAMMAR_PROCESS=1``) on
CPU, with Qwen3's real tokenizer: its outcomes and masks equal, bit for bit, in-process matchers
fed the same tokens on random walks; through the engine, pipelined steps with the worker give
the outputs of synchronous in-process scheduling; a worker that dies fails only its constrained
requests, and the next one starts a fresh worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")

from engine.api import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from engine.structured.grammar import grammar_text  # noqa: E402
from engine.structured.matcher import Advance, GrammarCache  # noqa: E402
from engine.structured.remote import OUTCOMES, GrammarWorker  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

VOCAB, EOS = 151936, (151645,)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text", "n"],
          "properties": {"text": {"type": "string", "maxLength": 40},
                         "n": {"type": "integer"}}}
GRAMMARS = [grammar_text(SO(json=SCHEMA)), grammar_text(SO(regex=r"[a-z]{1,8}( [a-z]{1,8})?")),
            grammar_text(SO(choice=["yes", "no", "maybe later"]))]


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer) -> Tokenizer:
    return qwen3_tokenizer


def _bits(rows: np.ndarray) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(rows).view(np.uint8), axis=-1,
                         bitorder="little")[..., :VOCAB].astype(bool)


def test_worker_outcomes_and_masks_equal_in_process_matchers(tokenizer: Tokenizer) -> None:
    """Random walks of 7 requests over three grammars (a random allowed token a step, now and
    then a disallowed one, which must answer ``error`` with llguidance's message): each step's
    outcomes and masks from the worker equal an in-process matcher's; rows of requests that
    stopped are left out, the others keep their order."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    ref = GrammarCache(tokenizer, VOCAB, EOS, threads=2)
    w = GrammarWorker(tokenizer.backend_tokenizer.to_str(), VOCAB, EOS, max_rows=8, threads=2)
    try:
        keys = list(range(100, 107))
        texts = [GRAMMARS[int(rng.integers(3))] for _ in keys]
        mine = {}
        for k, t in zip(keys, texts, strict=True):
            w.add(k, t)
            mine[k] = ref.matcher(t)
        live = list(keys)
        job = w.submit([], [], live)
        job.result()
        poison = np.full((8, ref.words), 0xDEADBEEF, np.uint32)
        for step in range(40):
            want = np.empty((len(live), ref.words), np.uint32)
            ref.fill_bitmasks([mine[k] for k in live], want)
            np.testing.assert_array_equal(job.mask, want, err_msg=f"seed {seed} step {step}")
            if not live:
                break
            toks = []
            for row in _bits(want):
                allowed = np.flatnonzero(row)
                bad = rng.random() < 0.05 or not allowed.size
                toks.append(int(rng.integers(VOCAB)) if bad else int(rng.choice(allowed)))
            nxt = list(live)
            w.slots[:] = poison[None]  # (a row the worker leaves out keeps the poison)
            job = w.submit(live, toks, nxt)
            codes, errors = job.outcomes()
            outs = []
            for i, (k, t) in enumerate(zip(live, toks, strict=True)):
                res = mine[k].accept(t)
                outs.append(res)
                assert OUTCOMES[codes[i]] == res.value, (seed, step, k, t)
                if res is Advance.ERROR:
                    # (the message's first line; the rest carries timings)
                    assert errors[i].splitlines()[0] == mine[k].error.splitlines()[0], seed
            job.result()
            stopped = [k for k, r in zip(live, outs, strict=True) if r is not Advance.CONTINUE]
            for row, k in enumerate(nxt):
                if k in stopped:
                    assert (job.mask[row] == 0xDEADBEEF).all()
            # the next step's rows: the requests that continue (a fresh mask job of them)
            live = [k for k in live if k not in stopped]
            w.drop(stopped)
            job = w.submit([], [], live)
            job.result()
    finally:
        w.close()
    assert w.proc.poll() is not None  # the process exited


def test_adds_answer_compile_errors_and_a_dead_worker_is_replaced(
        tokenizer: Tokenizer, chat_dir: Path, worker_env) -> None:
    """``add`` (admission): a grammar that does not compile in the worker is a
    GrammarError with llguidance's message, after the job in flight was read, and the worker
    serves on; through the engine, a request whose worker was killed is admitted by a fresh
    worker, not refused."""
    from engine.structured.grammar import GrammarError

    w = GrammarWorker(tokenizer.backend_tokenizer.to_str(), VOCAB, EOS, max_rows=4)
    try:
        w.add(1, GRAMMARS[2])
        job = w.submit([], [], [1])  # (in flight: add reads its answers first)
        with pytest.raises(GrammarError) as e:
            w.add(2, "%llguidance {}\nstart: (((")
        assert str(e.value) and w.dead is None
        assert job.exception() is None and _bits(job.mask).sum() > 0
        w.add(3, GRAMMARS[0])
        job = w.submit([], [], [3, 1])
        job.result()
        assert _bits(job.mask).sum(axis=1).min() > 0
    finally:
        w.close()
    llm = LLM(str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=4)
    p = llm.engine.processors
    assert p.warm_up()
    first = p.worker
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    out = llm.generate(["Answer:"], _params()[:1])[0].outputs[0]
    assert out.error is None and p.worker is not first and p.worker.dead is None
    p.close()


def test_worker_refuses_an_unknown_request_and_serves_on(tokenizer: Tokenizer) -> None:
    from engine.structured.grammar import GrammarError

    w = GrammarWorker(tokenizer.backend_tokenizer.to_str(), VOCAB, EOS, max_rows=4)
    try:
        w.add(1, GRAMMARS[2])
        job = w.submit([7], [5], [])  # key 7 was never added: its advance is an error
        codes, errors = job.outcomes()
        assert OUTCOMES[codes[0]] == "error" and "no matcher" in errors[0]
        # masking an unknown key fails the job, not the worker; its rows then allow everything
        # (the step's other rows run; the matchers' advance judges what was sampled)
        job = w.submit([], [], [1, 7])
        job.mask[:] = 0
        e = job.exception()
        assert isinstance(e, GrammarError) and "no matcher" in str(e)
        job.result()
        assert (job.mask == 0xFFFFFFFF).all()
        job = w.submit([], [], [1])
        job.result()
        assert _bits(job.mask).sum() > 0 and w.dead is None
    finally:
        w.close()


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")


def _params(bad_words: bool = True) -> list[SamplingParams]:
    so = [SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["a"]}), SO(regex=r"[0-9]{2,5}-[a-z]{1,3}"),
          SO(choice=["left", "right"]), None]
    return [SamplingParams(max_tokens=24, temperature=0.9, seed=s, structured_outputs=so[s % 4],
                           bad_words=["the"] if s % 5 == 1 and bad_words else None,
                           repetition_penalty=1.2 if s % 3 == 0 else 1.0)
            for s in range(12)]


def test_pipelined_worker_steps_equal_synchronous_in_process(chat_dir: Path,
                                                             monkeypatch) -> None:
    """The same constrained workload: synchronous scheduling with in-process matchers, then
    async scheduling (pipelined, masks started early) and synchronous scheduling with the
    worker give the same tokens and finishes."""
    opts = dict(backend="numpy", max_model_len=256, max_num_seqs=8)
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "0")
    want = LLM(str(chat_dir), async_scheduling=False, **opts).generate(["Answer:"] * 12,
                                                                       _params())
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")
    for async_ in (True, False):
        llm = LLM(str(chat_dir), async_scheduling=async_, **opts)
        assert llm.engine.processors.remote
        got = llm.generate(["Answer:"] * 12, _params())
        for g, x in zip(got, want, strict=True):
            a, b = g.outputs[0], x.outputs[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), async_
        assert llm.engine.processors.worker is not None and not llm.engine.processors.active
        llm.engine.processors.close()


def test_a_dead_worker_fails_only_its_requests(chat_dir: Path, worker_env) -> None:
    """Killing the worker mid-generation: the constrained requests end with finish_reason
    error naming the worker, the plain ones finish normally, and a constrained request after
    that gets a fresh worker and valid output."""
    llm = LLM(str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=8)
    eng = llm.engine
    ps = _params()
    for i, p in enumerate(ps):
        eng.add_request("Answer:", p, request_id=f"r{i}")
    for _ in range(3):
        eng.step()
    worker = eng.processors.worker
    assert worker is not None
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    while eng.has_unfinished():
        eng.step()
    outs = {r: eng.output(eng.requests[r]).outputs[0] for r in list(eng.requests)}
    for i, p in enumerate(ps):
        o = outs[f"r{i}"]
        if p.structured_outputs is None:
            assert o.finish_reason in ("length", "stop") and o.error is None, o
        elif o.finish_reason == "error":
            assert "grammar worker" in (o.error or ""), o.error
    # (a constrained request that had completed before the kill ended with "stop")
    assert any(outs[f"r{i}"].finish_reason == "error" for i in range(12) if i % 4 != 3)
    ok = llm.generate(["Say:"], SamplingParams(max_tokens=8, temperature=0,
                                               structured_outputs=SO(choice=["left", "right"])))
    assert ok[0].outputs[0].text in ("left", "right")
    assert eng.processors.worker is not worker and eng.processors.worker.dead is None
    eng.processors.close()


def test_no_worker_process_falls_back_to_in_process(chat_dir: Path, worker_env,
                                                    monkeypatch) -> None:
    """Where no process can be spawned, the first constrained request warns and the engine's
    matchers stay in its own process; its output still follows the grammar, and nothing of the
    failed start (shared memory, tokenizer file) is left."""
    import glob

    from engine.structured import remote

    def refuse(*a, **k):
        raise OSError("spawning is not allowed here")

    before = set(glob.glob("/dev/shm/cuteinfer-tok-*"))
    monkeypatch.setattr(remote.subprocess, "Popen", refuse)
    llm = LLM(str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=4)
    assert llm.engine.processors.remote
    with pytest.warns(UserWarning, match="grammar worker process could not start"):
        out = llm.generate(["Say:"], SamplingParams(
            max_tokens=8, temperature=0, structured_outputs=SO(choice=["left", "right"])))
    assert out[0].outputs[0].text in ("left", "right")
    assert not llm.engine.processors.remote and llm.engine.processors.worker is None
    assert set(glob.glob("/dev/shm/cuteinfer-tok-*")) == before


class _Queued:
    """A launched step of ``GatedNumpy``: it runs when it is finished (in launch order)."""

    def __init__(self, batch, src_rows, gate=None) -> None:
        self.batch, self.src_rows, self.gate, self.out = batch, src_rows, gate, None


class GatedNumpy:
    """The numpy executor with a device's order of work: launches queue and run in order when
    one of them is finished; a gated launch (``launch_gated``) waits, when it runs, for the
    grammar worker's gate flag to reach its sequence number and reads its masks from the gate
    rows, as the cuda executor's stream does."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.heartbeat = 0
        self.queue: list[_Queued] = []
        self.gated = 0
        self.waited_s = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def can_gate(self, batch) -> bool:  # (as the cuda executor: no logprobs rows)
        return not (batch.num_logprobs >= 0).any()

    def launch(self, batch, src_rows=None):
        q = _Queued(batch, src_rows)
        self.queue.append(q)
        return q

    def launch_gated(self, batch, src_rows, gate):
        assert batch.procs is not None and batch.procs.grammar_mask.shape[0] == 0
        self.gated += 1
        q = _Queued(batch, src_rows, gate)
        self.queue.append(q)
        return q

    def launch_procs(self, handle, procs):
        if not hasattr(handle, "batch") or isinstance(handle, _Queued):
            return self.inner.launch_procs(handle, procs)
        handle.batch.procs = procs
        return self.launch(handle.batch, handle.src_rows)

    def _run(self, q: _Queued) -> None:
        import ctypes
        import time

        if q.gate is not None:
            _base, _n, rows_ptr, flag_ptr = q.gate.region
            flag = np.ctypeslib.as_array((ctypes.c_uint32 * 1).from_address(flag_ptr))
            t0 = time.perf_counter()
            while int(flag[0]) < q.gate.seq:
                assert time.perf_counter() - t0 < 30, "the gate was never opened"
                time.sleep(1e-4)
            self.waited_s += time.perf_counter() - t0
            words = (self.inner.vocab_size + 31) // 32 if hasattr(self.inner, "vocab_size") \
                else q.batch.procs.grammar_mask.shape[1]
            rows = np.ctypeslib.as_array((ctypes.c_uint32 * (q.gate.rows * words))
                                         .from_address(rows_ptr)).reshape(q.gate.rows, words)
            q.batch.procs.grammar_mask = rows.copy()
        q.out = self.inner.launch(q.batch, q.src_rows)

    def _drain(self, until=None) -> None:
        while self.queue:
            q = self.queue.pop(0)
            self._run(q)
            if q is until:
                return

    def finish(self, handle):
        if isinstance(handle, _Queued):
            if handle.out is None:
                self._drain(handle)
            return handle.out
        return self.inner.finish(handle)

    def execute(self, batch):
        self._drain()
        return self.inner.execute(batch)


def _gated_llm(chat_dir: Path, **opts) -> LLM:
    llm = LLM(str(chat_dir), async_scheduling=True, **opts)
    llm.engine.executor = GatedNumpy(llm.engine.executor)
    llm.engine._gate_on = True
    return llm


def test_gated_steps_equal_synchronous_in_process(chat_dir: Path, monkeypatch) -> None:
    """Gated steps (``CUTEINFER_GRAMMAR_GATE``): a continuation whose only late rows are grammar
    rows is launched whole and waits (on the device; here in ``GatedNumpy``) for the worker's
    gate; the outputs equal synchronous scheduling with in-process matchers, token for token,
    beside bad words (deferred steps), penalties and plain rows."""
    opts = dict(backend="numpy", max_model_len=256, max_num_seqs=8)
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "0")
    want = LLM(str(chat_dir), async_scheduling=False, **opts).generate(["Answer:"] * 12,
                                                                       _params())
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")
    llm = _gated_llm(chat_dir, **opts)
    got = llm.generate(["Answer:"] * 12, _params())
    for g, x in zip(got, want, strict=True):
        a, b = g.outputs[0], x.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert llm.engine.executor.gated > 0 and llm.engine._gate is None
    # without bad words (every late row a grammar row): most continuations are gated; one
    # constrained row wants logprobs (a step holding it is deferred, not gated)
    ps = _params(bad_words=False)
    ps[5] = SamplingParams(max_tokens=24, temperature=0.9, seed=5, logprobs=2,
                           structured_outputs=ps[5].structured_outputs)
    llm.engine.executor.gated = 0
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "0")
    want = LLM(str(chat_dir), async_scheduling=False, **opts).generate(["Answer:"] * 12, ps)
    got = llm.generate(["Answer:"] * 12, ps)
    for g, x in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == x.outputs[0].token_ids
    assert got[5].outputs[0].logprobs == want[5].outputs[0].logprobs
    assert llm.engine.executor.gated >= 5, llm.engine.executor.gated
    assert not llm.engine.processors.active
    llm.engine.processors.close()


class _FailingGate(GatedNumpy):
    """``launch_gated`` fails once after ``after`` gated launches (as when the device will not
    map the worker's memory), before anything is queued."""

    def __init__(self, inner, after: int) -> None:
        super().__init__(inner)
        self.after, self.failed = after, 0

    def launch_gated(self, batch, src_rows, gate):
        if self.gated >= self.after and not self.failed:
            self.failed += 1
            raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_FAKE")
        return super().launch_gated(batch, src_rows, gate)


def test_a_failed_gated_launch_falls_back_to_deferred_steps(chat_dir: Path, monkeypatch,
                                                            caplog) -> None:
    """A gated launch that fails (here the third) fails no request: that step and every later
    one are launched deferred (the gate is opened, gating turned off with a warning), and the
    outputs equal synchronous in-process scheduling token for token."""
    opts = dict(backend="numpy", max_model_len=256, max_num_seqs=8)
    ps = _params(bad_words=False)
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "0")
    want = LLM(str(chat_dir), async_scheduling=False, **opts).generate(["Answer:"] * 12, ps)
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")
    llm = LLM(str(chat_dir), async_scheduling=True, **opts)
    ex = llm.engine.executor = _FailingGate(llm.engine.executor, after=2)
    llm.engine._gate_on = True
    with caplog.at_level("WARNING", logger="engine.engine"):
        got = llm.generate(["Answer:"] * 12, ps)
    for g, x in zip(got, want, strict=True):
        a, b = g.outputs[0], x.outputs[0]
        assert (a.token_ids, a.finish_reason, a.error) == (b.token_ids, b.finish_reason, None)
    assert ex.failed == 1 and ex.gated == 2 and not llm.engine._gate_on
    assert llm.engine._gate is None and "launched deferred from now on" in caplog.text
    llm.engine.processors.close()


def test_a_dead_worker_opens_the_gate(chat_dir: Path, worker_env) -> None:
    """Killing the worker while gated steps run: no step waits for ever (the engine opens the
    gate of the step in flight), the constrained requests end with an error naming the worker,
    the plain ones finish normally."""
    llm = _gated_llm(chat_dir, backend="numpy", max_model_len=256, max_num_seqs=8)
    eng = llm.engine
    ps = _params(bad_words=False)
    for i, p in enumerate(ps):
        eng.add_request("Answer:", p, request_id=f"r{i}")
    for _ in range(4):
        eng.step()
    assert eng.executor.gated > 0
    os.kill(eng.processors.worker.proc.pid, signal.SIGKILL)
    eng.processors.worker.proc.wait()
    while eng.has_unfinished():
        eng.step()
    for i, p in enumerate(ps):
        o = eng.output(eng.requests[f"r{i}"]).outputs[0]
        if p.structured_outputs is None:
            assert o.finish_reason in ("length", "stop") and o.error is None, o
        elif o.finish_reason == "error":
            assert "grammar worker" in (o.error or ""), o.error
    assert eng._gate is None
    eng.processors.close()


def _assert_warm(eng) -> None:
    """(A fault hook run in the engine core process, after its start-up: refuses to start a
    core whose structured output is not ready.)"""
    p = eng.processors
    if not (p.warm and p.worker is not None and p.worker.dead is None):
        raise RuntimeError("structured output was not warmed up")


def test_warm_up_readies_structured_output_before_the_first_request(
        chat_dir: Path, worker_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_up`` starts the grammar worker and builds llguidance's tokenizer, so the first
    constrained request builds neither (each takes ~2 s for Qwen3's vocabulary, and in this
    process llguidance holds the GIL meanwhile: every running request would stall); the engine
    core process warms up before it says it is ready (``CUTEINFER_GRAMMAR_WARMUP``, default on);
    a model without a tokenizer has nothing to warm."""
    from engine.server.testing import make_engine, write_test_checkpoint

    llm = LLM(str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=4)
    p = llm.engine.processors
    assert p.worker is None and not p.warm  # (lazy without a warm-up)
    assert p.warm_up() and p.warm
    w = p.worker
    assert w is not None and w.dead is None
    assert w.conn.poll(0) is False  # (the warm-up's compile was answered: the worker is ready)
    out = llm.generate(["Answer:"] * 3, _params()[:3])
    assert p.worker is w and all(o.outputs[0].error is None for o in out)
    # the grammars compile in the worker alone: this process builds no llguidance tokenizer
    assert p.grammars._ll_tok is None
    p.close()
    # in-process matchers: the warm-up builds this process's tokenizer
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "0")
    q = LLM(str(chat_dir), backend="numpy", max_model_len=256, max_num_seqs=4).engine.processors
    assert q.warm_up() and q.worker is None and q.grammars._ll_tok is not None
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")
    monkeypatch.setenv("CUTEINFER_GRAMMAR_WARMUP", "1")  # (the default; conftest turns it off)
    core = make_engine(chat_dir, core="process", fault=f"{__name__}:_assert_warm")
    core.shutdown()
    tiny = write_test_checkpoint(chat_dir.parent / "tiny-no-tok", "tiny")
    assert not (tiny / "tokenizer.json").exists()
    assert not LLM(str(tiny), backend="numpy", max_model_len=64).engine.processors.warm_up()
