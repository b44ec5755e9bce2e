"""The CUDA memory plan (pure arithmetic: runs without a GPU)."""

from __future__ import annotations

import pytest

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.cuda.driver import CudaError
from engine.executor.cuda_model import Sizes, kv_bytes_per_page, plan_num_pages, weight_bytes
from engine.model.synthetic import hf_config

GIB = 1 << 30


def test_sizes_by_reference():
    mc = ModelConfig.from_dict(hf_config("qwen3-0.6b"))
    ec = EngineArgs(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048
                    ).create_engine_config(mc, "cuda")
    s = Sizes.of(mc, ec)
    # the page-index buffer: max batch x ceil(max_model_len / page_size), never the pool
    assert (s.b_max, s.pages_per_seq) == (256, 256)
    assert s.t_max == 2048 and s.logit_rows == 256


def test_plan_uses_utilization_and_override():
    mc = ModelConfig.from_dict(hf_config("qwen3-8b"))
    ec = EngineArgs(max_model_len=8192, gpu_memory_utilization=0.9).create_engine_config(
        mc, "cuda")
    total = 141 * GIB
    n, arena = plan_num_pages(mc, ec, free=total - GIB, total=total, workspace=64 << 20)
    per = kv_bytes_per_page(mc, 16)
    assert per == 2 * 36 * 8 * 16 * 128 * 2
    assert weight_bytes(mc) + n * per < 0.9 * total - GIB
    assert n > 100_000 * 0.5  # ~110 GiB of KV at 2.25 MiB per page
    assert arena >= n * per + weight_bytes(mc)
    n2, _ = plan_num_pages(mc, EngineArgs(max_model_len=8192, num_gpu_blocks_override=1000)
                           .create_engine_config(mc, "cuda"), free=total, total=total,
                           workspace=0)
    assert n2 == 1000


def test_plan_refuses_when_nothing_fits():
    mc = ModelConfig.from_dict(hf_config("qwen3-8b"))
    ec = EngineArgs(max_model_len=8192, gpu_memory_utilization=0.1).create_engine_config(
        mc, "cuda")
    with pytest.raises(CudaError, match="no room for the KV cache"):
        plan_num_pages(mc, ec, free=141 * GIB, total=141 * GIB, workspace=0)


class _FakeBuf:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.ptr = 0

    def upload(self, *a, **k):
        pass

    def fill_bytes(self, *a, **k):
        pass


class _FakeArena:
    """The real Arena's arithmetic (alignment, capacity) with no device memory."""

    def __init__(self, capacity):
        from engine.cuda.driver import Arena

        self.capacity, self.used, self.align = capacity, 0, Arena.ALIGN

    def alloc(self, shape, dtype, name=""):
        import numpy as np

        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        off = -(-self.used // self.align) * self.align
        if off + n > self.capacity:
            raise CudaError(f"arena out of memory allocating {name}")
        self.used = off + n
        return _FakeBuf(n)


class _FakeStream:
    def synchronize(self):
        pass


@pytest.mark.parametrize("preset,opts", [
    ("tiny-qwen3", dict(num_gpu_blocks_override=256, max_num_seqs=16,
                        max_num_batched_tokens=512)),
    ("small-llama", dict(num_gpu_blocks_override=40, max_num_seqs=4, max_num_batched_tokens=64)),
    ("qwen3-0.6b", dict(max_model_len=4096, max_num_seqs=256)),
])
def test_planned_arena_holds_every_allocation(preset, opts):
    """Everything the executor allocates fits the planned arena (weights, buffers, KV)."""
    from engine.executor.cuda_model import DeviceWeights, StepBuffers
    from engine.model.loader import Checkpoint
    from engine.model.synthetic import make_weights

    mc = ModelConfig.from_dict(hf_config(preset))
    ec = EngineArgs(**opts).create_engine_config(mc, "cuda")
    ws = 64 << 20
    n, arena_bytes = plan_num_pages(mc, ec, free=100 * GIB, total=141 * GIB, workspace=ws)
    arena = _FakeArena(arena_bytes)
    if mc.num_parameters < 50_000_000:
        ckpt = Checkpoint(None, mc, make_weights(mc, 0))
        DeviceWeights(ckpt, arena, _FakeStream(), show=False)
    else:  # same sizes, no need to build 1 GB of random weights
        arena.alloc(weight_bytes(mc) // 2, "u2", "weights")
    StepBuffers(mc, Sizes.of(mc, ec), arena, ws, _FakeStream())
    for _ in range(2 * mc.num_hidden_layers):
        arena.alloc((n, mc.num_key_value_heads, 16, mc.head_dim), "u2", "kv")
