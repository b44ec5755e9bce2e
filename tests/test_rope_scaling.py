"""RoPE scaling: config parsing (both transformers forms), the frequencies against formulas written
out here independently (float64) and hand-computed values, the attention factor, the context
length it gives max_model_len, and refusals. The goldens against transformers itself are the
``*-rope-*`` cases of tests/goldens_cases.py (made on the GPU host, tools/make_goldens.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.args import EngineArgs
from engine.config import PLAIN_ROPE, ConfigError, ModelConfig, RopeScaling
from engine.model.loader import load_checkpoint
from engine.model.reference import ReferenceModel, cos_sin_table, inv_freq, rope_cos_sin
from engine.model.synthetic import hf_config, write_checkpoint

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def parse(preset: str, form: int, scaling: dict | None, **over: object) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(preset, form, {"rope_scaling": scaling, **over}))


# -- independent float64 formulas (transformers' modeling_rope_utils, written out again) --------
def plain64(d: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, d, 2) / d)


def llama3_64(d: int, theta: float, factor: float, lo: float, hi: float, old: int) -> np.ndarray:
    out = []
    for f in plain64(d, theta):
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def yarn64(d: int, theta: float, factor: float, old: int, fast: float = 32, slow: float = 1,
           truncate: bool = True) -> np.ndarray:
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in `old`
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    ramp = np.clip((np.arange(d // 2) - lo) / (hi - lo if hi != lo else 0.001), 0, 1)
    f = plain64(d, theta)
    return f / factor * ramp + f * (1 - ramp)


# -- frequencies ------------------------------------------------------------------------------
def test_llama3_hand_computed() -> None:
    """d=8, theta=1e4: frequencies 1, 0.1, 0.01, 0.001; wavelengths 2pi, 62.8, 628, 6283 against
    original 1024 / high 4 = 256 and / low 1 = 1024: kept, kept, blended, divided by 8."""
    sc = RopeScaling("llama3", 8.0, 1024, 1.0, 4.0)
    s = (1024 * 0.01 / (2 * math.pi) - 1) / 3  # the blend weight of the third pair: 0.2099
    want = [1.0, 0.1, (1 - s) * 0.01 / 8 + s * 0.01, 0.001 / 8]
    np.testing.assert_allclose(inv_freq(8, 10000.0, sc), want, rtol=1e-6)


def test_yarn_hand_computed() -> None:
    """d=16, theta=1e4, original 4096: 32 rotations at dim 2.62 (floor 2), 1 at dim 5.63 (ceil
    6); the ramp over pairs 0..7 is 0, 0, 0, 1/4, 1/2, 3/4, 1, 1 (share of the interpolated)."""
    f = 10.0 ** (-np.arange(8) / 2)
    ramp = np.array([0, 0, 0, 0.25, 0.5, 0.75, 1, 1])
    sc = RopeScaling("yarn", 4.0, 4096, attention_factor=1.0)
    np.testing.assert_allclose(inv_freq(16, 10000.0, sc), f / 4 * ramp + f * (1 - ramp),
                               rtol=1e-6)


@pytest.mark.parametrize("d,theta,old", [(64, 10000.0, 64), (128, 500000.0, 8192),
                                         (64, 1e6, 512)])
def test_llama3_against_the_formula(d: int, theta: float, old: int) -> None:
    sc = RopeScaling("llama3", 8.0, old, 1.0, 4.0)
    got = inv_freq(d, theta, sc)
    assert got.dtype == np.float32 and got.shape == (d // 2,)
    want = llama3_64(d, theta, 8.0, 1.0, 4.0, old)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = plain64(d, theta)
    # the case has all three bands: kept, blended, divided
    assert np.isclose(want, plain).any() and np.isclose(want, plain / 8).any()
    assert (~np.isclose(want, plain) & ~np.isclose(want, plain / 8)).any()


@pytest.mark.parametrize("d,theta,factor,old,truncate", [
    (64, 10000.0, 4.0, 64, True), (128, 1e6, 4.0, 32768, True), (64, 10000.0, 8.0, 4096, False),
])
def test_yarn_against_the_formula(d: int, theta: float, factor: float, old: int,
                                  truncate: bool) -> None:
    sc = RopeScaling("yarn", factor, old, truncate=truncate, attention_factor=1.0)
    np.testing.assert_allclose(inv_freq(d, theta, sc), yarn64(d, theta, factor, old,
                                                              truncate=truncate), rtol=2e-6)


def test_linear_and_dynamic() -> None:
    np.testing.assert_allclose(inv_freq(64, 1e4, RopeScaling("linear", 2.0, 2048)),
                               plain64(64, 1e4) / 2, rtol=1e-6)
    # dynamic: one NTK base for the whole stretched context (max_pos * factor), as vLLM
    base = 1e4 * (2.0 * 2.0 - 1.0) ** (64 / 62)
    np.testing.assert_allclose(inv_freq(64, 1e4, RopeScaling("dynamic", 2.0, 2048)),
                               plain64(64, base), rtol=2e-6)
    np.testing.assert_array_equal(inv_freq(64, 1e4), inv_freq(64, 1e4, PLAIN_ROPE))
    assert not inv_freq(64, 1e4).flags.writeable  # cached: shared, so read-only


def test_attention_factor_scales_cos_and_sin() -> None:
    cfg = parse("tiny-qwen3", 5, YARN)
    af = 0.1 * math.log(4.0) + 1.0
    assert cfg.rope_scaling.attention_factor == pytest.approx(af)
    pos = np.arange(300)
    c, s = rope_cos_sin(pos, 64, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(c * c + s * s, af * af, rtol=1e-5)
    freqs = pos[:, None] * yarn64(64, cfg.rope_theta, 4.0, 64)[None, :]
    np.testing.assert_allclose(c, af * np.cos(freqs), atol=2e-4)  # float32 angles up to ~300
    table = cos_sin_table(300, 64, cfg.rope_theta, cfg.rope_scaling)
    assert table.shape == (300, 64) and table.dtype == np.float32
    np.testing.assert_array_equal(table, np.concatenate([c, s], axis=1))


# -- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,scaling", [
    ("tiny-llama", LLAMA3), ("small-llama", {**LLAMA3, "original_max_position_embeddings": 8192}),
    ("tiny-qwen3", YARN), ("tiny-qwen3", {**YARN, "beta_fast": 16.0, "truncate": False}),
    ("tiny-qwen3", {"rope_type": "linear", "factor": 2.0}),
    ("tiny-llama", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_both_config_forms_give_the_same_rope(preset: str, scaling: dict) -> None:
    a, b = parse(preset, 4, scaling), parse(preset, 5, scaling)
    assert a == b and a.rope_scaling.rope_type == scaling["rope_type"]
    np.testing.assert_array_equal(cos_sin_table(512, a.head_dim, a.rope_theta, a.rope_scaling),
                                  cos_sin_table(512, b.head_dim, b.rope_theta, b.rope_scaling))
    assert not np.array_equal(cos_sin_table(512, a.head_dim, a.rope_theta, a.rope_scaling),
                              cos_sin_table(512, a.head_dim, a.rope_theta))


def test_defaults_resolve_as_transformers_does() -> None:
    # the 4.x "type" key; yarn's original context defaults to max_position_embeddings
    y = parse("tiny-qwen3", 4, {"type": "yarn", "factor": 2.0}).rope_scaling
    assert (y.rope_type, y.original_max_position_embeddings, y.beta_fast, y.beta_slow,
            y.truncate) == ("yarn", 4096, 32.0, 1.0, True)
    assert y.attention_factor == pytest.approx(0.1 * math.log(2.0) + 1)
    # mscale / mscale_all_dim: their ratio; an explicit attention_factor wins
    m = parse("tiny-qwen3", 5, {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}).rope_scaling
    ln4 = math.log(4.0)
    assert m.attention_factor == pytest.approx((0.1 * ln4 + 1) / (0.05 * ln4 + 1))
    assert parse("tiny-qwen3", 5, {**YARN, "attention_factor": 0.9}).rope_scaling \
        .attention_factor == 0.9
    # transformers 5: a yarn factor of null is the stretch from the original context
    f = parse("tiny-qwen3", 5, {"rope_type": "yarn", "factor": None,
                                "original_max_position_embeddings": 1024}).rope_scaling
    assert f.factor == 4.0
    # a top-level original_max_position_embeddings wins (transformers 5's standardization)
    t = parse("tiny-llama", 4, LLAMA3, original_max_position_embeddings=128).rope_scaling
    assert t.original_max_position_embeddings == 128
    # plain RoPE whichever way it is spelled
    for scaling in (None, {"rope_type": "default"}):
        assert parse("tiny-qwen3", 4, scaling).rope_scaling == PLAIN_ROPE


def test_context_length_follows_vllm() -> None:
    qwen_yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    m = parse("qwen3-0.6b", 4, qwen_yarn)
    assert m.max_position_embeddings == 40960 and m.max_context_len == 131072
    assert EngineArgs(backend="numpy").create_engine_config(m).max_model_len == 131072
    with pytest.raises(ConfigError, match=r"exceeds the model's max_position_embeddings "
                       r"\(40960, stretched to 131072 by yarn RoPE scaling"):
        EngineArgs(backend="numpy", max_model_len=131073).create_engine_config(m)
    assert parse("tiny-llama", 4, {"rope_type": "linear", "factor": 2.0}).max_context_len == 4096
    assert parse("tiny-llama", 4, {"rope_type": "dynamic", "factor": 3.0}).max_context_len == 6144
    assert parse("tiny-llama", 4, LLAMA3).max_context_len == 2048  # llama3: as configured


@pytest.mark.parametrize("form", [4, 5])
def test_unknown_rope_type_names_it_and_the_supported_ones(form: int) -> None:
    with pytest.raises(ConfigError) as e:
        parse("tiny-qwen3", form, {"rope_type": "longrope", "factor": 4.0,
                                   "short_factor": [1.0], "long_factor": [1.0]})
    where = "rope_scaling" if form == 4 else "rope_parameters"
    assert (f"{where}.rope_type 'longrope' is not supported; supported rope types: default, "
            "linear, dynamic, yarn, llama3") in str(e.value)


@pytest.mark.parametrize("scaling,needle", [
    ({"rope_type": "linear"}, "rope type 'linear' needs a factor"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
     "rope type 'llama3' needs low_freq_factor"),
    ({"rope_type": "yarn", "factor": -1.0}, "factor must be a finite number > 0, got -1.0"),
    ({"rope_type": "yarn", "factor": "4"}, r"rope_scaling.factor must be a number, got '4'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 0}, "original_max_position_embeddings must be a "
     "positive integer"),
])
def test_bad_scaling_values_are_named(scaling: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse("tiny-llama", 4, scaling)


def test_the_numpy_forward_applies_the_scaling(tmp_path) -> None:
    """The reference forward (shared with the numpy executor) rotates with the scaled table."""
    toks = list(range(3, 40))
    logits = {}
    for name, scaling in (("plain", None), ("yarn", YARN), ("llama3", LLAMA3)):
        d = write_checkpoint(tmp_path / name, "tiny-llama", seed=5, quiet=True,
                             overrides={"rope_scaling": scaling, "num_hidden_layers": 1})
        ref = ReferenceModel(load_checkpoint(d))
        assert ref.config.rope_scaling.rope_type == (scaling or {}).get("rope_type", "default")
        logits[name] = ref.forward(toks)
    assert np.array_equal(logits["plain"][0], logits["llama3"][0])  # position 0: no rotation
    for name in ("yarn", "llama3"):
        assert np.abs(logits[name] - logits["plain"]).max() > 1e-2, name
