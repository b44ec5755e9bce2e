"""The tensor_parallel_size option: vLLM's name, default 1, on the command line; checked (typed,
naming the field) against the model; numpy above 1 builds the simulation; cuda above 1 is
refused until the multi-GPU worker exists."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.args import EngineArgs
from engine.config import ConfigError, ModelConfig
from engine.executor.numpy_executor import NumpyExecutor
from engine.executor.registry import create_executor
from engine.model.loader import Checkpoint
from engine.model.synthetic import hf_config, make_weights
from engine.parallel.plan import TensorParallelError
from engine.parallel.sim import TensorParallelNumpyExecutor

MC = ModelConfig.from_dict(hf_config("tiny-qwen3"))  # 4 q heads, 2 KV heads


def test_default_and_command_line() -> None:
    assert EngineArgs().tensor_parallel_size == 1
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(["--tensor-parallel-size", "2"]))
    assert args == EngineArgs(tensor_parallel_size=2)
    assert args.create_engine_config(MC, "numpy").tensor_parallel_size == 2
    assert EngineArgs().create_engine_config(MC, "cuda").tensor_parallel_size == 1


@pytest.mark.parametrize("tp,backend,error,needle", [
    (0, "numpy", ConfigError, "tensor_parallel_size must be >= 1, got 0"),
    ("2", "numpy", ConfigError, "tensor_parallel_size must be an integer, got '2'"),
    (3, "numpy", TensorParallelError, r"num_attention_heads \(4\) is not divisible by "
     r"tensor_parallel_size 3.*takes: 1, 2, 4$"),
    (2, "cuda", ConfigError, "tensor_parallel_size 2: the cuda backend's multi-GPU worker "
     r"\(one process per GPU, NCCL all-reduce\) is not built yet"),
])
def test_refusals(tp, backend: str, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        EngineArgs(tensor_parallel_size=tp).create_engine_config(MC, backend)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_numpy_backend_builds_the_simulation(tp: int) -> None:
    ckpt = Checkpoint(Path("/in-memory"), MC, make_weights(MC, seed=0))
    config = EngineArgs(tensor_parallel_size=tp, max_model_len=256,
                        max_num_seqs=4).create_engine_config(MC, "numpy")
    ex, n = create_executor("numpy", ckpt, config)
    if tp == 1:
        assert type(ex) is NumpyExecutor
    else:
        assert isinstance(ex, TensorParallelNumpyExecutor) and ex.world_size == tp
        assert all(w.local.num_pages == n for w in ex.workers)  # one page id space
    assert ex.num_pages == n
