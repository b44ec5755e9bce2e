"""Default sampling parameters from generation_config.json, as vLLM applies them
(``--generation-config auto``, the default): fields a request leaves unset take the model's
values, fields it sets (even to the built-in value) are its own; ``--generation-config vllm``
ignores the file. Every front end goes through the input processor, where they are applied."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from engine import sampling_params
from engine.args import EngineArgs
from engine.commands import generate
from engine.config import ConfigError, ModelConfig
from engine.engine import LLMEngine
from engine.model.synthetic import hf_config, write_checkpoint
from engine.sampling_params import BUILTIN_DEFAULTS, SamplingParams
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

QWEN3_GEN = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
             "top_p": 0.95, "top_k": 20}  # what Qwen3 ships (do_sample is ignored, as vLLM)
QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def checkpoint(tmp_path: Path, gen: dict) -> Path:
    d = write_checkpoint(tmp_path / "m", "tiny-qwen3", quiet=True)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def engine(d: Path, **options: object) -> LLMEngine:
    return LLMEngine(EngineArgs.from_kwargs(model=str(d), backend="numpy", max_model_len=64,
                                            **options))


def sampling(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in BUILTIN_DEFAULTS}


def test_unset_is_not_the_same_as_the_builtin_value() -> None:
    p = SamplingParams(max_tokens=4)
    assert sampling(p) == BUILTIN_DEFAULTS and p.unset == set(BUILTIN_DEFAULTS)
    assert p == SamplingParams(max_tokens=4, temperature=1.0)  # same values...
    explicit = SamplingParams(temperature=1.0, top_k=0)  # ...but set by the caller
    assert explicit.unset == {"top_p", "min_p"}
    assert SamplingParams(temperature=None, top_p=None).unset == set(BUILTIN_DEFAULTS)
    d = explicit.with_defaults(QWEN3_DEFAULTS)
    assert sampling(d) == {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "min_p": 0.0}
    assert d.unset == {"min_p"}
    assert sampling(p.with_defaults(QWEN3_DEFAULTS)) == {**QWEN3_DEFAULTS, "min_p": 0.0}
    assert p.with_defaults({}) is p


def test_model_defaults_parse_and_vllm_mode_drops_them() -> None:
    m = ModelConfig.from_dict(hf_config("tiny-qwen3"), QWEN3_GEN)
    assert m.sampling_defaults() == m.sampling_defaults("auto") == QWEN3_DEFAULTS
    assert m.sampling_defaults("vllm") == {}
    assert ModelConfig.from_dict(hf_config("tiny-qwen3"), {"eos_token_id": 2}) \
        .sampling_defaults() == {}
    with pytest.raises(ConfigError, match=r"generation_config\.json: temperature must be a "
                       r"number, got '0\.6'"):
        ModelConfig.from_dict(hf_config("tiny-qwen3"), {"temperature": "0.6"})


def test_unsupported_defaults_warn_once_and_are_ignored(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_params, "_warned", set())  # once per process: start afresh
    gen = {**QWEN3_GEN, "repetition_penalty": 1.05, "max_new_tokens": 77}
    m = ModelConfig.from_dict(hf_config("tiny-qwen3"), gen)
    with caplog.at_level(logging.INFO, logger="engine.sampling_params"):
        assert m.sampling_defaults() == QWEN3_DEFAULTS
        assert m.sampling_defaults() == QWEN3_DEFAULTS
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned  # once each, however often the defaults are resolved
    assert any("repetition_penalty=1.05" in w and "ignored" in w for w in warned)
    assert any("max_new_tokens=77" in w for w in warned)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 1 and "temperature=0.6, top_p=0.95, top_k=20" in info[0]
    neutral = ModelConfig.from_dict(hf_config("tiny-qwen3"), {"repetition_penalty": 1.0})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.sampling_params"):
        assert neutral.sampling_defaults() == {}
    assert not caplog.records


def test_a_default_no_request_could_have_is_refused_at_start(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, {"top_p": 0.0})
    with pytest.raises(ConfigError, match=r"generation_config\.json: top_p: must be in \(0, "
                       r"1\], got 0\.0; fix the file or pass --generation-config vllm"):
        engine(d)
    assert engine(d, generation_config="vllm").input_processor.sampling_defaults == {}
    with pytest.raises(ConfigError, match="generation_config 'hf': use 'auto' or 'vllm'"):
        engine(d, generation_config="hf")


def test_the_engine_applies_defaults_to_unset_fields_only(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, QWEN3_GEN)
    eng = engine(d)  # --generation-config auto, the default
    assert eng.input_processor.sampling_defaults == QWEN3_DEFAULTS
    got = eng.add_request([5, 6, 7], SamplingParams(max_tokens=2)).params
    assert sampling(got) == {**QWEN3_DEFAULTS, "min_p": 0.0}
    assert sampling(eng.add_request([5, 6, 7]).params) == {**QWEN3_DEFAULTS, "min_p": 0.0}
    # a request that sets a field keeps it, even at the built-in value
    own = eng.add_request([5, 6], SamplingParams(temperature=1.0, top_k=0, min_p=0.1)).params
    assert sampling(own) == {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "min_p": 0.1}
    greedy = eng.add_request([5], SamplingParams(temperature=0)).params
    assert greedy.greedy and greedy.top_k == 20
    # --generation-config vllm: the file is ignored, the built-in defaults apply
    builtin = engine(d, generation_config="vllm").add_request([5], SamplingParams()).params
    assert sampling(builtin) == BUILTIN_DEFAULTS


def test_server_requests_leave_absent_fields_unset() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    p = ChatCompletionRequest(messages=msgs).sampling_params(None, None, 1000)
    assert p.unset == set(BUILTIN_DEFAULTS)
    body = {"messages": msgs, "temperature": 1.0, "top_k": 5, "min_p": None}
    p = ChatCompletionRequest(**body).sampling_params(None, None, 1000)
    assert p.unset == {"top_p", "min_p"} and (p.temperature, p.top_k) == (1.0, 5)
    p = CompletionRequest(prompt="x", top_k=5000).sampling_params(16, None, 1000)
    assert p.top_k == 0 and "top_k" not in p.unset  # top_k >= vocab: off, and the request's
    # repetition_penalty is ignored only as a model default, never in a request
    rp = CompletionRequest(prompt="x", repetition_penalty=1.1)
    rp.check_supported()
    assert rp.sampling_params(16, None, 1000).repetition_penalty == 1.1


def test_cli_flags() -> None:
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    a = p.parse_args(["hi"])
    assert a.generation_config == "auto" and (a.temperature, a.top_p, a.top_k) == (None,) * 3
    a = p.parse_args(["hi", "--generation-config", "vllm", "--temperature", "0.7"])
    assert EngineArgs.from_cli_args(a).generation_config == "vllm" and a.temperature == 0.7
    with pytest.raises(SystemExit):
        p.parse_args(["hi", "--generation-config", "hf"])
