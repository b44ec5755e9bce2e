"""EngineArgs: one definition of every engine option (default, help, choices), the command line
built from it, and one resolution into a concrete EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from engine.args import EngineArgs
from engine.commands import generate
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.executor.registry import BACKEND_CHOICES, BACKENDS, resolve_backend
from engine.kv.block_manager import DUPLICATE_POLICIES
from engine.model.synthetic import hf_config

MC = ModelConfig.from_dict(hf_config("tiny-qwen3"))


def parser(exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, exclude=exclude)
    return p


def cli_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(parser().parse_args(list(argv)))


def test_every_option_has_help_and_every_config_field_an_option() -> None:
    for f in dataclasses.fields(EngineArgs):
        assert len(f.metadata.get("help", "")) > 20, f"{f.name} has no help"
    assert ([f.name for f in dataclasses.fields(EngineArgs)]
            == [f.name for f in dataclasses.fields(EngineConfig)])


def test_cli_round_trip_equals_the_kwargs_path() -> None:
    argv = ["--model", "/m", "--backend", "numpy", "--max-model-len", "256",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
            "--long-prefill-token-threshold", "64", "--mixed-prefill-tokens", "32",
            "--block-size", "32",
            "--no-enable-prefix-caching", "--num-gpu-blocks-override", "99",
            "--gpu-memory-utilization", "0.5", "--enforce-eager", "--no-enable-chunked-prefill",
            "--seed", "7", "--cuda-graph-max-bs", "4"]
    kw = dict(model="/m", backend="numpy", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=512, long_prefill_token_threshold=64,
              mixed_prefill_tokens=32, block_size=32,
              enable_prefix_caching=False, num_gpu_blocks_override=99,
              gpu_memory_utilization=0.5, enforce_eager=True, enable_chunked_prefill=False,
              seed=7, cuda_graph_max_bs=4)
    args = cli_args(*argv)
    assert args == EngineArgs.from_kwargs(**kw)
    assert args.create_engine_config(MC) == EngineArgs.from_kwargs(**kw).create_engine_config(MC)
    assert dataclasses.asdict(args.create_engine_config(MC)) == {
        **dataclasses.asdict(EngineArgs()), **kw, "mixed_step_tokens": 0}  # numpy's default
    cuda = dataclasses.replace(args, backend="cuda").create_engine_config(MC, "cuda")
    assert cuda.mixed_step_tokens == 128
    assert dataclasses.replace(args, backend="cuda", mixed_step_tokens=0).create_engine_config(
        MC, "cuda").mixed_step_tokens == 0


def test_cli_defaults_are_the_engine_args_defaults() -> None:
    assert cli_args() == EngineArgs()
    p = parser()
    for f in dataclasses.fields(EngineArgs):
        if f.metadata["cli"]:
            assert p.get_default(f.name) == f.default, f.name
    # today's flags and defaults (generate and serve)
    ns = parser().parse_args([])
    assert (ns.model, ns.backend, ns.max_num_seqs, ns.max_num_batched_tokens, ns.block_size,
            ns.seed, ns.gpu_memory_utilization, ns.enforce_eager,
            ns.enable_prefix_caching) == ("", "auto", 256, 2048, 16, 0, 0.9, False, True)
    assert ns.max_model_len is None and ns.long_prefill_token_threshold is None
    assert ns.num_gpu_blocks_override is None
    g = argparse.ArgumentParser()
    generate.add_arguments(g)
    assert EngineArgs.from_cli_args(g.parse_args(["hi"])) == EngineArgs()


def test_cli_choices_come_from_the_registry() -> None:
    p = parser()
    backend = next(a for a in p._actions if a.dest == "backend")
    assert tuple(backend.choices) == BACKEND_CHOICES == ("auto", *BACKENDS)
    with pytest.raises(SystemExit):
        p.parse_args(["--backend", "tpu"])
    assert cli_args("--max-num-seqs", "3").max_num_seqs == 3


def test_internal_options_and_excluded_ones_stay_off_the_cli() -> None:
    dests = {a.dest for a in parser(exclude=("model",))._actions}
    assert "model" not in dests and "max_num_seqs" in dests
    for name in ("duplicate_policy", "cpu_kv_pages", "lazy_graph_capture",
                 "prompt_logprobs_prefix_cache"):
        assert name not in dests
    with pytest.raises(ValueError, match="max_num_seq"):
        parser(exclude=("max_num_seq",))


def test_unknown_option_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown engine option") as e:
        EngineArgs.from_kwargs(max_num_seq=4)
    assert "'max_num_seq'" in str(e.value) and "'max_num_seqs'" in str(e.value)


def test_create_engine_config_is_concrete() -> None:
    for backend, lp in (("numpy", 256), ("cuda", 0)):
        ec = EngineArgs().create_engine_config(MC, backend)
        assert ec.backend == backend and ec.long_prefill_token_threshold == lp
        assert ec.max_model_len == MC.max_position_embeddings
        assert ec.max_pages_per_seq == -(-MC.max_position_embeddings // 16)
    auto = EngineArgs().create_engine_config(MC)
    assert auto.backend == resolve_backend("auto") and auto.backend in BACKENDS
    hints = typing.get_type_hints(EngineConfig)
    for name in ("model", "backend", "max_model_len", "long_prefill_token_threshold"):
        assert type(None) not in typing.get_args(hints[name]), name
    with pytest.raises(TypeError):
        EngineConfig()  # type: ignore[call-arg]  # no defaults: only create_engine_config builds it
    ec = EngineArgs(long_prefill_token_threshold=0).create_engine_config(MC, "numpy")
    assert ec.long_prefill_token_threshold == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ec.max_model_len = 1  # type: ignore[misc]


@pytest.mark.parametrize("change,needle", [
    (dict(backend="tpu"), "backend 'tpu': use one of auto, numpy, cuda"),
    (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0"),
    (dict(block_size=12), "block_size must be a power of two, got 12"),
    (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override must be >= 2"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be in"),
    (dict(duplicate_policy="keep"), "duplicate_policy 'keep': use 'allow' or 'reject'"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(cuda_graph_max_bs=0), "cuda_graph_max_bs must be >= 1"),
    (dict(max_model_len=MC.max_position_embeddings + 1), "max_position_embeddings"),
    (dict(max_num_seqs="4"), "max_num_seqs must be an integer, got '4'"),
    (dict(enforce_eager="false"), "enforce_eager must be True or False, got 'false'"),
    (dict(max_model_len=True), "max_model_len must be an integer or None, got True"),
    (dict(model=None), "model must be a string, got None"),
])
def test_create_engine_config_checks_every_option(change: dict, needle: str) -> None:
    args = EngineArgs.from_kwargs(**change)  # nothing is checked before resolution
    with pytest.raises(ConfigError, match=needle):
        args.create_engine_config(MC, "numpy" if "backend" not in change else None)


def test_chosen_backend_must_agree_with_the_options() -> None:
    assert EngineArgs(backend="numpy").create_engine_config(MC, "numpy").backend == "numpy"
    with pytest.raises(ConfigError, match="backend 'cuda' was chosen"):
        EngineArgs(backend="numpy").create_engine_config(MC, "cuda")
    with pytest.raises(ConfigError, match="backend 'auto': use one of numpy, cuda"):
        EngineArgs().create_engine_config(MC, "auto")


def test_duplicate_policies_are_defined_once() -> None:
    import engine.args
    import engine.config

    assert not hasattr(engine.config, "DUPLICATE_POLICIES")
    assert engine.args.DUPLICATE_POLICIES is DUPLICATE_POLICIES
    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == "duplicate_policy")
    assert field.metadata["choices"] is DUPLICATE_POLICIES
