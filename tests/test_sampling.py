"""Sampling math (engine/sampling.py): filters, reproducibility, and the statistics of the draws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.sampling import (
    compute_logprobs,
    keep_mask,
    log_softmax,
    mix32,
    sample,
    sample_row,
    target_distribution,
    uniform,
)
from engine.sampling_params import SamplingParams, SamplingParamsError


def chi2_sf(x: float, k: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_mix32_known_values():
    # lowbias32 reference values (computed with the C definition on uint32)
    def ref(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        x ^= x >> 16
        return x

    xs = np.array([0, 1, 2, 12345, 0xFFFFFFFF, 0x9E3779B9], np.uint32)
    assert mix32(xs).tolist() == [ref(int(x)) for x in xs]


def test_uniform_is_never_0_or_1():
    from engine.sampling import bits_to_uniform

    ends = bits_to_uniform(np.array([0, 511, 512, 0xFFFFFDFF, 0xFFFFFFFF], np.uint32))
    assert ends[0] > 0 and ends[-1] < 1 and np.isfinite(-np.log(-np.log(ends))).all()
    assert ends[0] == ends[1] < ends[2] and ends[3] < ends[4]


def test_uniform_range_and_independence():
    u = uniform(seed=7, step=3, vocab_size=200_000)
    assert u.dtype == np.float32 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    # a different step or seed gives unrelated numbers
    assert abs(np.corrcoef(u, uniform(7, 4, 200_000))[0, 1]) < 0.01
    assert abs(np.corrcoef(u, uniform(8, 3, 200_000))[0, 1]) < 0.01
    assert np.array_equal(u, uniform(7, 3, 200_000))


def test_keep_mask_filters():
    z = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    assert keep_mask(z, 2, 1.0, 0.0).tolist() == [True, True, False, False, False]
    # nucleus: 0.4 + 0.3 = 0.7 < 0.75, so the third token is still needed
    assert keep_mask(z, 0, 0.75, 0.0).tolist() == [True, True, True, False, False]
    assert keep_mask(z, 0, 0.7, 0.0).tolist() == [True, True, False, False, False]
    # min_p relative to the max prob (0.4): 0.3 * 0.4 = 0.12 keeps 0.4, 0.3, 0.15
    assert keep_mask(z, 0, 1.0, 0.3).tolist() == [True, True, True, False, False]
    # top-p after top-k is computed on the renormalized top-k distribution
    assert keep_mask(z, 3, 0.5, 0.0).tolist() == [True, True, False, False, False]


def test_greedy_is_first_argmax():
    lg = np.array([[1.0, 3.0, 3.0, 2.0]], np.float32)
    assert sample(lg, np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                  np.zeros(1, np.float32), np.zeros(1, np.uint64), np.zeros(1, np.uint32))[0] == 1


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.9, 8, 0.9, 0.05),
])
def test_draws_follow_the_target_distribution(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng()
    logits = (rng.standard_normal(12) * 1.5).astype(np.float32)
    p = target_distribution(logits, temperature, top_k, top_p, min_p)
    n = 6000
    seed = int(rng.integers(2**63))
    counts = np.zeros(12)
    for step in range(n):  # one request drawing n tokens: step is its counter
        counts[sample_row(logits, temperature, top_k, top_p, min_p, seed, step)] += 1
    assert counts[p == 0].sum() == 0, "a filtered-out token was sampled"
    support = p > 0
    exp = p[support] * n
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    if dof > 0:
        assert chi2_sf(stat, dof) > 1e-4, (stat, dof, counts, p)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    rng = np.random.default_rng()
    logits = rng.standard_normal((1, 5000)).astype(np.float32)
    draws = [sample_row(logits[0], 1.0, 0, 1.0, 0.0, 1234, s) for s in range(50)]
    again = [sample_row(logits[0], 1.0, 0, 1.0, 0.0, 1234, s) for s in range(50)]
    other = [sample_row(logits[0], 1.0, 0, 1.0, 0.0, 1235, s) for s in range(50)]
    assert draws == again and draws != other


def test_logprobs_of_raw_logits():
    rng = np.random.default_rng()
    lg = rng.standard_normal((3, 50)).astype(np.float32)
    toks = np.array([0, 7, 49], np.int32)
    out = compute_logprobs(lg, toks, 4)
    ref = lg - np.log(np.exp(lg.astype(np.float64)).sum(1, keepdims=True))
    np.testing.assert_allclose(out.token_logprob, ref[np.arange(3), toks], atol=1e-5)
    assert (out.token_rank == (ref > ref[np.arange(3), toks][:, None]).sum(1) + 1).all()
    assert (out.top_ids == np.argsort(-ref, axis=1)[:, :4]).all()
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, 1)[:, ::-1][:, :4], atol=1e-5)
    assert np.allclose(np.exp(log_softmax(lg)).sum(1), 1, atol=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"n": 2}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and f"SamplingParams.{field}" in str(e.value)
