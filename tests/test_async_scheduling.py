"""Async scheduling (``async_scheduling``, engine/engine.py ``_step_pipelined``): the decode step
after the one in flight is planned and launched before that one's tokens reach the host (its
input tokens are the previous samples, taken by the executor), and the host's bookkeeping of a
step overlaps the next. Outputs must equal synchronous scheduling's token for token, text and
finish reasons included, whatever stops a request (a stop token, EOS, a stop string, the length,
an abort, a failed step), with preemption, prefix caching and chunked prefill, and leave no page
behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from tests.test_speculative import _no_pages_left


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("async") / "m", "tiny-qwen3", seed=5,
                            quiet=True)


def _counting(llm: LLM) -> list[int]:
    """[continuations planned, pipeline ends] of ``llm``'s scheduler from now on."""
    sched = llm.engine.scheduler
    plan = sched.schedule_continuation
    seen = [0, 0]

    def spy(out, **kw):
        r = plan(out, **kw)
        seen[r is None] += 1
        return r

    sched.schedule_continuation = spy
    return seen


def _workload(rng: np.random.Generator, n: int, sync_only: bool = True,
              late_stops: bool = True):
    """Random prompts and params; ``sync_only``: some requests want logprobs (their steps run
    synchronously: a batch holding one never pipelines) or a logits processor.
    ``late_stops`` False: requests end by length only (no stop ids, strings or EOS, which async
    scheduling finds a step late, leaving a row in the next step: on cuda that can change the
    step's bucket, and the kernels of another bucket round some rows differently)."""
    prompts, params = [], []
    for _ in range(n):
        if rng.random() < 0.4:
            prompts.append(rng.integers(5, 300, int(rng.integers(2, 7))).tolist()
                           * int(rng.integers(2, 6)))
        else:
            prompts.append(rng.integers(5, 300, int(rng.integers(1, 60))).tolist())
        kw: dict = {"max_tokens": int(rng.integers(1, 48)), "ignore_eos": bool(rng.random() < 0.6)}
        if rng.random() < 0.5:
            kw.update(temperature=float(rng.uniform(0.3, 1.2)), top_k=int(rng.integers(0, 30)),
                      seed=int(rng.integers(1 << 30)))
        else:
            kw["temperature"] = 0.0
        if not late_stops:
            kw["ignore_eos"] = True
        elif rng.random() < 0.3:
            kw["stop_token_ids"] = rng.integers(5, 300, 4).tolist()
        if late_stops and rng.random() < 0.15:
            kw["stop"] = ["a", "e"]
        if sync_only and rng.random() < 0.1:
            kw["logprobs"] = 2  # decodes synchronously (the pipeline ends for it)
        if sync_only and rng.random() < 0.1:
            kw["repetition_penalty"] = 1.2  # a logits processor (rows built ahead)
        params.append(SamplingParams(**kw))
    return prompts, params


def _same(got, want, note: str) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], note
    assert [o.outputs[0].finish_reason for o in got] == [
        o.outputs[0].finish_reason for o in want], note
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want], note


def test_random_workloads_equal_synchronous_scheduling(tiny: Path) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    planned = 0
    for _ in range(4):
        prompts, params = _workload(rng, int(rng.integers(2, 24)))
        opts = dict(backend="numpy", max_num_seqs=int(rng.integers(1, 9)),
                    max_num_batched_tokens=int(rng.integers(16, 200)),
                    num_gpu_blocks_override=int(rng.integers(24, 80)), max_model_len=256,
                    enable_prefix_caching=bool(rng.random() < 0.7))
        want = LLM(str(tiny), async_scheduling=False, **opts).generate(prompts, params)
        llm = LLM(str(tiny), async_scheduling=True, **opts)
        seen = _counting(llm)
        got = llm.generate(prompts, params)
        _same(got, want, f"seed {seed}")
        _no_pages_left(llm)
        planned += seen[0]
    assert planned > 0  # the pipeline ran


def _steps(llm: LLM) -> list[tuple]:
    """Every step ``llm`` builds from now on: ((request id, first position, tokens), ...)."""
    seen: list[tuple] = []
    llm.engine.fault_hook = lambda out: seen.append(
        tuple((s.request.request_id, s.start, s.num_new) for s in out.seqs))
    return seen


def test_length_ended_workloads_run_the_synchronous_steps(tiny: Path) -> None:
    """Requests that end by length, more of them than seats: async scheduling runs exactly
    the steps synchronous scheduling runs, row for row. (A request that finishes with the step
    in flight gives its seat to a waiting one in the very next step, as it does synchronously;
    planning a continuation there instead would put the two schedules a step apart, and on
    cuda another step composition rounds some rows differently.)"""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    for _ in range(3):
        prompts, params = _workload(rng, int(rng.integers(8, 40)), sync_only=False,
                                    late_stops=False)
        opts = dict(backend="numpy", max_num_seqs=int(rng.integers(2, 9)),
                    max_num_batched_tokens=int(rng.integers(64, 300)),
                    num_gpu_blocks_override=int(rng.integers(60, 120)), max_model_len=256,
                    enable_prefix_caching=bool(rng.random() < 0.5),
                    mixed_step_tokens=int(rng.choice([0, 16, 32])))  # (cuda's cap and lifts)
        sync = LLM(str(tiny), async_scheduling=False, **opts)
        want_steps = _steps(sync)
        want = sync.generate(prompts, params)
        llm = LLM(str(tiny), async_scheduling=True, **opts)
        seen, got_steps = _counting(llm), _steps(llm)
        got = llm.generate(prompts, params)
        _same(got, want, f"seed {seed}")
        assert got_steps == want_steps, f"seed {seed}"
        assert seen[0] > 0, f"seed {seed}: the pipeline ran"
        _no_pages_left(llm)


def _ahead(llm: LLM) -> list[int]:
    """[steps planned ahead with prompt tokens (chunks, admissions), steps planned ahead of a
    step with prompt tokens] from now on (``Scheduler._plan_ahead``)."""
    sched = llm.engine.scheduler
    plan = sched._plan_ahead
    seen = [0, 0]

    def spy(prev):
        r = plan(prev)
        if r is not None:
            seen[0] += any(s.num_new > 1 or s.start < s.request.num_prompt_tokens
                           for s in r.seqs)
            seen[1] += any(s.num_new > 1 for s in prev.seqs)
        return r

    sched._plan_ahead = spy
    return seen


def test_mixed_steps_are_planned_ahead(tiny: Path) -> None:
    """Steps with prompt tokens (admissions beside decode rows, the next chunk of a prompt)
    are planned while the step before is in flight, and after such a step too: 2 seats per
    wave, prompts in chunks of the 16-token cap; row for row the synchronous steps."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    prompts = [rng.integers(5, 300, int(rng.integers(20, 60))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 20)),
                             ignore_eos=True) for _ in prompts]
    opts = dict(backend="numpy", max_num_seqs=4, mixed_step_tokens=16)
    sync = LLM(str(tiny), async_scheduling=False, **opts)
    want_steps = _steps(sync)
    want = sync.generate(prompts, params)
    llm = LLM(str(tiny), async_scheduling=True, **opts)
    seen, got_steps = _ahead(llm), _steps(llm)
    _same(llm.generate(prompts, params), want, "mixed")
    assert got_steps == want_steps
    assert seen[0] >= 10 and seen[1] >= 10, seen
    _no_pages_left(llm)


def test_a_step_that_would_run_at_once_runs_after_the_step_in_flight(tiny: Path) -> None:
    """A step planned ahead that the executor would run at once (``launches_async`` False:
    cuda's eager prefills, a graph still to capture) runs once the step in flight is
    complete, its outputs first: it never delays them."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 300, int(rng.integers(20, 60))).tolist() for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 10
    opts = dict(backend="numpy", max_num_seqs=4, mixed_step_tokens=16)
    want = LLM(str(tiny), async_scheduling=False, **opts).generate(prompts, params)
    llm = LLM(str(tiny), async_scheduling=True, **opts)
    eng, ex = llm.engine, llm.engine.executor
    order: list[str] = []
    launch, update = ex.launch, eng.scheduler.update_from_output
    ex.launches_async = lambda b: False
    ex.launch = lambda b, src=None: (order.append("launch" + "M" * (not b.is_decode)),
                                     launch(b, src))[1]
    eng.scheduler.update_from_output = lambda out, st: (order.append("update"),
                                                        update(out, st))[1]
    seen = _ahead(llm)
    _same(llm.generate(prompts, params), want, "after")
    assert seen[0] > 0
    # a step with prompt tokens planned ahead launches only after the step before updated
    for i, e in enumerate(order[1:], 1):
        if e == "launchM":
            assert order[i - 1] == "update", order[:i + 1]
    _no_pages_left(llm)


def test_steady_decoding_pipelines_nearly_every_step(tiny: Path) -> None:
    prompts = [[5 + i, 6, 7] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    want = LLM(str(tiny), backend="numpy", async_scheduling=False).generate(prompts, params)
    llm = LLM(str(tiny), backend="numpy", async_scheduling=True)
    seen = _counting(llm)
    _same(llm.generate(prompts, params), want, "steady")
    # 40 tokens each, all at once: the prefill step, then 39 decode steps of which every one
    # after the first is planned ahead; the last one ends the pipeline
    assert seen[0] >= 37 and seen[1] <= 2, seen
    _no_pages_left(llm)


def test_aborts_while_a_step_is_in_flight(tiny: Path) -> None:
    eng: LLMEngine = LLM(str(tiny), backend="numpy", async_scheduling=True).engine
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [eng.add_request([9 + i, 10, 11], sp) for i in range(4)]
    for _ in range(5):
        eng.step()
    assert eng._pending is not None  # a step in flight
    eng.abort(reqs[1].request_id)
    eng.abort(reqs[2].request_id)
    while eng.has_unfinished():
        eng.step()
    plain = LLM(str(tiny), backend="numpy", async_scheduling=False).engine
    for r in (reqs[0], reqs[3]):
        q = plain.add_request(list(r.prompt_token_ids), sp)
        while plain.has_unfinished():
            plain.step()
        assert q.output_token_ids == r.output_token_ids
    assert reqs[1].is_finished and len(reqs[1].output_token_ids) < 30
    assert eng.block_manager.gauges()["live"] == 0


def test_a_failed_step_in_the_pipeline_fails_only_its_requests(tiny: Path) -> None:
    llm = LLM(str(tiny), backend="numpy", async_scheduling=True)
    eng = llm.engine
    calls = [0]

    def hook(out):
        calls[0] += 1
        if calls[0] == 6:  # a continuation step (the pipeline runs by then)
            raise RuntimeError("injected")

    eng.fault_hook = hook
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [sp, sp])
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert "injected" in (outs[0].outputs[0].error or "")
    eng.fault_hook = None
    again = llm.generate([[5, 6, 7]], [sp])[0]  # the engine serves on
    want = LLM(str(tiny), backend="numpy", async_scheduling=False).generate([[5, 6, 7]], [sp])[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    _no_pages_left(llm)


def test_the_two_process_engine_with_async_scheduling(tiny: Path) -> None:
    rng = np.random.default_rng(3)
    prompts, params = _workload(rng, 10)
    want = LLM(str(tiny), backend="numpy", async_scheduling=False).generate(prompts, params)
    llm = LLM(str(tiny), backend="numpy", async_scheduling=True, engine_core="process")
    try:
        _same(llm.generate(prompts, params), want, "process")
    finally:
        llm.shutdown()


def test_cli_flag() -> None:
    from tests.test_args import cli_args

    assert cli_args().async_scheduling is True  # the default, as the server runs
    assert cli_args("--no-async-scheduling").async_scheduling is False


def test_interleaved_adds_aborts_and_steps_hypothesis(tiny: Path) -> None:
    """Hypothesis drives both engines (async and synchronous scheduling) through the same
    interleaving of request arrivals, aborts and steps, with a small pool and few sequences:
    a request neither engine aborted gets the same tokens from both; an aborted one's tokens in
    one engine are a prefix of the other's (the abort lands a step apart); no page is left."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from engine.args import EngineArgs
    from engine.kv.invariants import check_invariants

    def engine(async_on: bool, cap: int) -> LLMEngine:
        return LLMEngine(EngineArgs(model=str(tiny), backend="numpy", max_num_seqs=3,
                                    num_gpu_blocks_override=14, max_model_len=96,
                                    max_num_batched_tokens=48, async_scheduling=async_on,
                                    mixed_step_tokens=cap))

    op = st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.booleans(),
                  st.integers(0, 1 << 20)),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("step"), st.integers(1, 6)))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(op, min_size=1, max_size=24), st.sampled_from([0, 8, 16]))
    def run(ops, cap):  # cap: mixed_step_tokens (steps with prompt tokens planned ahead)
        a, s = engine(True, cap), engine(False, cap)
        ra, rs, aborted = [], [], set()
        for o in ops:
            if o[0] == "add":
                _, plen, max_tokens, greedy, seed = o
                prompt = [(seed + 7 * i) % 250 + 5 for i in range(plen)]
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=bool(seed % 3),
                                    temperature=0.0 if greedy else 0.9, seed=seed)
                ra.append(a.add_request(prompt, sp))
                rs.append(s.add_request(prompt, sp))
            elif o[0] == "abort" and ra:
                i = o[1] % len(ra)
                aborted.add(i)
                a.abort(ra[i].request_id)
                s.abort(rs[i].request_id)
            else:
                for _ in range(o[1]):
                    if a.has_unfinished():
                        a.step()
                        check_invariants(a.block_manager)  # (between calls: a step in flight)
                    if s.has_unfinished():
                        s.step()
        for e in (a, s):
            while e.has_unfinished():
                e.step()
            assert e.block_manager.gauges()["live"] == 0
        for i, (x, y) in enumerate(zip(ra, rs, strict=True)):
            tx, ty = x.output_token_ids, y.output_token_ids
            if i in aborted:
                n = min(len(tx), len(ty))
                assert tx[:n] == ty[:n], i
            else:
                assert tx == ty, i
                assert x.finish_reason == y.finish_reason, i

    run()


def test_an_executor_without_launch_runs_synchronously(tiny: Path) -> None:
    """An executor that only has ``execute`` (a stand-in, a third-party backend) still serves
    with async scheduling on: its steps run one at a time."""

    class ExecuteOnly:
        def __init__(self, inner):
            self.inner = inner
            self.heartbeat = 0

        def execute(self, b):
            return self.inner.execute(b)

        def shutdown(self):
            self.inner.shutdown()

    rng = np.random.default_rng(11)
    prompts, params = _workload(rng, 8)
    want = LLM(str(tiny), backend="numpy", async_scheduling=False).generate(prompts, params)
    llm = LLM(str(tiny), backend="numpy", async_scheduling=True)
    llm.engine.executor = ExecuteOnly(llm.engine.executor)
    seen = _counting(llm)
    _same(llm.generate(prompts, params), want, "execute-only")
    assert seen == [0, 0]  # never pipelined
    _no_pages_left(llm)


def _deferred_count(llm: LLM) -> list[int]:
    """How many steps got their logits processors late (``launch_procs``) from now on."""
    ex = llm.engine.executor
    inner = ex.launch_procs
    seen = [0]

    def spy(handle, procs):
        seen[0] += 1
        return inner(handle, procs)

    ex.launch_procs = spy
    return seen


def _launches(llm: LLM) -> list[int]:
    """[steps launched whole with logits processor rows, steps launched deferred] from now on."""
    ex = llm.engine.executor
    launch, deferred = ex.launch, ex.launch_deferred
    seen = [0, 0]

    def spy(batch, src_rows=None):
        seen[0] += batch.procs is not None and src_rows is not None
        return launch(batch, src_rows)

    def spy_deferred(batch, src_rows=None):
        seen[1] += 1
        return deferred(batch, src_rows)

    ex.launch, ex.launch_deferred = spy, spy_deferred
    return seen


def _proc_workload(rng: np.random.Generator, n: int, vocab: int, late_stops: bool = True):
    """Prompts and params where most requests have logits processors whose rows depend on the
    tokens so far (penalties, min_tokens with a biased stop id, allowed ids, logit_bias);
    ``late_stops`` False: EOS ignored (``_workload``), and half the min_tokens requests get
    penalties instead, the other half min_tokens = max_tokens (their biased stop id banned to
    the end: they end by length, and every step holding one is deferred)."""
    prompts, params = [], []
    for _ in range(n):
        prompts.append(rng.integers(5, 300, int(rng.integers(1, 40))).tolist())
        kw: dict = {"max_tokens": int(rng.integers(2, 40)),
                    "ignore_eos": bool(rng.random() < 0.5),
                    "temperature": float(rng.choice([0.0, 0.8])),
                    "seed": int(rng.integers(1 << 30))}
        r = rng.random()
        if r < 0.25:
            kw.update(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
        elif r < 0.375 and not late_stops:
            kw.update(repetition_penalty=0.8, presence_penalty=-0.5)
        elif r < 0.5:
            stop = int(rng.integers(5, 300))
            least = (int(rng.integers(1, min(8, kw["max_tokens"]))) if late_stops
                     else kw["max_tokens"])
            kw.update(min_tokens=least, stop_token_ids=[stop],
                      logit_bias={stop: 30.0})  # the stop id wins once min_tokens allows it
        elif r < 0.7:
            kw.update(allowed_token_ids=rng.integers(0, vocab, 40).tolist())
        elif r < 0.85:
            kw.update(logit_bias={int(t): 5.0 for t in rng.integers(0, vocab, 3)})
        if not late_stops:
            kw["ignore_eos"] = True
        params.append(SamplingParams(**kw))
    return prompts, params


def test_logits_processor_steps_pipeline_and_equal_synchronous(tiny: Path) -> None:
    """Decode steps with logits processors pipeline too: the next step's forward is launched
    before the one in flight completes, its processor rows (min_tokens, penalties, bans) are
    built once it has (``launch_deferred`` / ``launch_procs``), or built ahead when none of
    its rows depends on the token in flight (``launch``; see
    ``test_token_independent_processors_are_built_ahead``). Outputs equal synchronous
    scheduling's, with preemption and prefix caching, and no page or slot is left."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    pipelined = 0
    for _ in range(3):
        opts = dict(backend="numpy", max_num_seqs=int(rng.integers(2, 9)),
                    num_gpu_blocks_override=int(rng.integers(24, 80)), max_model_len=256,
                    enable_prefix_caching=bool(rng.random() < 0.7))
        want_llm = LLM(str(tiny), async_scheduling=False, **opts)
        prompts, params = _proc_workload(rng, int(rng.integers(3, 16)),
                                         want_llm.engine.model_config.vocab_size)
        want = want_llm.generate(prompts, params)
        llm = LLM(str(tiny), async_scheduling=True, **opts)
        seen = _launches(llm)
        _same(llm.generate(prompts, params), want, f"seed {seed}")
        _no_pages_left(llm)
        assert not llm.engine.processors.active and not llm.engine.processors.pool.holders
        pipelined += sum(seen)
    assert pipelined > 0, seed


def test_token_independent_processors_are_built_ahead(tiny: Path) -> None:
    """Penalties, logit_bias, allowed ids and a met min_tokens do not depend on the token in
    flight: a continuation holding only those is launched whole with its processor rows
    (``launch`` with ``src_rows``), never deferred. A min_tokens still unmet (its stop ban
    depends on the output count) defers its steps until it is met. Outputs equal synchronous
    scheduling's."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    opts = dict(backend="numpy", max_num_seqs=8, max_model_len=256)
    want_llm = LLM(str(tiny), async_scheduling=False, **opts)
    vocab = want_llm.engine.model_config.vocab_size
    prompts = [rng.integers(5, 300, int(rng.integers(2, 30))).tolist() for _ in range(6)]
    base = dict(max_tokens=24, ignore_eos=True, seed=int(rng.integers(1 << 30)))
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4, **base),
              SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.4,
                             **base),
              SamplingParams(temperature=0.0, logit_bias={int(rng.integers(vocab)): 4.0},
                             **base),
              SamplingParams(temperature=0.8, allowed_token_ids=rng.integers(
                  0, vocab, 30).tolist(), **base),
              SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=0.0, repetition_penalty=0.7, **base)]
    want = want_llm.generate(prompts, params)
    llm = LLM(str(tiny), async_scheduling=True, **opts)
    seen = _launches(llm)
    _same(llm.generate(prompts, params), want, f"seed {seed}")
    assert seen[0] >= 15 and seen[1] == 0, seen  # ~22 continuations, all built ahead
    _no_pages_left(llm)
    assert not llm.engine.processors.active and not llm.engine.processors.pool.holders
    # min_tokens = 8 of a stop id: deferred while unmet (the first ~7 steps), then built ahead
    stop = int(rng.integers(5, 300))
    params[4] = SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=[stop],
                               logit_bias={stop: 30.0}, max_tokens=24)
    want = want_llm.generate(prompts, params)
    seen = _launches(llm)
    got = llm.generate(prompts, params)
    _same(got, want, f"seed {seed}")
    assert len(got[4].outputs[0].token_ids) == 9  # 8 outputs, then the biased stop id
    assert 3 <= seen[1] <= 8 and seen[0] >= 10, seen
    _no_pages_left(llm)


def test_structured_output_pipelines_and_equals_synchronous(chat_dir: Path) -> None:
    """Grammar-constrained rows beside bad words, penalties and plain rows, sampled with seeds:
    the masks of a deferred step come from matchers that took the previous step's tokens, so
    the outputs equal synchronous scheduling's token for token (grammars that complete early
    finish their requests one step late; that row is dropped)."""
    from engine.sampling_params import StructuredOutputsParams as SO

    so = [SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["a"]}), SO(regex=r"[0-9]{2,5}-[a-z]{1,3}"),
          SO(choice=["left", "right"]), None]
    ps = [SamplingParams(max_tokens=24, temperature=0.9, seed=s, structured_outputs=so[s % 4],
                         bad_words=["the"] if s % 5 == 1 else None,
                         repetition_penalty=1.2 if s % 3 == 0 else 1.0)
          for s in range(12)]
    opts = dict(backend="numpy", max_model_len=256, max_num_seqs=8)
    want = LLM(str(chat_dir), async_scheduling=False, **opts).generate(["Answer:"] * 12, ps)
    llm = LLM(str(chat_dir), async_scheduling=True, **opts)
    seen = _deferred_count(llm)
    procs, early_used = llm.engine.processors, [0, 0]
    inner = procs.prepare

    def prepare(reqs, early=None):  # count the steps whose masks were started early
        rows = inner(reqs, early)
        if early is not None and early.mask is not None:
            early_used[0] += 1
            early_used[1] += rows is not None and rows.grammar_mask is early.mask
        return rows

    procs.prepare = prepare
    _same(llm.generate(["Answer:"] * 12, ps), want, "structured")
    assert seen[0] > 0
    # the masks of deferred steps started before the previous step's outputs were committed,
    # and the rows took them
    assert early_used[0] > 0 and early_used[1] == early_used[0], early_used
    assert not llm.engine.processors.active
    _no_pages_left(llm)


def test_a_deferred_step_that_fails_fails_only_its_requests(tiny: Path) -> None:
    """``launch_procs`` raising (a processor row the executor refuses) fails that step's
    requests with the error; the engine serves on and leaves no page or slot behind."""
    llm = LLM(str(tiny), backend="numpy", async_scheduling=True)
    ex = llm.engine.executor
    inner, calls = ex.launch_procs, [0]

    def flaky(handle, procs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected")
        return inner(handle, procs)

    ex.launch_procs = flaky
    # min_tokens unmet to the end: every continuation is deferred (penalties alone are not)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                        min_tokens=20, stop_token_ids=[11])
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [sp, sp])
    assert all(o.outputs[0].finish_reason == "error" for o in outs), outs
    assert "injected" in (outs[0].outputs[0].error or "")
    ex.launch_procs = inner
    again = llm.generate([[5, 6, 7]], [sp])[0]
    want = LLM(str(tiny), backend="numpy", async_scheduling=False).generate([[5, 6, 7]], [sp])[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    _no_pages_left(llm)
    assert not llm.engine.processors.active and not llm.engine.processors.pool.holders
