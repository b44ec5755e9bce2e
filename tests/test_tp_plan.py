"""The tensor-parallel sharding plan at the real Qwen3 0.6B-8B shapes and N = 1, 2, 4, 8: what
each rank holds, that the shards partition every split tensor, per-rank bytes (hand-computed for
some), the per-rank cuda memory plan, KV replication, and the typed refusals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from engine.args import EngineArgs
from engine.config import ConfigError, ModelConfig
from engine.executor.cuda_model import kv_bytes_per_page, plan_num_pages, weight_bytes
from engine.executor.cuda_shapes import Padded, check_supported
from engine.model.loader import Checkpoint
from engine.model.spec import expected_tensors
from engine.model.synthetic import hf_config, make_weights
from engine.parallel.plan import (
    VOCAB_PADDING,
    TensorParallelError,
    TensorParallelPlan,
    check_tensor_parallel,
    shard_checkpoint,
    supported_sizes,
)

# The Hugging Face config.json numbers of Qwen/Qwen3-{0.6B,1.7B,4B,8B}:
# (hidden, heads, kv heads, head_dim, intermediate, layers, vocab, tie_word_embeddings)
QWEN3 = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 28, 151936, True),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, 28, 151936, True),
    "qwen3-4b": (2560, 32, 8, 128, 9728, 36, 151936, True),
    "qwen3-8b": (4096, 32, 8, 128, 12288, 36, 151936, False),
}
SIZES = (1, 2, 4, 8)
GIB = 1 << 30


def qwen3(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(preset))


def small(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(hf_config("tiny-qwen3", overrides=overrides))


@pytest.mark.parametrize("preset", QWEN3)
def test_the_presets_are_the_real_qwen3_configs(preset: str) -> None:
    mc = qwen3(preset)
    assert (mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size,
            mc.tie_word_embeddings) == QWEN3[preset]


def _shape(full: tuple[int, ...], s) -> tuple[int, ...]:
    out = list(full)
    out[s.dim] = s.size
    return tuple(out)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("preset", QWEN3)
def test_qwen3_rank_shapes_and_shards(preset: str, n: int) -> None:
    mc = qwen3(preset)
    h, nq, nkv, hd, i, layers, v, tied = QWEN3[preset]
    plan = TensorParallelPlan(mc, n)
    rc = plan.rank_config
    vs = math.ceil(math.ceil(v / n) / VOCAB_PADDING) * VOCAB_PADDING
    assert (rc.num_attention_heads, rc.num_key_value_heads, rc.intermediate_size,
            rc.vocab_size) == (nq // n, nkv // n, i // n, vs)
    assert plan.kv_head_replicas == 1  # nkv = 8 >= every N here
    assert (rc.hidden_size, rc.head_dim, rc.num_hidden_layers, rc.tie_word_embeddings) == (
        h, hd, layers, tied)
    full = expected_tensors(mc)
    mine = expected_tensors(rc)
    covered: dict[str, list[tuple[int, int]]] = {}
    for r in range(n):
        shards = plan.shards(r)
        assert shards.keys() == full.keys()
        for name, s in shards.items():
            # a rank's tensors are exactly those of its own (smaller) model
            assert _shape(full[name].shape, s) == mine[name].shape, (name, r)
            if s.kind == "replicated":
                assert (s.start, s.stop) == (0, full[name].shape[0])
            else:
                covered.setdefault(name, []).append((s.start, s.stop))
        assert all(q // mc.gqa_ratio in plan.kv_heads(r) for q in plan.q_heads(r))  # GQA holds
    for name, ranges in covered.items():  # the ranks' parts partition the tensor, in order
        s0 = plan.shards(0)[name]
        end = full[name].shape[s0.dim]
        assert ranges[0][0] == 0 and ranges[-1][1] == end, name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name
    kinds = {name.rsplit(".", 2)[-2]: s.kind for name, s in plan.shards(0).items()}
    assert kinds["q_proj"] == kinds["k_proj"] == kinds["v_proj"] == kinds["gate_proj"] == \
        kinds["up_proj"] == "column"
    assert kinds["o_proj"] == kinds["down_proj"] == "row"
    assert kinds["embed_tokens"] == "vocab" and kinds["norm"] == "replicated"
    assert kinds["input_layernorm"] == kinds["q_norm"] == "replicated"
    if not tied:
        assert kinds["lm_head"] == "vocab"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("preset", QWEN3)
def test_qwen3_per_rank_bytes(preset: str, n: int) -> None:
    mc = qwen3(preset)
    h, _, _, hd, _, layers, v, tied = QWEN3[preset]
    plan = TensorParallelPlan(mc, n)
    # every rank holds its share, plus a copy of each norm, plus its vocab padding
    replicated = layers * (2 * h + 2 * hd) + h
    padding = (plan.padded_vocab - v) * h * (1 if tied else 2)
    assert n * plan.weight_bytes() == 2 * (mc.num_parameters + (n - 1) * replicated + padding)
    if n == 1:
        assert plan.weight_bytes() == 2 * mc.num_parameters == weight_bytes(mc)
    assert n * plan.kv_bytes_per_token() == mc.kv_bytes_per_token()  # no KV replicated
    # the cuda memory plan runs per rank unchanged, and pads nothing there
    rc = plan.rank_config
    assert Padded.of(rc).is_identity(rc)
    check_supported(rc)
    assert weight_bytes(rc) == plan.weight_bytes()
    assert kv_bytes_per_page(rc, 16) == plan.kv_bytes_per_page(16)
    floor = plan.decode_bytes_read(64, 1024)
    table = 0 if rc.tie_word_embeddings else 2 * rc.hidden_size * (rc.vocab_size - 64)
    assert floor == plan.weight_bytes() - table + 64 * 1024 * plan.kv_bytes_per_token()
    if n == 1:  # the single-GPU floor of tools/bench_decode.py
        from engine.executor.cuda_model import decode_bytes_read

        assert floor == decode_bytes_read(mc, 64, 1024)


def test_hand_computed_bytes() -> None:
    # qwen3-8b, N=2: per layer qkv (16+2*4)*128*4096 + o 4096*2048 + gate_up 2*6144*4096
    # + down 4096*6144 + norms 2*4096+2*128 = 96,477,440 params; x36 layers; embedding and head
    # 75,968 rows each (151936/2, a multiple of 64); the final norm 4096.
    p8 = TensorParallelPlan(qwen3("qwen3-8b"), 2)
    assert p8.vocab_per_rank == 75968
    assert p8.weight_bytes() == 2 * (36 * 96_477_440 + 2 * 75968 * 4096 + 4096) == 8_191_043_584
    assert p8.kv_bytes_per_token() == 2 * 36 * 4 * 128 * 2 == 73_728
    # qwen3-8b, N=8: 4 q heads, 1 KV head, MLP slice 1536; vocab 18992 -> 19008 rows per rank
    p8x8 = TensorParallelPlan(qwen3("qwen3-8b"), 8)
    assert (p8x8.vocab_per_rank, p8x8.padded_vocab) == (19008, 152064)
    per_layer = 6 * 128 * 4096 + 4096 * 512 + 2 * 1536 * 4096 + 4096 * 1536 + 8448
    assert per_layer == 24_125_696
    assert p8x8.weight_bytes() == 2 * (36 * per_layer + 2 * 19008 * 4096 + 4096) == 2_048_485_376
    # untied: of the embedding shard only the 64 gathered rows are read
    assert p8x8.decode_bytes_read(64, 1024) == (2_048_485_376 - 2 * (19008 - 64) * 4096
                                                + 64 * 1024 * 2 * 36 * 1 * 128 * 2)
    # qwen3-0.6b, N=2 (tied: one embedding shard serves as the head)
    p06 = TensorParallelPlan(qwen3("qwen3-0.6b"), 2)
    per_layer = 16 * 128 * 1024 + 1024 * 1024 + 2 * 1536 * 1024 + 1536 * 1024 + 2304
    assert p06.weight_bytes() == 2 * (28 * per_layer + 75968 * 1024 + 1024) == 596_115_456


def test_per_rank_memory_plan_holds_more_kv() -> None:
    mc = qwen3("qwen3-8b")
    ec = EngineArgs(max_model_len=8192).create_engine_config(mc, "cuda")
    total = 141 * GIB
    full, _ = plan_num_pages(mc, ec, free=total - GIB, total=total, workspace=64 << 20)
    rank, arena = plan_num_pages(TensorParallelPlan(mc, 2).rank_config, ec, free=total - GIB,
                                 total=total, workspace=64 << 20)
    # half the KV per page and half the weights: more than twice the pages per rank
    assert rank > 2 * full
    assert arena >= TensorParallelPlan(mc, 2).weight_bytes() + rank * kv_bytes_per_page(
        TensorParallelPlan(mc, 2).rank_config, 16)


def test_kv_heads_replicate_when_ranks_outnumber_them() -> None:
    plan = TensorParallelPlan(qwen3("qwen3-0.6b"), 16)  # 16 q heads, 8 KV heads
    assert (plan.heads_per_rank, plan.kv_heads_per_rank, plan.kv_head_replicas) == (1, 1, 2)
    assert [plan.kv_heads(r).start for r in range(16)] == [r // 2 for r in range(16)]
    for r in range(16):
        assert [q // 2 for q in plan.q_heads(r)] == list(plan.kv_heads(r))
    # each KV head twice over: per-rank KV is 1/8 of the model's, not 1/16
    assert 8 * plan.kv_bytes_per_token() == plan.model.kv_bytes_per_token()
    mqa = TensorParallelPlan(small(num_attention_heads=8, num_key_value_heads=1), 4)
    assert [list(mqa.kv_heads(r)) for r in range(4)] == [[0]] * 4


@pytest.mark.parametrize("mc,n,field,needle", [
    (qwen3("qwen3-0.6b"), 3, "num_attention_heads",
     r"num_attention_heads \(16\) is not divisible by tensor_parallel_size 3.*"
     r"takes: 1, 2, 4, 8, 16$"),
    (qwen3("qwen3-8b"), 64, "num_attention_heads", "num_attention_heads \\(32\\)"),
    (small(num_attention_heads=24, num_key_value_heads=6), 4, "num_key_value_heads",
     r"num_key_value_heads \(6\) is not divisible by tensor_parallel_size 4"),
    (small(num_attention_heads=24, num_key_value_heads=8), 12, "num_key_value_heads",
     "tensor_parallel_size 12 is above num_key_value_heads \\(8\\) but not a multiple"),
    (small(intermediate_size=98), 4, "intermediate_size",
     r"intermediate_size \(98\) is not divisible by tensor_parallel_size 4"),
    (qwen3("qwen3-0.6b"), 0, "tensor_parallel_size", "must be an integer >= 1, got 0"),
    (qwen3("qwen3-0.6b"), "2", "tensor_parallel_size", "must be an integer >= 1, got '2'"),
    (qwen3("qwen3-0.6b"), True, "tensor_parallel_size", "must be an integer >= 1, got True"),
])
def test_refusals_name_the_field(mc: ModelConfig, n, field: str, needle: str) -> None:
    with pytest.raises(TensorParallelError, match=needle) as e:
        check_tensor_parallel(mc, n)
    assert e.value.field == field and isinstance(e.value, ConfigError)
    with pytest.raises(TensorParallelError):
        TensorParallelPlan(mc, n)


def test_supported_sizes() -> None:
    assert supported_sizes(qwen3("qwen3-0.6b")) == [1, 2, 4, 8, 16]
    assert supported_sizes(qwen3("qwen3-8b")) == [1, 2, 4, 8, 16, 32]
    assert supported_sizes(small(num_attention_heads=24, num_key_value_heads=6,
                                 intermediate_size=240)) == [1, 2, 3, 6, 12, 24]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_shard_checkpoint_slices_and_pads(n: int) -> None:
    # vocab 1000 (padded on every N), untied, 8 q heads and 1 KV head (replicated on N > 1)
    mc = ModelConfig.from_dict(hf_config("tiny-llama", overrides={"num_attention_heads": 8}))
    ckpt = Checkpoint(Path("/in-memory"), mc, make_weights(mc, seed=5))
    plan = TensorParallelPlan(mc, n)
    rows = np.zeros(mc.vocab_size, int)
    for r in range(n):
        part = shard_checkpoint(ckpt, plan, r)
        assert part.config == plan.rank_config
        assert {k: a.shape for k, a in part.tensors.items()} == {
            k: s.shape for k, s in expected_tensors(plan.rank_config).items()}
        v0, v1 = plan.vocab_range(r)
        rows[v0:v1] += 1
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            np.testing.assert_array_equal(part[name][:v1 - v0], ckpt[name][v0:v1])
            assert not np.asarray(part[name][v1 - v0:], np.float32).any()  # zero padding
        q = plan.q_heads(r)
        hd = mc.head_dim
        np.testing.assert_array_equal(part.layer(1, "self_attn.q_proj.weight"),
                                      ckpt.layer(1, "self_attn.q_proj.weight")[q.start * hd:
                                                                               q.stop * hd])
        np.testing.assert_array_equal(part.layer(1, "self_attn.o_proj.weight"),
                                      ckpt.layer(1, "self_attn.o_proj.weight")[:, q.start * hd:
                                                                               q.stop * hd])
        np.testing.assert_array_equal(part.layer(0, "self_attn.k_proj.weight"),
                                      ckpt.layer(0, "self_attn.k_proj.weight"))  # 1 KV head
        i = plan.intermediate_per_rank
        np.testing.assert_array_equal(part.layer(0, "mlp.down_proj.weight"),
                                      ckpt.layer(0, "mlp.down_proj.weight")[:, r * i:(r + 1) * i])
        np.testing.assert_array_equal(part.layer(0, "input_layernorm.weight"),
                                      ckpt.layer(0, "input_layernorm.weight"))
    assert (rows == 1).all()  # every token id on exactly one rank
    other = dataclasses.replace(mc, rms_norm_eps=1e-3)
    with pytest.raises(ValueError, match="another model config"):
        shard_checkpoint(ckpt, TensorParallelPlan(other, n), 0)
