"""The engine under hostile or unlucky use (issue 11's findings, embedded API, numpy backend):
Ctrl-C mid-generate, a request whose output cannot be processed, a KV pool too small for
max_model_len, sampling values that underflow in float32, unbounded stop strings, invalid text,
and one long prompt that must not hold a short one back."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.engine import RequestError
from engine.model.synthetic import write_checkpoint
from engine.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParamsError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "tiny-qwen3", seed=3,
                            quiet=True)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    outs = LLM(str(tiny_dir), backend="numpy").generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _assert_engine_empty(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests, f"requests left in the engine: {list(eng.requests)}"
    assert not eng.has_unfinished()
    assert eng.block_manager.num_in_use == 0


def test_ctrl_c_during_generate_leaves_no_request_running(tiny_dir: Path,
                                                          reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_dir), backend="numpy")
    execute = llm.engine.executor.execute
    calls = {"n": 0}

    def interrupted(batch):  # the user presses Ctrl-C during the third step
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return execute(batch)

    llm.engine.executor.execute = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    _assert_engine_empty(llm)
    llm.engine.executor.execute = execute  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, GREEDY)  # the engine serves on, with the same results
    assert [o.outputs[0].token_ids for o in outs] == reference
    _assert_engine_empty(llm)


def test_output_processing_error_fails_that_request_only(tiny_dir: Path,
                                                         reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_dir), backend="numpy")
    bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    bad.stop_token_ids = None  # type: ignore[assignment]  # broken after construction
    outs = llm.generate(PROMPTS, [GREEDY, bad, GREEDY])
    assert outs[1].outputs[0].finish_reason == "error"
    assert "TypeError" in (outs[1].outputs[0].error or "")
    for i in (0, 2):
        assert outs[i].outputs[0].finish_reason == "length"
        assert outs[i].outputs[0].token_ids == reference[i]
    _assert_engine_empty(llm)
    later = llm.generate(PROMPTS, GREEDY)  # later calls are unaffected
    assert [o.outputs[0].token_ids for o in later] == reference


def test_kv_pool_smaller_than_max_model_len_is_refused_at_start_up(tiny_dir: Path) -> None:
    # 10 pages, one the padding page: 9 x 16 = 144 tokens of KV for a max_model_len of 256
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_dir), backend="numpy", max_model_len=256, num_gpu_blocks_override=10)
    msg = str(e.value)
    assert "144 tokens" in msg and "max_model_len 256" in msg
    assert "num_gpu_blocks_override >= 17" in msg
    # exactly enough is accepted, and a request of max_model_len runs to the end
    llm = LLM(str(tiny_dir), backend="numpy", max_model_len=144, num_gpu_blocks_override=10)
    out = llm.generate([[5] * 100], SamplingParams(temperature=0, max_tokens=500,
                                                  ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 44


@pytest.mark.parametrize("params", [
    dict(temperature=1e-40), dict(temperature=1e-6), dict(temperature=1.0, top_p=1e-300),
    dict(temperature=0.7, top_p=1e-40),
])
def test_sampling_values_that_underflow_in_float32_mean_the_top_token(
        tiny_dir: Path, reference: list[list[int]], params: dict) -> None:
    """vLLM's rules: temperature below 1e-5 is greedy; a top_p that would keep no token keeps
    the top one. Before, both became 0 / inf in float32 and produced token 0 forever."""
    llm = LLM(str(tiny_dir), backend="numpy")
    sp = SamplingParams(max_tokens=12, ignore_eos=True, seed=1, **params)
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_stop_strings_are_bounded() -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert e.value.field == "stop" and str(MAX_STOP_STRINGS) in str(e.value)
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop=["y" * (MAX_STOP_STRING_LEN + 1)])
    assert e.value.field == "stop" and str(MAX_STOP_STRING_LEN) in str(e.value)
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["y" * MAX_STOP_STRING_LEN])
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop_token_ids=list(range(2_000_000)))
    assert e.value.field == "stop_token_ids"


def test_lone_surrogate_in_a_text_prompt_is_a_request_error(tmp_path: Path) -> None:
    from engine.server.testing import write_test_checkpoint

    llm = LLM(str(write_test_checkpoint(tmp_path / "chat", "chat")), backend="numpy",
              max_model_len=256)
    for prompt in ("\ud800", "ok \udfff then"):
        with pytest.raises(RequestError, match="not valid text"):
            llm.generate(prompt, GREEDY)
    _assert_engine_empty(llm)
    assert llm.generate("fine", GREEDY)[0].outputs[0].finish_reason == "length"


def test_long_prompt_does_not_hold_back_a_short_one(tiny_dir: Path) -> None:
    """Chunked prefill caps one request's chunk (long_prefill_token_threshold, 256 by default on
    numpy): a short request that arrives during a 3,000-token prefill is admitted at once and
    gets its first token in the next step, not after the whole prefill (counted in steps)."""
    llm = LLM(str(tiny_dir), backend="numpy", max_num_batched_tokens=512)
    eng = llm.engine
    assert eng.config.long_prefill_token_threshold == 256
    long_req = eng.add_request([7 + i % 900 for i in range(3000)],
                               SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    short = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    eng.step()
    assert len(short.output_token_ids) == 1, "the short request waited behind the long prefill"
    assert long_req.num_computed_tokens == 512
    while eng.has_unfinished():
        eng.step()
    assert long_req.finish_reason == "length" and short.finish_reason == "length"


def test_prefill_beside_running_decodes_is_capped(tiny_dir: Path, reference: list[list[int]]
                                                  ) -> None:
    """mixed_prefill_tokens: while a request decodes, a step adds at most that many prompt
    tokens (new admissions and running chunks together), so the decoding stream keeps getting
    a token every step; alone, a prompt takes the whole budget. Greedy outputs are unchanged."""
    llm = LLM(str(tiny_dir), backend="numpy", max_num_batched_tokens=512,
              long_prefill_token_threshold=0, mixed_prefill_tokens=48)
    eng = llm.engine
    assert eng.config.mixed_prefill_tokens == 48
    first = eng.add_request(PROMPTS[0], GREEDY)
    eng.step()  # alone: its whole prompt in one step
    assert len(first.output_token_ids) == 1
    longs = [eng.add_request([7 + (i * j) % 90 for i in range(100)],  # no shared prefix
                             SamplingParams(temperature=0, max_tokens=2)) for j in (1, 3)]
    for k in range(1, 5):
        before = [min(r.num_computed_tokens, 100) for r in longs]  # prompt tokens computed
        eng.step()
        assert len(first.output_token_ids) == 1 + k, "the decoding stream missed a step"
        added = sum(min(r.num_computed_tokens, 100) - b for r, b in zip(longs, before, strict=True))
        assert 0 < added <= 48
    while eng.has_unfinished():
        eng.step()
    assert first.output_token_ids == reference[0]
    assert all(r.finish_reason == "length" for r in longs)
    out = LLM(str(tiny_dir), backend="numpy", mixed_prefill_tokens=8).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == reference


def test_steps_beside_decodes_hold_mixed_step_tokens(tiny_dir: Path,
                                                     reference: list[list[int]]) -> None:
    """mixed_step_tokens T: while requests decode, a step's prompt tokens are T less its
    decode rows, at least T / 4 (cuda, T = 128: the step fits the largest mixed-step graph);
    alone, a prompt takes the whole budget. Off by default. Greedy outputs are unchanged."""
    llm = LLM(str(tiny_dir), backend="numpy", max_num_batched_tokens=512,
              long_prefill_token_threshold=0, mixed_step_tokens=40)
    eng = llm.engine
    firsts = [eng.add_request(p, GREEDY) for p in PROMPTS[:3]]
    eng.step()  # alone: the prompts in one step
    assert all(len(f.output_token_ids) == 1 for f in firsts)
    longs = [eng.add_request([7 + (i * j) % 90 for i in range(100)],
                             SamplingParams(temperature=0, max_tokens=2)) for j in (1, 3)]
    for k in range(1, 4):
        before = [min(r.num_computed_tokens, 100) for r in longs]
        decoding = sum(1 for f in firsts if not f.is_finished)
        eng.step()
        added = sum(min(r.num_computed_tokens, 100) - b for r, b in zip(longs, before, strict=True))
        assert 0 < added <= max(40 - decoding, 10), (k, added, decoding)
        assert all(f.is_finished or len(f.output_token_ids) == 1 + k for f in firsts)
    while eng.has_unfinished():
        eng.step()
    assert [f.output_token_ids for f in firsts] == reference[:3]
    # a quarter of T at least, beside more decodes than T
    out = LLM(str(tiny_dir), backend="numpy", mixed_step_tokens=2).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == reference
    assert LLM(str(tiny_dir), backend="numpy").engine.config.mixed_step_tokens == 0  # off
    assert eng.config.mixed_step_tokens == 40
