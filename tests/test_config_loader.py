"""ModelConfig parsing (both transformers config forms) and the checkpoint loader's error paths."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.args import EngineArgs
from engine.config import ConfigError, ModelConfig
from engine.model.loader import CheckpointError, load_checkpoint
from engine.model.safetensors_io import open_tensors, save_file
from engine.model.synthetic import hf_config, write_checkpoint


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
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "rope_scaling.rope_type 'longrope' is not supported; supported rope types: default, "
     "linear, dynamic, yarn, llama3"),
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


def test_unknown_rope_scaling_in_v5_form_is_refused():
    cfg = hf_config("qwen3-0.6b", 5)
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_parameters.rope_type 'longrope' is not supp"):
        ModelConfig.from_dict(cfg)


def test_engine_config_validation():
    m = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    with pytest.raises(ConfigError, match="backend"):
        EngineArgs(backend="tpu").create_engine_config(m)
    with pytest.raises(ConfigError, match="block_size"):
        EngineArgs(block_size=12).create_engine_config(m)
    with pytest.raises(ConfigError, match="unknown engine option"):
        EngineArgs.from_kwargs(max_num_seq=4)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        EngineArgs(max_model_len=10**6).create_engine_config(m)
    assert EngineArgs().create_engine_config(m).max_model_len == m.max_position_embeddings


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


# -- shard paths stay inside the checkpoint (issue 11) -----------------------------------------
def _record_opens(monkeypatch):
    """Every shard the loader opens, and every file the safetensors reader opens."""
    import engine.model.loader as loader
    import engine.model.safetensors_io as st

    opened: list[str] = []
    real_open_tensors, real_memmap = loader.open_tensors, np.memmap

    def open_tensors_spy(path):
        opened.append(str(path))
        return real_open_tensors(path)

    class MemmapSpy(np.memmap):
        def __new__(cls, filename, *a, **k):
            opened.append(str(filename))
            return real_memmap.__new__(real_memmap, filename, *a, **k)

    monkeypatch.setattr(loader, "open_tensors", open_tensors_spy)
    monkeypatch.setattr(st.np, "memmap", MemmapSpy)
    return opened


def _index_naming(tiny, bad: str) -> None:
    """Turn the single-file checkpoint into an indexed one whose model.norm.weight lives at
    ``bad``, with a valid copy of the weights there, so only the path check can refuse it."""
    names = list(open_tensors(tiny / "model.safetensors"))
    wm = {n: "model.safetensors" for n in names}
    wm["model.norm.weight"] = bad
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors",
                                   "sub/../../outside.safetensors", "linked.safetensors",
                                   "..\\outside.safetensors"])
def test_index_shard_outside_the_checkpoint_is_refused_unopened(tiny, monkeypatch, entry):
    outside = tiny.parent / "outside.safetensors"
    outside.write_bytes((tiny / "model.safetensors").read_bytes())
    (tiny / "sub").mkdir()
    (tiny / "linked.safetensors").symlink_to(outside)  # an innocent name, resolving outside
    _index_naming(tiny, entry)
    opened = _record_opens(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny)
    assert opened == []  # refused before any shard was opened
    msg = str(e.value)
    assert f"shard {entry!r} (tensor model.norm.weight)" in msg
    assert "inside the checkpoint directory" in msg


def test_single_file_symlinked_outside_is_refused(tiny, tmp_path, monkeypatch):
    outside = tmp_path / "elsewhere.safetensors"
    (tiny / "model.safetensors").rename(outside)
    (tiny / "model.safetensors").symlink_to(outside)
    opened = _record_opens(monkeypatch)
    with pytest.raises(CheckpointError, match="model.safetensors resolves to .*outside"):
        load_checkpoint(tiny)
    assert opened == []


def test_hub_cache_snapshot_symlinks_into_blobs_load(tmp_path):
    """huggingface_hub's layout: snapshot files are symlinks into ../../blobs; that is allowed."""
    repo = tmp_path / "models--org--tiny"
    src = write_checkpoint(tmp_path / "src", "tiny-qwen3", max_shard_bytes=200_000, quiet=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in src.iterdir():
        blob = repo / "blobs" / f"sha-{f.name}"
        f.rename(blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    assert len(load_checkpoint(snap).tensors) > 0


def test_fifo_shard_is_not_opened(tiny):
    os.mkfifo(tiny / "pipe.safetensors")  # opening it would block forever
    _index_naming(tiny, "pipe.safetensors")
    with pytest.raises(CheckpointError, match="'pipe.safetensors'.*not a regular file"):
        load_checkpoint(tiny)


# -- config fields are type-checked (issue 11) -------------------------------------------------
def _write_config(d, change=None, drop=(), gen=None):
    cfg = hf_config("tiny-qwen3")
    cfg.update(change or {})
    for k in drop:
        del cfg[k]
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.mark.parametrize("change,field,got", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "'false' (a string)"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings", "0 (an integer)"),
    ({"attention_bias": "false"}, "attention_bias", "'false' (a string)"),
    ({"use_sliding_window": "no"}, "use_sliding_window", "'no' (a string)"),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps", "'abc' (a string)"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", "nan"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", "0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "-1e-06"),
    ({"rms_norm_eps": True}, "rms_norm_eps", "True (a boolean)"),
    ({"rope_theta": 0.0}, "rope_theta", "0.0"),
    ({"rope_theta": -10000.0}, "rope_theta", "-10000.0"),
    ({"rope_theta": float("inf")}, "rope_theta", "inf"),
    ({"rope_theta": 10 ** 400}, "rope_theta", "1000"),
    ({"rope_theta": "1e6"}, "rope_theta", "'1e6' (a string)"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "0"),
    ({"max_position_embeddings": 4096.0}, "max_position_embeddings", "4096.0 (a number)"),
    ({"hidden_size": True}, "hidden_size", "True (a boolean)"),
    ({"hidden_size": "128"}, "hidden_size", "'128' (a string)"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers", "2.0 (a number)"),
    ({"num_key_value_heads": [2]}, "num_key_value_heads", "[2] (an array)"),
    ({"head_dim": 64.5}, "head_dim", "64.5 (a number)"),
    ({"vocab_size": None}, "vocab_size", "is missing"),
    ({"eos_token_id": "2"}, "eos_token_id", "'2' (a string)"),
    ({"eos_token_id": [2, "3"]}, "eos_token_id", "[2, '3'] (an array)"),
    ({"eos_token_id": True}, "eos_token_id", "True (a boolean)"),
    ({"eos_token_id": -1}, "eos_token_id", "-1 (an integer)"),
    ({"bos_token_id": "1"}, "bos_token_id", "'1' (a string)"),
    ({"pad_token_id": 1.5}, "pad_token_id", "1.5 (a number)"),
    ({"architectures": "Qwen3ForCausalLM"}, "architectures", "(a string)"),
    ({"architectures": [["Qwen3ForCausalLM"]]}, "architectures", "(an array)"),
    ({"hidden_act": 5}, "hidden_act", "5 (an integer)"),
    ({"layer_types": "full_attention"}, "layer_types", "'full_attention' (a string)"),
    ({"rope_scaling": "yarn"}, "rope_scaling", "'yarn' (a string)"),
    ({"rope_parameters": {"rope_theta": "1e6"}}, "rope_parameters.rope_theta", "'1e6'"),
    ({"torch_dtype": 16}, "torch_dtype", "16 (an integer)"),
])
def test_config_field_types_are_checked(tmp_path, change, field, got):
    d = _write_config(tmp_path / "m", change)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(d)
    msg = str(e.value)
    assert msg.startswith(str(d / "config.json")) and field in msg and got in msg, msg


def test_generation_config_fields_are_checked(tmp_path):
    d = _write_config(tmp_path / "m", gen={"eos_token_id": [2, "7"]})
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id must be"):
        ModelConfig.from_pretrained(d)


def test_json_null_means_the_default_and_valid_configs_still_load(tmp_path):
    d = _write_config(tmp_path / "m", {"pad_token_id": None, "rope_scaling": None,
                                       "head_dim": None, "num_key_value_heads": None,
                                       "attention_bias": None, "rms_norm_eps": 1},
                      gen={"eos_token_id": [2, 7], "pad_token_id": None})
    m = ModelConfig.from_pretrained(d)
    assert (m.head_dim, m.num_key_value_heads, m.rms_norm_eps) == (32, 4, 1.0)
    assert m.eos_token_ids == (2, 7) and m.pad_token_id is None


def test_direct_construction_checks_values_too():
    base = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    from dataclasses import replace

    for change in ({"rms_norm_eps": float("nan")}, {"rope_theta": 0.0},
                   {"tie_word_embeddings": "false"}, {"hidden_size": True},
                   {"eos_token_ids": (True,)}):
        with pytest.raises(ConfigError, match=next(iter(change)).rstrip("s")):
            replace(base, **change)


# -- malformed files: a typed error naming the file (issue 11) ---------------------------------
def _tokenizer_json(d):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<s>": 1, "</s>": 2}, unk_token="a")).save(
        str(d / "tokenizer.json"))


_BAD_FILES = [
    # (file, contents, error type name, words the message must contain)
    ("config.json", b"[1, 2]", "ConfigError", "must hold a JSON object"),
    ("config.json", b"42", "ConfigError", "got an integer"),
    ("config.json", b'"qwen3"', "ConfigError", "got a string"),
    ("config.json", b"null", "ConfigError", "got null"),
    ("config.json", b'{"hidden_size": \xff}', "ConfigError", "not UTF-8 text (byte 0xff"),
    ("config.json", b"{", "ConfigError", "not valid JSON"),
    ("config.json", b"1" * 5000, "ConfigError", "not valid JSON"),
    ("config.json", b"[" * 100_000, "ConfigError", "not valid JSON"),
    ("config.json", b'{"rope_theta": 1, "rope_theta": 2}', "ConfigError",
     "'rope_theta' is given twice"),
    ("generation_config.json", b"{not json", "ConfigError", "not valid JSON"),
    ("generation_config.json", b"\xff\xfe", "ConfigError", "not UTF-8"),
    ("generation_config.json", b"[]", "ConfigError", "must hold a JSON object"),
    ("tokenizer_config.json", b"\xff", "TokenizerError", "not UTF-8"),
    ("tokenizer_config.json", b"[]", "TokenizerError", "must hold a JSON object"),
    ("tokenizer_config.json", b"{", "TokenizerError", "not valid JSON"),
    ("tokenizer_config.json", b'{"add_bos_token": "false"}', "TokenizerError",
     "add_bos_token must be a JSON boolean"),
    ("tokenizer_config.json", b'{"eos_token": 5}', "TokenizerError", "eos_token must be"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "default"}]}', "TokenizerError",
     "chat_template must be"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "TokenizerError", "chat_template must"),
    ("chat_template.jinja", b"{{ \xff }}", "TokenizerError", "cannot be read as UTF-8"),
    ("model.safetensors.index.json", b"\xff", "CheckpointError", "not UTF-8"),
    ("model.safetensors.index.json", b"[]", "CheckpointError", "weight_map"),
    ("model.safetensors.index.json", b'{"weight_map": []}', "CheckpointError", "weight_map"),
    ("model.safetensors.index.json", b'{"weight_map": {"model.norm.weight": 5}}',
     "CheckpointError", "weight_map['model.norm.weight'] is an integer"),
    ("model.safetensors.index.json", b'{"weight_map": {"model.norm.weight": ""}}',
     "CheckpointError", "not a file name"),
]


@pytest.mark.parametrize("name,content,error,needle", _BAD_FILES,
                         ids=[f"{n}-{c[:16]!r}" for n, c, _, _ in _BAD_FILES])
def test_malformed_files_raise_typed_errors_naming_the_file(tiny, name, content, error, needle):
    from engine.tokenizer import Tokenizer

    _tokenizer_json(tiny)
    (tiny / name).write_bytes(content)
    load = Tokenizer.from_pretrained if "tokenizer" in name or "jinja" in name else load_checkpoint
    with pytest.raises(Exception) as e:
        load(tiny)
    assert type(e.value).__name__ == error, repr(e.value)
    msg = str(e.value)
    assert (name in msg or str(tiny) in msg) and needle in msg, msg


def _header_file(path, header, data_len=16):
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * data_len)
    return path


_BAD_HEADERS = [
    # (header, words the message must contain)
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": ["0", "16"]}}, "data_offsets"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [False, 16]}}, "data_offsets"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16.0]}}, "data_offsets"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [16, 0]}}, "data_offsets"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 8, 16]}}, "data_offsets"),
    ({"w": {"dtype": "F16", "shape": "8", "data_offsets": [0, 16]}}, "shape"),
    ({"w": {"dtype": "F16", "shape": [-2, -4], "data_offsets": [0, 16]}}, "shape"),
    ({"w": {"dtype": "F16", "shape": [True, 8], "data_offsets": [0, 16]}}, "shape"),
    ({"w": {"dtype": "F16", "shape": [8.0], "data_offsets": [0, 16]}}, "shape"),
    ({"w": {"dtype": "F16", "shape": [2 ** 62, 4], "data_offsets": [0, 0]}}, "do not fit"),
    ({"w": {"dtype": ["F16"], "shape": [8], "data_offsets": [0, 16]}}, "dtype"),
    ({"w": {"dtype": "F8", "shape": [8], "data_offsets": [0, 16]}}, "dtype"),
    ({"w": {"shape": [8], "data_offsets": [0, 16]}}, "dtype"),
    ({"w": 5}, "not an object"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}, "__metadata__": "pt"},
     "__metadata__"),
    ({"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]},
      "__metadata__": {"format": 1}}, "__metadata__"),
    (b'{"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}, '
     b'"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}}', "'w' appears twice"),
    (b"[1, 2]", "got an array"),
    (b'"w"', "got a string"),
    (b'{"w": "\xff"}', "not valid UTF-8 JSON"),
]


@pytest.mark.parametrize("header,needle", _BAD_HEADERS,
                         ids=[f"h{i}" for i in range(len(_BAD_HEADERS))])
def test_malformed_safetensors_headers_name_the_file_and_tensor(tmp_path, header, needle):
    from engine.model.safetensors_io import SafetensorsError

    path = _header_file(tmp_path / "x.safetensors", header)
    with pytest.raises(SafetensorsError) as e:
        open_tensors(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: corrupt header") and needle in msg, msg
    if isinstance(header, dict) and "w" in header and "__metadata__" not in header:
        assert "tensor 'w'" in msg, msg


def test_bad_safetensors_header_through_the_loader_names_the_shard(tiny):
    _header_file(tiny / "model.safetensors",
                 {"model.norm.weight": {"dtype": "BF16", "shape": [128],
                                        "data_offsets": ["0", "256"]}}, 256)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt header \(tensor "
                                              r"'model\.norm\.weight': data_offsets"):
        load_checkpoint(tiny)


def test_missing_model_dir_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 4])
def test_corrupt_gguf_is_a_typed_error_naming_the_file(tmp_path, content):
    from engine.model.gguf_convert import GGUFConvertError, convert_gguf

    (tmp_path / "m.gguf").write_bytes(content)
    with pytest.raises(GGUFConvertError, match=r"m\.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp16_and_fp32_checkpoints_load_as_bf16_with_a_notice(tmp_path, caplog, dtype):
    d = write_checkpoint(tmp_path / "m", "tiny-qwen3", quiet=True)
    f = d / "model.safetensors"
    tensors = {k: np.asarray(v, dtype=np.float32).astype(dtype)
               for k, v in open_tensors(f).items()}
    f.unlink()
    save_file(tensors, f)
    with caplog.at_level("WARNING", logger="engine.model.loader"):
        ck = load_checkpoint(d)
    assert {str(t.dtype) for t in ck.tensors.values()} == {"bfloat16"}
    [rec] = [r for r in caplog.records if r.name == "engine.model.loader"]
    assert f"its {np.dtype(dtype).name} weights are converted to bfloat16" in rec.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.model.loader"):
        load_checkpoint(write_checkpoint(tmp_path / "b", "tiny-qwen3", quiet=True))
    assert not caplog.records  # a bf16 checkpoint loads silently
