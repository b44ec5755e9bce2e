"""GPU: checkpoints whose widths no GEMM tile takes run on the cuda backend, padded
(engine/executor/cuda_shapes.Padded), and agree with the numpy backend.

Kernels first: the sampler and logprobs kernels over padded logits rows read only the real
vocabulary (the padding is poisoned with 1e30, which would win every argmax and swamp every
logsumexp it entered) and give the same bits as over contiguous rows; RMSNorm over zero-padded
rows divides by the real width. Then whole models (tests/test_cuda_plan.py ODD: a vocabulary of
32001, an intermediate size of 416, a hidden size of 300, all three at once with 1999 / 420 / 300):
teacher-forced logprobs against the numpy backend within the cuda-vs-numpy tolerances, greedy
tokens equal wherever the reference's top-2 margin is clear, every id / rank inside the real
vocabulary, graph replay equal to eager.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint
from engine.model.reference import ReferenceModel
from engine.model.synthetic import write_checkpoint
from tests.gpu.test_cuda_backend import CUDA_OPTS, _report
from tests.gpu.test_kernels_pointwise import (
    _assert_bf16_close,
    _bits,
    _dev,
    _logits,
    _poisoned,
    _sampling_params,
)
from tests.kernel_refs import ref_rmsnorm
from tests.test_cuda_plan import ODD
from tests.tolerances import TOL

POISON = np.float32(1e30)


@pytest.fixture
def seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _padded_rows(logits: np.ndarray, stride: int) -> np.ndarray:
    out = np.full((logits.shape[0], stride), POISON, np.float32)
    out[:, :logits.shape[1]] = logits
    return out


# ---- kernels over padded rows -----------------------------------------------------------------

STRIDES = [(1000, 1008), (1999, 2000), (32001, 32008), (128257, 128264)]


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("vocab,stride", STRIDES)
def test_sampler_reads_only_the_real_vocab(cuda_ctx, stream, seed, vocab, stride, rows):
    from cutlass_kernels.sampling import compile_sampler

    rng = np.random.default_rng(seed)
    logits = _logits(rng, rows, vocab)
    dparams = [_dev(p) for p in _sampling_params(rng, rows, vocab)]
    what = f"sampler V={vocab} stride={stride} S={rows} seed={seed}"
    got = []
    padded = _dev(_padded_rows(logits, stride))
    for launcher, rows_dev in ((compile_sampler(vocab), _dev(logits)),
                               (compile_sampler(vocab, stride), padded)):
        out = _poisoned(rows, np.int32, stream)
        launcher(rows_dev, *dparams, out, rows, stream)
        stream.synchronize()
        got.append(out.download())
    assert ((got[1] >= 0) & (got[1] < vocab)).all(), f"{what}: a padding id {got[1]}"
    np.testing.assert_array_equal(got[1], got[0], err_msg=f"{what}: differs from contiguous rows")


@pytest.mark.parametrize("top_n", [0, 20])
@pytest.mark.parametrize("vocab,stride", STRIDES)
def test_logprobs_read_only_the_real_vocab(cuda_ctx, stream, seed, vocab, stride, top_n):
    from cutlass_kernels.sampling import compile_logprobs

    rows = 9
    rng = np.random.default_rng(seed)
    logits = _logits(rng, rows, vocab)
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    tokens[0] = vocab - 1
    what = f"logprobs V={vocab} stride={stride} n={top_n} seed={seed}"
    runs = []
    for launcher, rows_dev in ((compile_logprobs(vocab), _dev(logits)),
                               (compile_logprobs(vocab, row_stride=stride),
                                _dev(_padded_rows(logits, stride)))):
        width = launcher.max_top_n
        bufs = [_poisoned(rows, np.float32, stream), _poisoned(rows, np.int32, stream),
                _poisoned((rows, width), np.int32, stream),
                _poisoned((rows, width), np.float32, stream)]
        launcher(rows_dev, _dev(tokens), *bufs, rows, top_n, stream)
        stream.synchronize()
        runs.append([b.download() for b in bufs])
    lp, rank, ids, _ = runs[1]
    # row kind 3 of _logits has -inf entries: a token drawn onto one has logprob -inf
    masked = np.isneginf(logits[np.arange(rows), tokens])
    assert (np.isfinite(lp) | (masked & np.isneginf(lp))).all() and (lp <= 0).all(), \
        f"{what}: {lp}"
    assert ((rank >= 1) & (rank <= vocab)).all(), f"{what}: rank {rank}"
    assert ((ids[:, :top_n] >= 0) & (ids[:, :top_n] < vocab)).all(), f"{what}: a padding id"
    for g, w, name in zip(runs[1], runs[0], ("logprob", "rank", "top ids", "top logprobs"),
                          strict=True):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32),
                                      err_msg=f"{what}: {name} differ from contiguous rows")


@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("real,padded", [(200, 256), (300, 320), (1000, 1024)])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_rmsnorm_over_zero_padded_rows(cuda_ctx, stream, seed, fused, real, padded, tokens):
    import ml_dtypes

    from cutlass_kernels.rmsnorm import compile_rmsnorm

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(seed)

    def rows(scale: float) -> np.ndarray:
        a = np.zeros((tokens, padded), bf16)
        a[:, :real] = (scale * rng.standard_normal((tokens, real))).astype(bf16)
        return a

    x, res = rows(3.0), rows(1.0) if fused else None
    w = np.zeros(padded, bf16)
    w[:real] = (1.0 + 0.2 * rng.standard_normal(real)).astype(bf16)
    eps = 1e-6
    want, want_res = ref_rmsnorm(x[:, :real], w[:real], eps,
                                 res[:, :real] if fused else None)
    launcher = compile_rmsnorm(padded, fused, real)
    dres = _dev(res) if fused else None
    out = _poisoned((tokens, padded), bf16, stream)
    launcher(_dev(x), dres, _dev(w), out, tokens, eps, stream)
    stream.synchronize()
    what = f"rmsnorm fused={fused} H={real} padded to {padded} T={tokens} seed={seed}"
    got = out.download()
    _assert_bf16_close(got[:, :real], want, "rmsnorm", what)
    assert not np.asarray(got[:, real:], np.float32).any(), f"{what}: padding columns not 0"
    if fused:
        r = dres.download()
        np.testing.assert_array_equal(_bits(r[:, :real]), _bits(want_res.astype(bf16)),
                                      err_msg=what)
        assert not np.asarray(r[:, real:], np.float32).any(), f"{what}: residual padding"
    plain = compile_rmsnorm(real, fused) if real % 8 == 0 else None
    if plain is not None and plain.kernel.op.threads == launcher.kernel.op.threads:
        # the same threads per row (thread i: vector i): the unpadded kernel sums the same
        # values in the same order, so the real columns are the same bits
        ref_out = _poisoned((tokens, real), bf16, stream)
        dres2 = _dev(np.ascontiguousarray(res[:, :real])) if fused else None
        plain(_dev(np.ascontiguousarray(x[:, :real])), dres2, _dev(w[:real]), ref_out, tokens,
              eps, stream)
        stream.synchronize()
        np.testing.assert_array_equal(_bits(got[:, :real]), _bits(ref_out.download()),
                                      err_msg=f"{what}: differs from the unpadded kernel")


# ---- whole models: cuda against numpy ---------------------------------------------------------


@pytest.fixture(scope="module")
def odd_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    made: dict = {}

    def get(name: str):
        if name not in made:
            preset, ov = ODD[name]
            made[name] = write_checkpoint(root / name, preset, seed=11, overrides=ov, quiet=True)
        return made[name]

    return get


def _sequences(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(vocab)
    seqs = [rng.integers(0, vocab, n).tolist() for n in (2, 7, 17, 130)]
    seqs[1][3] = seqs[2][-1] = vocab - 1  # the last real embedding / lm_head row
    return seqs


def _prompt_logprobs(llm, prompts, vocab: int) -> list[np.ndarray]:
    """Teacher-forced logprob of each next token; checks every listed id and rank."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=5,
                                                temperature=0.0))
    res = []
    for p, o in zip(prompts, outs, strict=True):
        for pos in o.prompt_logprobs[1:]:
            assert all(0 <= t < vocab for t in pos), sorted(pos)
            assert all(1 <= lp.rank <= vocab for lp in pos.values() if lp.rank is not None)
        res.append(np.array([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]))
    return res


@pytest.mark.parametrize("name", list(ODD))
def test_cuda_matches_numpy_on_odd_shapes(odd_dirs, name):
    d = odd_dirs(name)
    ckpt = load_checkpoint(d)
    vocab = ckpt.config.vocab_size
    prompts = _sequences(vocab)
    ref = _prompt_logprobs(LLM(str(d), backend="numpy"), prompts, vocab)
    llm = LLM(str(d), backend="cuda", **CUDA_OPTS)
    got = _prompt_logprobs(llm, prompts, vocab)
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ref, got, strict=True)])
    _report("cuda_vs_numpy_odd_shapes", {"case": name, "mean": float(diff.mean()),
                                         "max": float(diff.max()), "n": int(diff.size)})
    assert diff.mean() <= TOL["cuda_vs_numpy_mean"]["mean_abs"], diff.mean()
    assert diff.max() <= TOL["cuda_vs_numpy_max"]["max_abs"], diff.max()

    # greedy: identical to the reference wherever its top-2 margin is clear
    model = ReferenceModel(ckpt)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in (prompts[0], prompts[2][:5], prompts[3][:40]):
        mine = llm.generate(prompt, sp)[0].outputs[0].token_ids
        ids = list(prompt)
        for i in range(len(mine)):
            logits = model.forward(ids)[-1]
            want = int(np.argmax(logits))
            if mine[i] != want:
                top2 = np.sort(logits)[-2:]
                margin = float(top2[1] - top2[0])
                assert margin <= 0.1, f"greedy diverged at step {i}, clear margin {margin:.3f}"
                break
            ids.append(want)

    # sampled ids stay inside the real vocabulary
    hot = SamplingParams(max_tokens=24, temperature=1.5, seed=5, ignore_eos=True)
    for o in llm.generate([prompts[1], prompts[2]], hot):
        assert all(0 <= t < vocab for t in o.outputs[0].token_ids)


def test_graph_replay_equals_eager_on_odd_shapes(odd_dirs):
    d = odd_dirs("all-odd-untied")
    prompts = [[(7 * i + j) % 1999 for j in range(3 + i)] for i in range(12)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    g = LLM(str(d), backend="cuda", **CUDA_OPTS)
    e = LLM(str(d), backend="cuda", enforce_eager=True, **CUDA_OPTS)
    a = [o.outputs[0].token_ids for o in g.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in e.generate(prompts, sp)]
    assert g.engine.stats.graph_steps > 0 and e.engine.stats.graph_steps == 0
    assert a == b
