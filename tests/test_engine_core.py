"""The two-process engine (``engine.core``): the engine core in a child process behind
``MultiprocessEngine`` gives what the in-process ``LLMEngine`` gives, token for token and
character for character; aborts and stop strings free the core's pages; a dead core is an error
within seconds, never a hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from engine.args import EngineArgs  # noqa: E402
from engine.core.client import EngineCoreDeadError, MultiprocessEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.server.testing import make_engine  # noqa: E402

ARGS = {"backend": "numpy", "max_model_len": 256}


def _args(model: Path, **kw) -> EngineArgs:
    return EngineArgs.from_kwargs(model=str(model), **{**ARGS, **kw})


def _run(eng, prompts, params) -> dict[str, tuple[list[int], str, str | None]]:
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    deadline = time.monotonic() + 120
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the engine made no progress"
        eng.step()
    out = {}
    for r in reqs:
        o = eng.output(r)
        c = o.outputs[0]
        lps = None if c.logprobs is None else [
            [(t, round(lp.logprob, 5), lp.rank) for t, lp in d.items()] for d in c.logprobs]
        out[r.request_id] = (c.token_ids, c.text, c.finish_reason, c.stop_reason, lps,
                             o.prompt_logprobs is not None)
        eng.pop_finished(r.request_id)
    return out


@pytest.fixture(scope="module")
def mp_engine(chat_dir: Path):
    eng = MultiprocessEngine(_args(chat_dir))
    yield eng
    eng.shutdown()


def test_same_tokens_and_text_as_in_process(chat_dir: Path, mp_engine) -> None:
    local = make_engine(chat_dir, **ARGS)
    prompts = ["The capital of France is", "Once upon a time", [5, 6, 7, 8, 9], "Hello"]
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=9, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, stop=[" "]),
              ]
    want = _run(local, prompts, params)
    got = _run(mp_engine, prompts, params)
    assert list(got.values()) == list(want.values())
    # the stop string ended request 4 early, in the front end, and the core was told
    assert want[list(want)[3]][2] == "stop"


def test_stop_string_and_abort_free_the_cores_pages(mp_engine) -> None:
    stop = mp_engine.add_request("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=200, ignore_eos=True, stop=["e"]))
    long = mp_engine.add_request("Hello", SamplingParams(temperature=0.0, max_tokens=200,
                                                         ignore_eos=True))
    while not stop.is_finished:
        mp_engine.step()
    mp_engine.abort(long.request_id)
    assert long.is_finished and long.finish_reason.value == "abort"
    mp_engine.pop_finished(stop.request_id)
    mp_engine.pop_finished(long.request_id)
    deadline = time.monotonic() + 10
    while True:  # the core's gauges arrive at most every 0.1 s
        mp_engine.step(timeout_ms=50)
        g = mp_engine.gauges()
        if g and g["running"] == g["waiting"] == g["kv"]["live"] == g["kv"]["requests"] == 0:
            break
        assert time.monotonic() < deadline, f"the core kept pages or requests: {g}"
    assert not mp_engine.has_unfinished()


def test_refused_request_leaves_the_core_alone(mp_engine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        mp_engine.add_request("x", SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError):
        mp_engine.add_request([10**9], SamplingParams(max_tokens=1))
    got = _run(mp_engine, ["Hello"], [SamplingParams(temperature=0.0, max_tokens=3)])
    assert len(next(iter(got.values()))[0]) == 3


def test_killed_core_is_an_error_within_seconds(chat_dir: Path) -> None:
    eng = MultiprocessEngine(_args(chat_dir))
    try:
        req = eng.add_request("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        while not req.output_token_ids:
            eng.step()
        os.kill(eng.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineCoreDeadError, match="exited"):
            while True:
                eng.step()
                assert time.monotonic() - t0 < 5
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineCoreDeadError):
            eng.add_request("Hello", SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()


def test_core_that_cannot_start_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(Exception) as e:
        MultiprocessEngine(_args(tmp_path))
    assert "hidden_size" in str(e.value) or "config" in str(e.value)


def _boom(eng) -> None:  # a fault hook run in the core process before it says it is ready
    raise RuntimeError("no GPU today")


def test_core_failing_while_starting_is_one_clear_error(chat_dir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineCoreDeadError, match="failed to start: RuntimeError: no GPU today"):
        MultiprocessEngine(_args(chat_dir), fault="tests.test_engine_core:_boom")
    assert time.monotonic() - t0 < 60


def test_llm_with_the_core_in_a_process(chat_dir: Path) -> None:
    from engine import LLM

    prompts = ["The capital of France is", "Hello"]
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in
            LLM(str(chat_dir), engine_core="thread", **ARGS).generate(prompts, sp)]
    llm = LLM(str(chat_dir), engine_core="process", **ARGS)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        streamed = {}
        for piece in llm.stream(prompts, sp):
            streamed.setdefault(piece.index, []).extend(piece.delta_token_ids)
        assert got == want
        assert [streamed[i] for i in range(len(prompts))] == want
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="engine_core"):
        LLM(str(chat_dir), engine_core="fork", **ARGS)


def test_the_core_froze_its_start_up_heap(mp_engine) -> None:
    """The core moves start-up's objects (modules, the engine) out of its full collections
    before it serves (``freeze_heap``), and it still serves after it."""
    assert mp_engine.core_gc_frozen > 10_000
    got = _run(mp_engine, ["Hello"], [SamplingParams(temperature=0.0, max_tokens=4)])
    assert len(next(iter(got.values()))[0]) == 4


def test_freeze_heap_leaves_full_collections_only_the_new_objects() -> None:
    """In a fresh interpreter: after ``freeze_heap`` a full collection's generations hold only
    what was made since (the frozen objects are not walked), and cycles made since are still
    collected."""
    import subprocess
    import sys

    code = (
        "import gc, json\n"
        "import engine.engine, engine.server.app\n"
        "from engine.core import freeze_heap\n"
        "before = len(gc.get_objects())\n"
        "frozen = freeze_heap()\n"
        "class C: pass\n"
        "for _ in range(100):\n"
        "    a = C(); a.me = a\n"
        "del a\n"
        "after = len(gc.get_objects())\n"
        "print(json.dumps([before, frozen, after, gc.collect()]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    before, frozen, after, collected = __import__("json").loads(out.stdout.splitlines()[-1])
    assert before > 10_000 and frozen > 0.9 * before  # (the collection freed a few)
    assert after < before / 20
    assert collected >= 100  # the 100 self-referencing objects
