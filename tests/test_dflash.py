"""The DFlash drafter on the numpy backend (engine/model/dflash.py, engine/speculative.py): its
config's typed errors, checkpoint loading, the forward against a brute-force implementation
written here, the executor's hidden-state capture against the reference forward's layer outputs,
and losslessness end to end (greedy and seeded, prefix cache on and off, chunked prefill, a pool
that preempts, the #681 scenario), with an oracle drafter output to drive acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.config import PLAIN_ROPE, ConfigError, ModelConfig, RopeScaling
from engine.model.dflash import (
    DFlashCheckpoint,
    DFlashConfig,
    DFlashDrafter,
    build_target_layer_ids,
    expected_tensors,
    load_drafter,
)
from engine.model.loader import CheckpointError
from engine.model.safetensors_io import open_tensors, save_file
from engine.model.synthetic import (
    drafter_config,
    hf_config,
    make_drafter_weights,
    write_checkpoint,
)
from engine.speculative import DFlashProposer, SpeculativeConfig
from tests.test_speculative import _ids, _issue_681, _no_pages_left, _params, _prompts

MC = ModelConfig.from_dict(hf_config("tiny-qwen3"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("dflash") / "m", "tiny-qwen3", seed=3,
                            quiet=True)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.make_checkpoint import main

    out = tmp_path_factory.mktemp("dflash") / "d"
    assert main(["--preset", "tiny-qwen3-dflash", "--out", str(out), "--seed", "5"]) == 0
    return out


def _spec(drafter: Path, **kw) -> dict:
    return {"method": "dflash", "model": str(drafter), "disable_by_batch_size": 64, **kw}


# -- config and checkpoint -----------------------------------------------------------------------
def _cfg(**change) -> dict:
    cfg = drafter_config("tiny-qwen3-dflash")
    for k, v in change.items():
        if k.startswith("dc_"):
            if v is None:
                cfg["dflash_config"].pop(k[3:])
            else:
                cfg["dflash_config"][k[3:]] = v
        elif v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("change,needle", [
    (dict(block_size=1), "block_size must be >= 2"),
    (dict(block_size=None), "block_size is missing"),
    (dict(dc_target_layer_ids=[1, 0]), "target_layer_ids must be strictly increasing"),
    (dict(dc_target_layer_ids=[]), "target_layer_ids must be a non-empty array"),
    (dict(dc_target_layer_ids=None), "dflash_config.target_layer_ids is missing"),
    (dict(dc_mask_token_id=None), "dflash_config.mask_token_id is missing"),
    (dict(dc_mask_token_id=-1), "mask_token_id must be >= 0"),
    (dict(num_anchors=1), "num_anchors: an anchor-first"),
    (dict(dc_mask_token_id=None, mask_token_id=5), "mask_token_id at top level"),
    (dict(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (dict(hidden_size=None), "hidden_size is missing"),
    (dict(rope_theta=None), "rope_theta is missing"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(layer_types=["sliding_attention"] * 2), "layer_types"),
    (dict(num_attention_heads=3), "multiple of num_key_value_heads"),
])
def test_bad_drafter_configs_name_the_field(change, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        DFlashConfig.from_dict(_cfg(**change))


@pytest.mark.parametrize("change,needle", [
    (dict(hidden_size=256), "hidden_size 256 differs from the target model's 128"),
    (dict(num_attention_heads=8), "num_attention_heads 8 differs"),
    (dict(num_key_value_heads=1), "num_key_value_heads 1 differs"),
    (dict(head_dim=32), "head_dim 32 differs"),
    (dict(vocab_size=2048), "vocab_size 2048 differs"),
    (dict(rope_theta=10000.0), "rope_theta 10000.0 differs"),
    (dict(num_target_layers=36), "num_target_layers 36 differs"),
    (dict(dc_target_layer_ids=[1, 9]), r"name layers \[9\]"),
    (dict(dc_mask_token_id=1024), "mask_token_id 1024 is outside the target's vocabulary"),
])
def test_a_drafter_for_another_target_is_refused(change, needle) -> None:
    dc = DFlashConfig.from_dict(_cfg(**change))
    with pytest.raises(ConfigError, match=needle) as e:
        dc.check_target(MC)
    assert "use the drafter trained for this target model" in str(e.value)


def test_check_cuda_refuses_another_intermediate_size() -> None:
    """DFlashConfig.check_cuda: the refusal names the field and the numpy backend."""
    dc = DFlashConfig.from_dict(_cfg(intermediate_size=MC.intermediate_size * 2))
    dc.check_target(MC)  # numpy runs it
    with pytest.raises(ConfigError, match=r"speculative_config.model 'x': the drafter's "
                       rf"intermediate_size {MC.intermediate_size * 2} differs") as e:
        dc.check_cuda(MC, "speculative_config.model 'x'")
    assert "--backend numpy" in str(e.value)
    DFlashConfig.from_dict(_cfg()).check_cuda(MC)


def test_config_schema_variants() -> None:
    base = DFlashConfig.from_dict(_cfg())
    assert (base.block_size, base.mask_token_id, base.target_layer_ids) == (16, 1023, (0, 1))
    assert (base.num_drafts, base.capture_width) == (15, 256)
    base.check_target(MC)
    nested = _cfg(block_size=None)
    nested["dflash_config"]["block_size"] = 8
    assert DFlashConfig.from_dict(nested).block_size == 8
    five = _cfg(rope_theta=None, rope_parameters={"rope_type": "default",
                                                  "rope_theta": 1000000.0})
    assert DFlashConfig.from_dict(five).rope_theta == 1e6
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("preset,target,fc,params", [
    ("qwen3-8b-dflash", "qwen3-8b", (4096, 20480), 1.049e9),
    ("qwen3-4b-dflash", "qwen3-4b", (2560, 12800), 0.537e9),
])
def test_real_shape_presets(preset, target, fc, params) -> None:
    dc = DFlashConfig.from_dict(drafter_config(preset))
    assert (dc.num_hidden_layers, dc.block_size, dc.mask_token_id) == (5, 16, 151669)
    assert dc.target_layer_ids == (1, 9, 17, 25, 33)
    shapes = expected_tensors(dc)
    assert shapes["fc.weight"] == fc
    assert shapes["layers.0.self_attn.q_proj.weight"] == (4096, fc[0])
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, fc[0])
    assert not any("embed" in n or "lm_head" in n for n in shapes)
    assert abs(sum(int(np.prod(s)) for s in shapes.values()) - params) < 0.002e9
    dc.check_target(ModelConfig.from_dict(hf_config(target)))
    other = "qwen3-4b" if target == "qwen3-8b" else "qwen3-8b"
    with pytest.raises(ConfigError, match="hidden_size"):
        dc.check_target(ModelConfig.from_dict(hf_config(other)))


def test_make_checkpoint_writes_a_drafter_that_loads(drafter: Path) -> None:
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"] == {"mask_token_id": 1023, "target_layer_ids": [0, 1]}
    names = set(open_tensors(drafter / "model.safetensors"))
    dc = DFlashConfig.from_dict(cfg)
    assert names == set(expected_tensors(dc))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.1.self_attn.k_norm.weight"} <= names
    ck = load_drafter(drafter, MC)
    assert ck.config == dc and ck["fc.weight"].shape == (128, 256)


def _rewrite(src: Path, dst: Path, cfg: dict | None = None, rename=None,
             extra: dict | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg or json.loads(
        (src / "config.json").read_text())))
    t = {(rename(n) if rename else n): np.asarray(a) for n, a in
         open_tensors(src / "model.safetensors").items()}
    t.update(extra or {})
    save_file(t, dst / "model.safetensors")
    return dst


def test_checkpoint_problems_are_listed(drafter: Path, tmp_path: Path) -> None:
    # fc width that does not match target_layer_ids
    one = _rewrite(drafter, tmp_path / "a", _cfg(dc_target_layer_ids=[1]))
    with pytest.raises(CheckpointError, match=r"fc.weight has 256 input features, but "
                       r"len\(target_layer_ids\) \* hidden_size = 1 \* 128 = 128"):
        load_drafter(one, MC)
    # a missing and an unexpected tensor, both listed
    bad = _rewrite(drafter, tmp_path / "b", rename=lambda n: n.replace("layers.1.mlp.up_proj",
                                                                       "layers.1.mlp.upp"))
    with pytest.raises(CheckpointError) as e:
        load_drafter(bad, MC)
    assert "missing tensor layers.1.mlp.up_proj.weight" in str(e.value)
    assert "unexpected tensor layers.1.mlp.upp.weight" in str(e.value)
    # vLLM's "model." prefix and a shipped embedding are fine (the target's is used)
    emb = np.zeros((1024, 128), np.float32)
    ok = _rewrite(drafter, tmp_path / "c", rename=lambda n: "model." + n,
                  extra={"model.embed_tokens.weight": emb})
    assert sorted(load_drafter(ok, MC).tensors) == sorted(load_drafter(drafter, MC).tensors)
    # the target check runs at load time too
    with pytest.raises(ConfigError, match="vocab_size"):
        load_drafter(drafter, ModelConfig.from_dict(hf_config("small-qwen3")))


def test_speculative_config_for_dflash(drafter: Path) -> None:
    s = SpeculativeConfig.parse({"method": "dflash", "model": str(drafter)})
    assert (s.method, s.model, s.num_speculative_tokens) == ("dflash", str(drafter), 15)
    assert SpeculativeConfig.parse(json.dumps(_spec(drafter, num_speculative_tokens=4))
                                   ).num_speculative_tokens == 4
    for value, needle in [
        ({"method": "dflash"}, "speculative_config.model is required"),
        ({"method": "dflash", "model": "/nonexistent/d"}, "speculative_config.model "
         "'/nonexistent/d' does not exist"),
        (_spec(drafter, num_speculative_tokens=16), r"num_speculative_tokens must be <= 15 "
         r"\(the drafter's block_size 16 - 1\)"),
        (_spec(drafter, num_speculative_tokens=0), "num_speculative_tokens must be an integer"),
        (_spec(drafter, prompt_lookup_min=2), "prompt_lookup_min: only the ngram method"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            SpeculativeConfig.parse(value)
    args = EngineArgs.from_kwargs(speculative_config=_spec(drafter))
    assert args.create_engine_config(MC, "numpy").speculative_config.model == str(drafter)
    assert args.create_engine_config(MC, "cuda").speculative_config.model == str(drafter)
    with pytest.raises(ConfigError, match="runs with tensor_parallel_size 1"):
        EngineArgs.from_kwargs(speculative_config=_spec(drafter), tensor_parallel_size=2
                               ).create_engine_config(MC, "numpy")
    with pytest.raises(ConfigError, match="does not fit the target model"):
        args.create_engine_config(ModelConfig.from_dict(hf_config("small-qwen3")), "numpy")


def test_the_cuda_drafter_needs_the_targets_intermediate_size(tmp_path: Path) -> None:
    """The cuda drafter shares the target's SiLU kernel: another intermediate size is refused
    on cuda (naming the field and the numpy backend), accepted on numpy."""
    d = write_checkpoint(tmp_path / "d", "tiny-qwen3-dflash",
                         overrides={"intermediate_size": 512}, quiet=True)
    args = EngineArgs.from_kwargs(speculative_config=_spec(d))
    assert args.create_engine_config(MC, "numpy").speculative_config.model == str(d)
    with pytest.raises(ConfigError, match=r"intermediate_size 512 differs from the target "
                       r"model's 256.*--backend numpy"):
        args.create_engine_config(MC, "cuda")


def test_dflash_draft_model_path_is_the_speculative_config_alias(drafter: Path) -> None:
    from tests.test_args import cli_args

    d = str(drafter)
    want = EngineArgs.from_kwargs(speculative_config={"method": "dflash", "model": d}
                                  ).create_engine_config(MC, "numpy").speculative_config
    got = cli_args("--dflash-draft-model-path", d).create_engine_config(MC, "numpy")
    assert got.speculative_config == want
    both = cli_args("--dflash-draft-model-path", d, "--speculative-config",
                    '{"num_speculative_tokens": 7, "disable_by_batch_size": 4}')
    s = both.create_engine_config(MC, "numpy").speculative_config
    assert (s.method, s.model, s.num_speculative_tokens, s.disable_by_batch_size) == (
        "dflash", d, 7, 4)
    with pytest.raises(ConfigError, match="contradicts"):
        cli_args("--dflash-draft-model-path", d, "--speculative-config", '{"method": "ngram"}')
    assert cli_args().speculative_config is None


# -- the forward ---------------------------------------------------------------------------------
def _brute_force(dc: DFlashConfig, w: dict, embed, lm_head, feats, pending: int,
                 rope_factor: float) -> np.ndarray:
    """DFLASH.md 2.4 written out: float64, one vector at a time, explicit loops over heads."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps, hd, b, n_ctx = dc.rms_norm_eps, dc.head_dim, dc.block_size, feats.shape[0]
    nq, nkv = dc.num_attention_heads, dc.num_key_value_heads
    inv = 1.0 / dc.rope_theta ** (np.arange(0, hd, 2) / hd) / rope_factor

    def rms(v, g):
        return g * v / np.sqrt(np.mean(v * v) + eps)

    def rope(v, pos):
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        a, bb = v[:hd // 2], v[hd // 2:]
        return np.concatenate([a * c - bb * s, bb * c + a * s])

    ctx = [rms(w["fc.weight"] @ np.asarray(feats[p], np.float64), w["hidden_norm.weight"])
           for p in range(n_ctx)]
    x = [np.asarray(embed[pending], np.float64)] + [
        np.asarray(embed[dc.mask_token_id], np.float64) for _ in range(b - 1)]
    for li in range(dc.num_hidden_layers):
        p = f"layers.{li}."

        def W(n, p=p):
            return w[p + n]

        hs = [rms(v, W("input_layernorm.weight")) for v in x]
        keys = [[] for _ in range(nkv)]
        vals = [[] for _ in range(nkv)]
        for src, pos in [(ctx[t], t) for t in range(n_ctx)] + [(hs[j], n_ctx + j)
                                                                for j in range(b)]:
            kf, vf = W("self_attn.k_proj.weight") @ src, W("self_attn.v_proj.weight") @ src
            for g in range(nkv):
                keys[g].append(rope(rms(kf[g * hd:(g + 1) * hd], W("self_attn.k_norm.weight")),
                                    pos))
                vals[g].append(vf[g * hd:(g + 1) * hd])
        new = []
        for j in range(b):
            qf = W("self_attn.q_proj.weight") @ hs[j]
            heads = []
            for h in range(nq):
                q = rope(rms(qf[h * hd:(h + 1) * hd], W("self_attn.q_norm.weight")), n_ctx + j)
                g = h // (nq // nkv)
                scores = np.array([q @ k / np.sqrt(hd) for k in keys[g]])  # all keys: no mask
                pr = np.exp(scores - scores.max())
                pr /= pr.sum()
                heads.append(sum(pr[t] * vals[g][t] for t in range(len(pr))))
            y = x[j] + W("self_attn.o_proj.weight") @ np.concatenate(heads)
            h2 = rms(y, W("post_attention_layernorm.weight"))
            gate, up = W("mlp.gate_proj.weight") @ h2, W("mlp.up_proj.weight") @ h2
            new.append(y + W("mlp.down_proj.weight") @ (gate / (1 + np.exp(-gate)) * up))
        x = new
    return np.stack([np.asarray(lm_head, np.float64) @ rms(x[j], w["norm.weight"])
                     for j in range(1, b)])


@pytest.mark.parametrize("rope", ["plain", "linear"])
@pytest.mark.parametrize("n_ctx", [1, 11])
def test_drafter_forward_matches_a_brute_force_implementation(rope: str, n_ctx: int) -> None:
    rng = np.random.default_rng(n_ctx)
    cfg = drafter_config("tiny-qwen3-dflash", {"block_size": 5, "num_attention_heads": 4,
                                               "num_key_value_heads": 2})
    dc = DFlashConfig.from_dict(cfg)
    w = make_drafter_weights(cfg, seed=int(rng.integers(1 << 20)))
    h, v = dc.hidden_size, dc.vocab_size
    embed = rng.standard_normal((v, h)).astype(np.float32) * np.float32(2 / np.sqrt(h))
    lm_head = rng.standard_normal((v, h)).astype(np.float32) * np.float32(2 / np.sqrt(h))
    scaling = PLAIN_ROPE if rope == "plain" else RopeScaling("linear", 2.0, 4096)
    d = DFlashDrafter(DFlashCheckpoint(Path("."), dc, w), embed, lm_head, scaling)
    feats = rng.standard_normal((n_ctx, dc.capture_width)).astype(np.float32)
    pending = int(rng.integers(v))
    got = d.logits(feats, pending)
    want = _brute_force(dc, w, embed, lm_head, feats, pending, 2.0 if rope == "linear" else 1.0)
    assert got.shape == (dc.block_size - 1, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(d.propose(feats, pending), np.argmax(want, axis=-1))


# -- capture and the proposer --------------------------------------------------------------------
def test_captured_features_are_the_reference_layer_outputs(tiny: Path, drafter: Path) -> None:
    """At every proposal the features the proposer gathers through the page table equal the
    reference forward's outputs of layers target_layer_ids over the committed positions:
    prompts computed in chunks, decode rows, verify rows, prefix-cache hits (the second round
    shares the first's prefixes) and a pool small enough to preempt."""
    llm = LLM(str(tiny), backend="numpy", speculative_config=_spec(drafter),
              max_num_batched_tokens=24, num_gpu_blocks_override=12, max_model_len=96)
    eng = llm.engine
    prop = eng.scheduler.proposer
    assert isinstance(prop, DFlashProposer)
    assert eng.executor.capture is prop.features
    ref, ids = eng.executor.model, prop.drafter.config.target_layer_ids
    seen = {"calls": 0, "cached": 0, "preempted": 0}

    def checking(req, k):
        feats = prop.context_features(req)
        tokens = req.all_token_ids
        n = req.num_computed_tokens
        assert feats.shape == (n, 256) and len(tokens) == n + 1
        outs: list[np.ndarray] = []
        ref.forward(tokens[:n], outs)
        np.testing.assert_allclose(feats, np.concatenate([outs[i] for i in ids], axis=1),
                                   rtol=1e-4, atol=2e-4)
        seen["calls"] += 1
        seen["cached"] += req.num_cached_tokens > 0
        seen["preempted"] += req.num_preemptions > 0
        return prop(req, k)

    eng.scheduler.proposer = checking
    rng = np.random.default_rng(4)
    prefixes = [rng.integers(5, 300, 33).tolist() for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for _ in range(2):
        prompts = [p + rng.integers(5, 300, int(rng.integers(1, 6))).tolist() for p in prefixes]
        llm.generate(prompts, [greedy] * 4)
    assert seen["calls"] > 10 and seen["cached"] > 0
    assert eng.scheduler.num_preemptions > 0 and seen["preempted"] > 0
    _no_pages_left(llm)


@pytest.mark.parametrize("opts", [
    {},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 20},
    {"num_gpu_blocks_override": 12, "max_model_len": 64},
], ids=["prefix-cache", "no-cache-chunked", "preempting"])
def test_dflash_is_lossless_greedy_and_seeded(tiny: Path, drafter: Path, opts: dict) -> None:
    seed = int(np.random.default_rng().integers(1 << 20))
    prompts, params = _prompts(seed), _params(seed)
    plain = LLM(str(tiny), backend="numpy", **opts)
    spec = LLM(str(tiny), backend="numpy", speculative_config=_spec(drafter), **opts)
    rounds = [prompts, [p + [7, 8] for p in prompts[::2]]]  # round 2: cached prefixes
    for r in rounds:
        ps = params[:len(r)] if r is prompts else params[::2]
        want, got = plain.generate(r, ps), spec.generate(r, ps)
        assert _ids(got) == _ids(want), f"seed {seed}"
        drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in got)
        accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in got)
        assert drafted > 0 and 0 <= accepted <= drafted
    g = spec.engine.gauges()["spec"]
    assert g["draft_tokens"] > 0 and sum(g["accepted_per_draft"]) == g["drafts"]
    if "num_gpu_blocks_override" in opts:
        assert spec.engine.scheduler.num_preemptions > 0
    _no_pages_left(spec)


def test_oracle_drafter_output_is_accepted(tiny: Path, drafter: Path) -> None:
    """The drafter's output replaced by the plain run's continuation (the drafter still runs):
    every draft is accepted, the output is unchanged and takes fewer steps."""
    prompts, params = _prompts(21)[:4], _params(21)[2:6]  # greedy and seeded
    plain = LLM(str(tiny), backend="numpy")
    spec = LLM(str(tiny), backend="numpy", speculative_config=_spec(drafter))
    d = spec.engine.scheduler.proposer.drafter
    real = d.propose
    for prompt, sp in zip(prompts, params, strict=True):
        steps = plain.engine.stats.steps
        truth = prompt + plain.generate([prompt], [sp])[0].outputs[0].token_ids
        steps = plain.engine.stats.steps - steps

        def oracle(feats, pending, truth=truth):
            n = feats.shape[0]
            assert real(feats, pending).shape == (15,) and truth[n] == pending
            return np.array((truth[n + 1:n + 16] + [0] * 15)[:15])

        d.propose = oracle
        before = spec.engine.stats.steps
        out = spec.generate([prompt], [sp])[0]
        assert prompt + out.outputs[0].token_ids == truth
        m = out.metrics
        assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] == m["spec_draft_tokens"]
        assert spec.engine.stats.steps - before < steps
        d.propose = real


def test_blocks_past_max_model_len_decode_plainly(tiny: Path, drafter: Path,
                                                  monkeypatch) -> None:
    import engine.scheduler as sched

    monkeypatch.setattr(sched, "PROBATION_STEPS", 10 ** 6)  # keep drafting to the end
    prompt, sp = list(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=30,
                                                    ignore_eos=True)
    want = LLM(str(tiny), backend="numpy", max_model_len=40).generate([prompt], [sp])
    llm = LLM(str(tiny), backend="numpy", max_model_len=40, speculative_config=_spec(drafter))
    prop, calls = llm.engine.scheduler.proposer, []

    def spy(req, k):
        out = prop(req, k)
        calls.append((req.num_computed_tokens, len(out)))
        return out

    llm.engine.scheduler.proposer = spy
    assert _ids(llm.generate([prompt], [sp])) == _ids(want)
    assert any(n + 16 <= 40 and k > 0 for n, k in calls)
    assert any(n + 16 > 40 for n, _ in calls)
    assert all(k == 0 for n, k in calls if n + 16 > 40)


def test_the_two_process_engine_runs_dflash(tiny: Path, drafter: Path) -> None:
    prompts, params = _prompts(13)[:3], _params(13)[:3]
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    llm = LLM(str(tiny), backend="numpy", speculative_config=_spec(drafter),
              engine_core="process")
    try:
        got = llm.generate(prompts, params)
        assert _ids(got) == want
        assert sum(o.metrics.get("spec_draft_tokens", 0) for o in got) > 0
    finally:
        llm.shutdown()


def test_issue_681_scenario_with_dflash(tiny: Path, drafter: Path) -> None:
    llm = LLM(str(tiny), backend="numpy", num_gpu_blocks_override=161,
              enable_prefix_caching=False, max_model_len=2304,
              speculative_config={"method": "dflash", "model": str(drafter)})
    assert llm.engine.config.speculative_config.num_speculative_tokens == 15
    _issue_681(llm, np.random.default_rng(), llm.engine.model_config.vocab_size)
    g = llm.engine.gauges()["spec"]
    assert g["draft_tokens"] > 0 and g["drafts"] > 0
