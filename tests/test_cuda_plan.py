"""The CUDA memory plan and the padding of odd widths (pure arithmetic and numpy: runs without a
GPU; one test compiles an odd checkpoint's kernels for sm_90a on the CPU)."""

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
    # ~110 GiB of KV at 2.25 MiB per page (less the logits processors' ~170 MiB of slots)
    assert n > 100_000 * 0.49
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


def _serial():
    """DeviceWeights' uploader for buffers that are not device memory."""
    from engine.executor.weight_upload import SerialUploader

    return SerialUploader(_FakeStream())


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
        DeviceWeights(ckpt, arena, _FakeStream(), show=False, uploader=_serial())
    else:  # same sizes, no need to build 1 GB of random weights
        arena.alloc(weight_bytes(mc) // 2, "u2", "weights")
    StepBuffers(mc, Sizes.of(mc, ec), arena, ws, _FakeStream())
    for _ in range(2 * mc.num_hidden_layers):
        arena.alloc((n, mc.num_key_value_heads, 16, mc.head_dim), "u2", "kv")


# ---- odd shapes: widths padded to the GEMM tiles, exactly (cuda_shapes.Padded) ------------------

# The small shape of the golden Qwen3 cases (tests/goldens_cases.py)
_QW = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
       "num_key_value_heads": 4}
ODD = {  # name -> (preset, overrides): each a legal checkpoint the numpy backend runs
    "vocab-32001-tied": ("tiny-qwen3", {**_QW, "vocab_size": 32001}),
    "inter-416": ("tiny-llama", {"intermediate_size": 416}),
    "hidden-300": ("tiny-qwen3", {**_QW, "hidden_size": 300}),
    # everything at once, untied; 1999 and 420 are not even multiples of 8 (nor is 300)
    "all-odd-untied": ("tiny-llama", {"hidden_size": 300, "head_dim": 64,
                                      "intermediate_size": 420, "vocab_size": 1999}),
}


def _odd_config(name: str) -> ModelConfig:
    preset, ov = ODD[name]
    return ModelConfig.from_dict(hf_config(preset, overrides=ov))


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                                    "tiny-qwen3", "tiny-llama", "small-qwen3", "small-llama"])
def test_aligned_models_pad_nothing(preset):
    """The fast path stays as it is: the same widths, weight bytes and buffers."""
    from engine.executor.cuda_shapes import Padded

    mc = ModelConfig.from_dict(hf_config(preset))
    p = Padded.of(mc)
    assert p.is_identity(mc), p
    assert weight_bytes(mc) == 2 * mc.num_parameters


@pytest.mark.parametrize("vocab,inter,hidden,want", [
    (32001, 416, 300, (320, 448, 32008)),
    (128257, 3072, 1024, (1024, 3072, 128264)),
    (1999, 420, 200, (256, 448, 2000)),
    (151936, 12288, 4096, (4096, 12288, 151936)),
])
def test_padded_widths(vocab, inter, hidden, want):
    from engine.executor.cuda_shapes import GEMM_K, GEMM_N, Padded

    mc = ModelConfig.from_dict(hf_config("tiny-qwen3", overrides={
        "vocab_size": vocab, "intermediate_size": inter, "hidden_size": hidden}))
    p = Padded.of(mc)
    assert (p.hidden, p.intermediate, p.vocab) == want
    # every GEMM of the forward: (N, K) as Kernels.compile asks for them
    for n, k in [(mc.qkv_size, p.hidden), (p.hidden, mc.q_size), (2 * p.intermediate, p.hidden),
                 (p.hidden, p.intermediate), (p.vocab, p.hidden)]:
        assert n % GEMM_N == 0 and k % GEMM_K == 0, (n, k)


def test_unsupported_heads_are_refused_up_front():
    from engine.config import ConfigError
    from engine.executor.cuda_shapes import check_supported

    for name in ODD:  # odd widths are not refused
        check_supported(_odd_config(name))
    with pytest.raises(ConfigError, match=r"head_dim=96: .*64 or 128.*--backend numpy"):
        check_supported(ModelConfig.from_dict(hf_config("tiny-qwen3", overrides={
            "head_dim": 96})))
    with pytest.raises(ConfigError, match=r"= 16: .*at most 8 query heads per KV head"):
        check_supported(ModelConfig.from_dict(hf_config("tiny-qwen3", overrides={
            "num_attention_heads": 16, "num_key_value_heads": 1})))
    with pytest.raises(ConfigError, match=r"block_size=32: .*block_size=16"):
        check_supported(ModelConfig.from_dict(hf_config("tiny-qwen3")), 32)


class _RecordingArena(_FakeArena):
    """Keeps what is uploaded into each buffer (the host arrays DeviceWeights pads)."""

    def alloc(self, shape, dtype, name=""):
        buf = super().alloc(shape, dtype, name)
        buf.shape, buf.name = ((shape,) if isinstance(shape, int) else tuple(shape)), name

        def upload(a, *args, **kwargs):
            assert a.shape == buf.shape, (name, a.shape, buf.shape)
            buf.host = a.astype("float32")

        buf.upload = upload
        return buf


def _norm(x, w, eps, size):
    """RMSNorm as the kernel computes it over padded rows: the mean's divisor is ``size``."""
    import numpy as np

    var = np.sum(np.square(x), axis=-1, keepdims=True, dtype=np.float32) / np.float32(size)
    return (w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))).astype(np.float32)


def _padded_forward(w, mc, ids):
    """The cuda forward's math in float32 over the padded device weights ``w``
    (DeviceWeights, norms folded into qkv and gate_up, gate_up in 32-row gate / up blocks):
    logits [T, padded vocab]. The fused layer's form: the GEMM of the raw residual, times
    each row's rstd. Checks that the padding columns of the residual stream and of the MLP
    activation stay exactly zero."""
    import numpy as np

    from engine.executor.cuda_shapes import Padded
    from engine.model.reference import apply_rope, attention, rms_norm, rope_cos_sin, silu

    p, eps, hd = Padded.of(mc), mc.rms_norm_eps, mc.head_dim
    f = np.float32
    pos = np.arange(len(ids))
    cos, sin = rope_cos_sin(pos, hd, mc.rope_theta, mc.rope_scaling)
    x = w.embed.host[ids]
    for lw in w.layers:
        lw = {k: b.host for k, b in lw.items()}
        assert not x[:, mc.hidden_size:].any(), "residual padding columns are not zero"
        ones = np.ones(x.shape[1], f)
        qkv = np.matmul(_norm(x, ones, eps, mc.hidden_size), lw["qkv"].T, dtype=f)
        t = len(ids)
        q = qkv[:, :mc.q_size].reshape(t, mc.num_attention_heads, hd)
        k = qkv[:, mc.q_size:mc.q_size + mc.kv_size].reshape(t, mc.num_key_value_heads, hd)
        v = qkv[:, mc.q_size + mc.kv_size:].reshape(t, mc.num_key_value_heads, hd)
        if mc.qk_norm:
            q, k = rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
        a = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, pos, hd ** -0.5)
        x = x + np.matmul(a.reshape(t, -1), lw["o"].T, dtype=f)
        gu = np.matmul(_norm(x, ones, eps, mc.hidden_size), lw["gate_up"].T, dtype=f)
        gu = gu.reshape(t, p.intermediate // 32, 2, 32)
        act = (silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(t, p.intermediate)
        assert not act[:, mc.intermediate_size:].any(), "MLP padding columns are not zero"
        x = (x + np.matmul(act, lw["down"].T, dtype=f)).astype(f)
    assert not x[:, mc.hidden_size:].any()
    return np.matmul(_norm(x, w.norm.host, eps, mc.hidden_size), w.lm_head.host.T, dtype=f)


@pytest.mark.parametrize("name", list(ODD))
def test_padded_weights_compute_the_reference_forward(name):
    """The padded weights DeviceWeights uploads, run through the kernels' math (norm divisor =
    the real width), give engine/model/reference.py's logits on the real vocabulary; the
    padding logits are exactly 0 and never reach the sampler (it reads [0, vocab_size))."""
    import numpy as np

    from engine.executor.cuda_model import DeviceWeights
    from engine.executor.cuda_shapes import Padded, device_weight_shapes
    from engine.model.loader import Checkpoint
    from engine.model.reference import ReferenceModel
    from engine.model.synthetic import make_weights

    mc = _odd_config(name)
    ckpt = Checkpoint(None, mc, make_weights(mc, 7))
    arena = _RecordingArena(10 * GIB)
    w = DeviceWeights(ckpt, arena, _FakeStream(), show=False, uploader=_serial())

    def fold(buf, g, rows, _stream):  # the scale_cols kernel's math, on the host copies
        assert rows == buf.host.shape[0]
        buf.host = buf.host * g.host

    w.fold_norms(fold, _FakeStream())
    w.fold_norms(None, _FakeStream())  # once only
    p = Padded.of(mc)
    assert not p.is_identity(mc)
    shapes = device_weight_shapes(mc)
    assert w.embed.shape == dict(shapes)["embed"] and w.lm_head.shape == (p.vocab, p.hidden)
    assert (w.lm_head is w.embed) == mc.tie_word_embeddings
    assert arena.used <= sum(-(-2 * int(np.prod(s)) // 256) * 256 for _, s in shapes)

    ids = np.random.default_rng(3).integers(0, mc.vocab_size, 21)
    ids[-1] = mc.vocab_size - 1  # the last real embedding row
    got = _padded_forward(w, mc, ids)
    want = ReferenceModel(ckpt).forward(ids)
    assert got.shape == (len(ids), p.vocab)
    assert not got[:, mc.vocab_size:].any(), "padding logits must be exactly zero"
    np.testing.assert_allclose(got[:, :mc.vocab_size], want, rtol=0, atol=2e-4)
    assert (got[:, :mc.vocab_size].argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("name", list(ODD))
def test_planned_arena_holds_odd_shapes(name):
    """The memory plan counts the padded weights and buffers."""
    from engine.executor.cuda_model import DeviceWeights, StepBuffers
    from engine.model.loader import Checkpoint
    from engine.model.synthetic import make_weights

    mc = _odd_config(name)
    ec = EngineArgs(num_gpu_blocks_override=64, max_num_seqs=8, max_num_batched_tokens=128
                    ).create_engine_config(mc, "cuda")
    n, arena_bytes = plan_num_pages(mc, ec, free=100 * GIB, total=141 * GIB, workspace=1 << 20)
    arena = _FakeArena(arena_bytes)
    DeviceWeights(Checkpoint(None, mc, make_weights(mc, 0)), arena, _FakeStream(), show=False,
                  uploader=_serial())
    StepBuffers(mc, Sizes.of(mc, ec), arena, 1 << 20, _FakeStream())
    for _ in range(2 * mc.num_hidden_layers):
        arena.alloc((n, mc.num_key_value_heads, 16, mc.head_dim), "u2", "kv")


def test_kernels_compile_for_an_odd_checkpoint(monkeypatch):
    """No refusal for a legal checkpoint: every kernel of a model whose vocabulary (1999),
    intermediate (420) and hidden (300) sizes fit no tile compiles for sm_90a, at the padded
    widths, with the real sizes where they matter (norm divisor, sampled vocabulary)."""
    pytest.importorskip("cutlass_kernels._common")  # sets CUTE_DSL_ARCH before cutlass loads
    from engine.executor.cuda_model import Kernels

    monkeypatch.setenv("CUTEINFER_KERNEL_CACHE", "0")  # compile here; write nothing to disk
    mc = _odd_config("all-odd-untied")
    k = Kernels.compile(mc, show=False)
    assert (k.lm_head.cfg.n, k.lm_head.cfg.k) == (2000, 320)
    assert (k.gate_up.cfg.n, k.down.cfg.k, k.silu.inter) == (896, 448, 448)
    assert (k.norm.hidden, k.norm.kernel.op.norm_size) == (320, 300)
    assert k.add_norm.kernel.op.norm_size == 300 and k.embed.hidden == 320
    assert (k.sample.vocab, k.sample.kernel.op.stride) == (1999, 2000)
    assert (k.logprobs.vocab, k.logprobs.kernel.op.stride) == (1999, 2000)


def test_decode_floor_counts_bytes_read():
    """An untied embedding table is gathered (B rows read), not streamed: qwen3-8b's decode floor
    at context 1024 is 0.291 ms under the all-weights count; a tied table is read whole as the
    LM head (qwen3-0.6b: the two counts agree)."""
    from engine.executor.cuda_model import decode_bytes_read

    bw = 4.28e12
    mc = ModelConfig.from_dict(hf_config("qwen3-8b"))
    kv = 1024 * mc.num_hidden_layers * 2 * mc.kv_size * 2
    table = mc.vocab_size * mc.hidden_size * 2
    for b in (1, 64, 128):
        got = decode_bytes_read(mc, b, 1024)
        assert got == weight_bytes(mc) - table + b * mc.hidden_size * 2 + b * kv
    assert round(decode_bytes_read(mc, 1, 1024) / bw * 1e3, 3) == 3.572
    assert round(decode_bytes_read(mc, 64, 1024) / bw * 1e3, 3) == 5.795
    small = ModelConfig.from_dict(hf_config("qwen3-0.6b"))
    assert small.tie_word_embeddings
    assert decode_bytes_read(small, 8, 512) == weight_bytes(small) + 8 * 512 * (
        small.num_hidden_layers * 2 * small.kv_size * 2)
