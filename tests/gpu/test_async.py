"""Async scheduling on cuda: decode steps launched before the previous step's tokens reach the
host (their input tokens copied on the device from the previous samples, their samples read
back through pinned memory behind an event) give synchronous scheduling's outputs token for
token, greedy and seeded, with stop tokens, EOS and mixed arrivals; so do steps with logits
processors, whose heads graph runs before their processor rows exist (``launch_deferred``), or
whose rows are built ahead when none depends on the token in flight (penalties, logit_bias,
allowed ids: ``launch`` replays the whole decode graph with them)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.model.synthetic import write_checkpoint
from tests.gpu.helpers import report
from tests.test_async_scheduling import (
    _ahead,
    _counting,
    _deferred_count,
    _launches,
    _proc_workload,
    _same,
    _steps,
    _workload,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("async") / "m", "small-qwen3", seed=6,
                            overrides={"num_hidden_layers": 3}, quiet=True)


def test_async_scheduling_equals_synchronous_on_cuda(model_dir):
    """Requests end by length only: a stop found one step late leaves a row in the next step,
    which can put an async step in another bucket than the synchronous one, and another
    bucket's kernels (token tile, split-KV factor) round some rows differently: with stops, 3
    of 7 runs diverged at some sampled token (seeds 832455071, 431598581)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    prompts, params = _workload(rng, 64, sync_only=False, late_stops=False)
    opts = dict(backend="cuda", max_num_seqs=32, max_model_len=512,
                num_gpu_blocks_override=32 * 32 + 8)
    sync = LLM(str(model_dir), async_scheduling=False, **opts)
    want = sync.generate(prompts, params)
    del sync
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    seen = _counting(llm)
    got = llm.generate(prompts, params)
    _same(got, want, f"seed {seed}")
    st = llm.engine.stats
    assert seen[0] > 0 and st.graph_steps > 0
    assert llm.engine.block_manager.gauges()["live"] == 0
    report({"test": "async_equals_sync_cuda", "continuations": seen[0], "ends": seen[1],
            "graph_steps": st.graph_steps, "steps": st.steps})


def test_mixed_steps_launched_ahead_equal_synchronous_on_cuda(model_dir):
    """Steps with prompt tokens beside decode rows (admissions and chunks under the 128-token
    mixed-step cap) are planned while the step before runs and replay their mixed-step graph
    behind it: the decode rows' input tokens gathered on the device from its samples, the
    prompt tokens from the host. Greedy and seeded, ended by length: the outputs token for
    token and the steps row for row those of synchronous scheduling."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    n = 48
    prompts = [rng.integers(5, 3000, int(rng.integers(8, 200))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 40)), ignore_eos=True,
                             temperature=float(rng.choice([0.0, 0.9])),
                             seed=int(rng.integers(1 << 30))) for _ in range(n)]
    opts = dict(backend="cuda", max_num_seqs=16, max_model_len=512,
                num_gpu_blocks_override=16 * 32 + 8)
    sync = LLM(str(model_dir), async_scheduling=False, **opts)
    want_steps = _steps(sync)
    want = sync.generate(prompts, params)
    del sync
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    got_steps, ahead = _steps(llm), _ahead(llm)
    ex = llm.engine.executor
    launch = ex.launch
    mixed = [0]

    def spy(b, src_rows=None):
        mixed[0] += not b.is_decode and ex._mixed_async(b) is not None
        return launch(b, src_rows)

    ex.launch = spy
    _same(llm.generate(prompts, params), want, f"seed {seed}")
    assert got_steps == want_steps, f"seed {seed}"
    assert ahead[0] > 0 and mixed[0] > 0, (ahead, mixed)
    assert llm.engine.block_manager.gauges()["live"] == 0
    report({"test": "mixed_ahead_equal_sync_cuda", "planned_ahead": ahead[0],
            "mixed_launched_ahead": mixed[0], "steps": len(got_steps)})


def _proc_want(model_dir, n: int, min_tokens: bool = True):
    """(seed, opts, prompts, params, synchronous outputs) of ``_proc_workload(n)`` ended by
    length (``min_tokens`` False: its min_tokens requests left out)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    opts = dict(backend="cuda", max_num_seqs=32, max_model_len=512,
                num_gpu_blocks_override=32 * 32 + 8)
    sync = LLM(str(model_dir), async_scheduling=False, **opts)
    prompts, params = _proc_workload(rng, n, sync.engine.model_config.vocab_size,
                                     late_stops=False)
    if not min_tokens:
        keep = [i for i, p in enumerate(params) if not p.min_tokens]
        prompts, params = [prompts[i] for i in keep], [params[i] for i in keep]
    want = sync.generate(prompts, params)
    del sync
    return seed, opts, prompts, params, want


def test_deferred_processor_steps_equal_synchronous_on_cuda(model_dir):
    """Penalties, min_tokens, allowed ids and logit_bias rows, seeded and greedy: while a step
    holds a min_tokens row still unmet, the heads graph of step N+1 runs from N's samples on
    the device, the processor rows are staged once N is complete, the tail samples; once none
    is left, the rows are built ahead and the whole decode graph replays with them. Outputs
    equal synchronous scheduling's.

    Requests end by length only (see the test above; seed 537892371, with min_tokens stops,
    differed in a last token)."""
    seed, opts, prompts, params, want = _proc_want(model_dir, 48)
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    seen = _deferred_count(llm)
    launched = _launches(llm)  # (built ahead once no unmet min_tokens row is left, maybe)
    ex = llm.engine.executor
    heads0, tails0 = ex.heads.replays, ex.tails.replays
    _same(llm.generate(prompts, params), want, f"seed {seed}")
    heads = ex.heads.replays - heads0
    assert seen[0] > 0 and heads > 0, (seen, heads)
    assert ex.tails.replays - tails0 == heads, "a heads step whose tail did not replay"  # eager
    assert ex.queued_heads > 0, "no forward was queued behind the tail before it"
    assert ex._queued is None and ex._awaiting is None
    assert llm.engine.block_manager.gauges()["live"] == 0
    report({"test": "deferred_procs_equal_sync_cuda", "deferred": seen[0], "head_replays": heads,
            "built_ahead": launched[0],
            "tail_replays": ex.tails.replays - tails0, "queued_heads": ex.queued_heads})


def test_processor_rows_built_ahead_equal_synchronous_on_cuda(model_dir):
    """Penalties (both signs), allowed ids and logit_bias rows, seeded and greedy, no
    min_tokens: no row depends on the token in flight, so every continuation is launched whole
    (its rows staged with its inputs, the whole decode graph replayed) and none is deferred.
    Outputs equal synchronous scheduling's."""
    seed, opts, prompts, params, want = _proc_want(model_dir, 64, min_tokens=False)
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    launched = _launches(llm)
    graphs0 = llm.engine.stats.graph_steps
    _same(llm.generate(prompts, params), want, f"seed {seed}")
    ex = llm.engine.executor
    assert launched[0] > 0 and launched[1] == 0, launched
    assert llm.engine.stats.graph_steps > graphs0
    assert ex._queued is None and ex._awaiting is None
    assert llm.engine.block_manager.gauges()["live"] == 0
    report({"test": "procs_built_ahead_equal_sync_cuda", "built_ahead": launched[0],
            "graph_steps": llm.engine.stats.graph_steps - graphs0})


def test_a_failing_deferred_step_discards_the_forward_queued_behind_it(model_dir):
    """``launch_procs`` raising while the next step's forward is queued behind its tail: the
    failed step's requests end with the error, the queued forward never runs (nothing is left
    queued or awaiting), and the engine serves on with synchronous scheduling's outputs."""
    from engine import SamplingParams

    opts = dict(backend="cuda", max_num_seqs=8, max_model_len=256,
                num_gpu_blocks_override=8 * 16 + 8)
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    ex = llm.engine.executor
    inner, calls, queued = ex.launch_procs, [0], [0]

    def flaky(handle, procs):
        calls[0] += 1
        if calls[0] >= 3 and ex._queued is not None:
            queued[0] += 1
            raise RuntimeError("injected")
        return inner(handle, procs)

    ex.launch_procs = flaky
    # min_tokens unmet to the end: every continuation is deferred (penalties alone are not)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                        min_tokens=20, stop_token_ids=[11])
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [sp, sp])
    assert queued[0] == 1, "no failure while a forward was queued"
    assert all(o.outputs[0].finish_reason == "error" for o in outs), outs
    assert "injected" in (outs[0].outputs[0].error or "")
    assert ex._queued is None and ex._awaiting is None
    ex.launch_procs = inner
    again = llm.generate([[5, 6, 7], [8, 9, 10]], [sp, sp])
    want = LLM(str(model_dir), async_scheduling=False, **opts).generate(
        [[5, 6, 7], [8, 9, 10]], [sp, sp])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.block_manager.gauges()["live"] == 0
    report({"test": "deferred_failure_with_queued_forward", "queued_heads": ex.queued_heads})


def test_deferred_steps_behind_a_whole_deferred_step_equal_synchronous(model_dir):
    """A request with logprobs makes its deferred steps run whole (no heads graph); when it
    finishes, the next deferred step's forward is queued behind such a step, whose own upload
    would overwrite token rows sent early: they must go up after it. Outputs (tokens and the
    logprob request's logprobs) equal synchronous scheduling's, and forwards were queued."""
    from engine import SamplingParams

    opts = dict(backend="cuda", max_num_seqs=8, max_model_len=256,
                num_gpu_blocks_override=8 * 16 + 8)
    rng = np.random.default_rng()
    prompts = [rng.integers(5, 300, int(rng.integers(3, 30))).tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True,
                             repetition_penalty=1.3, logprobs=1 if i < 2 else None,
                             min_tokens=4 + 3 * i, stop_token_ids=[11])  # (deferred steps)
              for i in range(6)]
    want = LLM(str(model_dir), async_scheduling=False, **opts).generate(prompts, params)
    llm = LLM(str(model_dir), async_scheduling=True, **opts)
    ex = llm.engine.executor
    q0 = ex.queued_heads
    got = llm.generate(prompts, params)
    _same(got, want, "logprobs then penalties")
    for g, w in zip(got[:2], want[:2], strict=True):
        assert [next(iter(d)) for d in g.outputs[0].logprobs] == \
            [next(iter(d)) for d in w.outputs[0].logprobs]
    assert ex.queued_heads > q0, "no forward was queued"
    assert ex._queued is None and ex._awaiting is None
    report({"test": "deferred_behind_whole_deferred", "queued_heads": ex.queued_heads - q0})
