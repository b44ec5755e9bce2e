"""ModelConfig parsing (both transformers config forms) and the checkpoint loader's error paths."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.model.loader import CheckpointError, load_checkpoint
from engine.model.safetensors_io import open_tensors, save_file
from tools.make_checkpoint import hf_config, write_checkpoint


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "tiny-llama", "small-llama"])
def test_both_config_forms_parse_the_same(preset):
    a = ModelConfig.from_dict(hf_config(preset, 4))
    b = ModelConfig.from_dict(hf_config(preset, 5))
    assert a == b
    assert a.rope_theta == hf_config(preset, 4)["rope_theta"]


def test_qwen3_and_llama_details():
    q = ModelConfig.from_dict(hf_config("qwen3-0.6b"))
    assert (q.architecture, q.qk_norm, q.head_dim, q.tie_word_embeddings) == ("qwen3", True, 128,
                                                                              True)
    assert q.q_size == 2048 and q.kv_size == 1024 and q.gqa_ratio == 2
    assert 0.59e9 < q.num_parameters < 0.61e9
    cfg = hf_config("tiny-llama")
    del cfg["head_dim"]
    ll = ModelConfig.from_dict(cfg)
    assert ll.architecture == "llama" and not ll.qk_norm and ll.head_dim == 256 // 4


def test_eos_ids_merged_from_generation_config():
    cfg = hf_config("qwen3-0.6b")
    m = ModelConfig.from_dict(cfg, {"eos_token_id": [151645, 151643]})
    assert m.eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["MistralForCausalLM"]}, "Qwen3ForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple of"),
])
def test_unsupported_configs_are_named(change, needle):
    cfg = hf_config("qwen3-0.6b")
    cfg.update(change)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(cfg)


def test_rope_scaling_in_v5_form_is_refused():
    cfg = hf_config("qwen3-0.6b", 5)
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope scaling 'linear'"):
        ModelConfig.from_dict(cfg)


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="backend"):
        EngineConfig(backend="tpu")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ConfigError, match="unknown engine option"):
        EngineConfig.from_kwargs(max_num_seq=4)
    m = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        EngineConfig(max_model_len=10**6).resolve(m)
    assert EngineConfig().resolve(m).max_model_len == m.max_position_embeddings


@pytest.fixture()
def tiny(tmp_path):
    return write_checkpoint(tmp_path / "m", "tiny-qwen3", quiet=True)


def test_sharded_load_equals_single(tmp_path):
    one = load_checkpoint(write_checkpoint(tmp_path / "a", "tiny-llama", quiet=True))
    many_dir = write_checkpoint(tmp_path / "b", "tiny-llama", max_shard_bytes=200_000, quiet=True)
    assert (many_dir / "model.safetensors.index.json").is_file()
    assert len(list(many_dir.glob("*.safetensors"))) > 2
    many = load_checkpoint(many_dir)
    assert one.tensors.keys() == many.tensors.keys()
    for k in one.tensors:
        np.testing.assert_array_equal(one[k], many[k])


def _rewrite(d, fn):
    path = d / "model.safetensors"
    t = {k: np.array(v) for k, v in open_tensors(path).items()}
    fn(t)
    save_file(t, path)


def test_missing_and_unexpected_and_wrong_shape_listed_together(tiny):
    def damage(t):
        del t["model.layers.0.mlp.up_proj.weight"]
        k = "model.layers.1.self_attn.k_proj.weight"
        t[k] = t[k][:5]
        t["model.layers.0.self_attn.extra.weight"] = t["model.norm.weight"]

    _rewrite(tiny, damage)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny)
    msg = str(e.value)
    assert "missing tensor model.layers.0.mlp.up_proj.weight" in msg
    assert "model.layers.1.self_attn.k_proj.weight has shape [5, 128], expected [128, 128]" in msg
    assert "unexpected tensor model.layers.0.self_attn.extra.weight" in msg
    assert len(e.value.problems) == 3


def test_wrong_dtype(tiny):
    _rewrite(tiny, lambda t: t.__setitem__("model.norm.weight", np.ones(128, np.int32)))
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype int32"):
        load_checkpoint(tiny)


def test_unsupported_architecture_in_checkpoint(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported"):
        load_checkpoint(tiny)


@pytest.mark.parametrize("corruption", ["huge_length", "bad_json", "bad_offsets", "truncated"])
def test_corrupt_header(tiny, corruption):
    path = tiny / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if corruption == "huge_length":
        raw[:8] = struct.pack("<Q", len(raw) * 2)
    elif corruption == "bad_json":
        raw[8:12] = b"{{{{"
    elif corruption == "bad_offsets":
        header = json.loads(raw[8:8 + n])
        k = next(iter(k for k in header if k != "__metadata__"))
        header[k]["data_offsets"][1] += 2
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        raw = bytearray(struct.pack("<Q", len(hb))) + hb + raw[8 + n:]
    else:
        raw = raw[:4]
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt header"):
        load_checkpoint(tiny)


def test_no_weights_and_missing_shard(tmp_path, tiny):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(tmp_path)
