"""Convert a Llama or Qwen3 GGUF file into a Hugging Face checkpoint directory.

The embedded default model ships only as a GGUF file (see ``fetch.py``). It is converted once into
the cache, and from then on it is an ordinary checkpoint for the loader and the tokenizer:

    config.json              LlamaForCausalLM / Qwen3ForCausalLM, transformers 4.x form, every
                             value from the metadata (RoPE scaling too: linear and yarn from
                             rope.scaling.*, Llama 3.1's llama3 from its rope_freqs factors)
    model.safetensors        bf16 weights (dequantized) under HF names
    tokenizer.json           byte-level BPE rebuilt from tokenizer.ggml.* with `tokenizers`
    tokenizer_config.json    bos/eos/unk/pad, add_bos_token, chat_template
    generation_config.json   bos/eos/pad ids

GGUF lists tensor dims fastest-first; the reader's arrays are already in numpy (row-major) order,
so ``[576, 49152]`` in the file is a ``(49152, 576)`` = HF ``[out, in]`` array here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from engine import envs
from engine.model import fetch

log = logging.getLogger(__name__)

# Bump when the output changes, so that stale conversions in users' caches are not reused.
CONVERTER_VERSION = 1

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# general.architecture -> (HF architecture, model_type). llama.cpp permutes Llama's Q/K rows
# (interleaved rotary layout); Qwen3 keeps HF's (neox) order.
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# Llama 3.1's llama3 RoPE (rope_scaling in its config.json); llama.cpp stores only the per-pair
# factors it implies (rope_freqs), which are matched against these with the factor found there.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# tokenizer.ggml.pre values whose split is GPT-2's byte-level regex, optionally after splitting
# digits one by one (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" then the GPT-2 regex).
_PRE_TOKENIZERS: dict[str, str | None] = {"gpt2": None, "default": None, "smollm": "digits"}
# tokenizer.ggml.pre values that split with a regex first (their tokenizer.json's Split), then
# map bytes (ByteLevel without its own regex): Qwen2/3 and Llama 3.
_SPLIT = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_PRE_TOKENIZERS.update({k: "split" for k in _SPLIT})
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFConvertError(ValueError):
    """A GGUF file this converter does not support. The message says what is supported."""


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as an HF checkpoint directory.

    Downloads and converts on first use (a few seconds, logged); instant afterwards.
    """
    gguf_path = fetch.smollm2_gguf_path()
    out = envs.cache_dir() / "models" / f"{gguf_path.stem}.hf-v{CONVERTER_VERSION}"
    if out.is_dir():  # directories appear only by rename, complete
        return out
    log.info("converting %s to a bf16 checkpoint in %s (once) ...", gguf_path.name, out)
    start = time.perf_counter()
    convert_gguf(gguf_path, out)
    log.info("converted in %.1f s", time.perf_counter() - start)
    return out


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """``--model file.gguf``: its HF checkpoint in the cache, converted on first use. The
    cache entry is keyed by the file's real path, size and modification time, so an edited or
    replaced file is converted again."""
    src = Path(gguf_path).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = envs.cache_dir() / "models" / f"{src.stem}-{key}.hf-v{CONVERTER_VERSION}"
    if out.is_dir():  # directories appear only by rename, complete
        return out
    log.info("converting %s to a bf16 checkpoint in %s (once) ...", src.name, out)
    start = time.perf_counter()
    convert_gguf(src, out)
    log.info("converted in %.1f s", time.perf_counter() - start)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF checkpoint of ``gguf_path`` to ``out_dir`` (which must not exist yet).

    The files are written into a temporary sibling directory that is renamed when complete.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it to convert again")
    try:
        return _convert(gguf_path, out_dir)
    except GGUFConvertError as e:
        raise GGUFConvertError(f"{gguf_path}: {e}") from None


def _convert(gguf_path: str | Path, out_dir: Path) -> Path:
    try:
        reader = GGUFReader(gguf_path)
        meta = read_metadata(reader)
    except (ValueError, IndexError, UnicodeDecodeError) as e:  # what gguf raises on bad bytes
        raise GGUFConvertError(f"not a readable GGUF file ({type(e).__name__}: {e})") from None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = hf_config(meta, {t.name for t in reader.tensors},
                       None if freqs is None else np.asarray(freqs.data, dtype=np.float64))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        save_file(convert_tensors(reader, config), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        for name, content in (("config.json", config),
                              ("tokenizer_config.json", tokenizer_config(meta)),
                              ("generation_config.json", generation_config(meta))):
            (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                    encoding="utf-8")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _field_value(field: ReaderField) -> Any:
    # What ReaderField.contents() returns in newer gguf releases (older ones lack it).
    def text(part: np.ndarray) -> str:
        return part.tobytes().decode("utf-8")

    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == GGUFValueType.STRING:
        return text(field.parts[-1])
    return field.parts[-1].tolist()[0]


def _f32(value: float) -> float:
    # Metadata floats are float32: 1e-5 is stored as 9.99999974e-06. Keep the shortest repr.
    return float(str(np.float32(value)))


def hf_config(meta: dict[str, Any], tensor_names: set[str],
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """``config.json`` contents, every hyperparameter from the GGUF metadata (``rope_freqs``:
    the rope_freqs.weight tensor, if the file has one)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFConvertError(f"GGUF architecture {arch!r} is not supported: use a "
                               f"{' or '.join(repr(a) for a in _ARCHITECTURES)} GGUF")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFConvertError(f"GGUF metadata lacks {arch}.{key}")
        return value

    def num(key: str, default: Any = None, kind: type = int) -> Any:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GGUFConvertError(f"GGUF metadata {arch}.{key} must be a number, got "
                                   f"{value!r:.40}")
        return kind(value)

    if isinstance(meta.get(f"{arch}.attention.head_count_kv"), list):
        raise GGUFConvertError("per-layer attention.head_count_kv is not supported")
    hidden, n_head = num("embedding_length"), num("attention.head_count")
    if n_head < 1:
        raise GGUFConvertError(f"GGUF metadata {arch}.attention.head_count must be >= 1")
    n_kv = num("attention.head_count_kv", n_head)
    head_dim = num("attention.key_length", hidden // n_head)
    if num("rope.dimension_count", head_dim) != head_dim:
        raise GGUFConvertError("partial rotary embeddings (rope.dimension_count) are not supported")
    theta = _f32(num("rope.freq_base", 10000.0, kind=float))
    rope_scaling = _rope_scaling(meta, arch, theta, head_dim, rope_freqs)
    if int(meta.get(f"{arch}.expert_count", 0)):
        raise GGUFConvertError("mixture-of-experts GGUFs are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab:
        raise GGUFConvertError(f"GGUF metadata gives no vocabulary size ({arch}.vocab_size)")
    hf_arch, model_type = _ARCHITECTURES[arch]
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length"),
        "num_hidden_layers": num("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(num("attention.layer_norm_rms_epsilon", kind=float)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": num("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        **_special_ids(meta),
        "torch_dtype": "bfloat16",
    }


def _rope_scaling(meta: dict[str, Any], arch: str, theta: float, head_dim: int,
                  rope_freqs: np.ndarray | None) -> dict[str, Any] | None:
    """config.json's rope_scaling (4.x form) from the metadata, or None for plain RoPE."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        if kind != "none":
            raise GGUFConvertError(f"rope_freqs together with rope.scaling.type {kind!r} is not "
                                   "supported")
        return _llama3_from_factors(rope_freqs, theta, head_dim)
    if kind == "none":
        return None
    if kind not in ("linear", "yarn") or not isinstance(factor, int | float):
        raise GGUFConvertError(f"RoPE scaling {kind!r} (factor {factor!r}) is not supported: "
                               "linear and yarn with a rope.scaling.factor are")
    out: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and orig:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _llama3_from_factors(found: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 rope_scaling whose per-pair factors (llama.cpp's rope_freqs, computed as its
    convert_hf_to_gguf.py does) are ``found``."""
    factor = float(found.max())
    p = {"rope_type": "llama3", "factor": _f32(factor), **_LLAMA3_ROPE}
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = p["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"]
                                                        - p["low_freq_factor"])
    want = np.where(wavelen < old / p["high_freq_factor"], 1.0,
                    np.where(wavelen > old / p["low_freq_factor"], factor,
                             1 / ((1 - smooth) / factor + smooth)))
    if found.shape != want.shape or not np.allclose(found, want, rtol=1e-3):
        raise GGUFConvertError("rope_freqs (per-frequency RoPE factors) that are not Llama 3.1's "
                               "llama3 scaling are not supported")
    return p


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, ``LlamaModel.permute``).

    The converter maps HF's half-split (neox) rotary layout to GGML's interleaved one, per head:
    ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``, i.e. the
    row at (head h, half a, index i) moves to (h, i, a). Here (h, i, a) goes back to (h, a, i).
    """
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        raise GGUFConvertError(f"tensor {gguf_name}: only weights (no biases) are supported")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise GGUFConvertError(f"tensor {gguf_name} has no place in a LlamaForCausalLM checkpoint")


def convert_tensors(reader: GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor dequantized, Q/K un-permuted, as bf16 under its HF name."""
    out: dict[str, np.ndarray] = {}
    permuted = config["model_type"] == "llama"
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # rope_scaling in config.json instead
            continue
        name = hf_tensor_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        w = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = w.astype(ml_dtypes.bfloat16)
    return out


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
            "pad_token_id": "padding_token_id"}
    return {hf: int(meta[f"tokenizer.ggml.{k}"]) for hf, k in keys.items()
            if f"tokenizer.ggml.{k}" in meta}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """``tokenizer.json`` from the GGUF's byte-level BPE vocabulary and merges."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise GGUFConvertError(f"tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') "
                               "tokenizers are supported")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConvertError(f"tokenizer.ggml.pre {pre!r} is not supported; "
                               f"supported: {sorted(_PRE_TOKENIZERS)}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFConvertError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre] == "digits":
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              byte_level])
    elif _PRE_TOKENIZERS[pre] == "split":
        split = pre_tokenizers.Split(Regex(_SPLIT[pre]), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.pre_tokenizer = byte_level
    if pre == "qwen2":  # Qwen's tokenizer.json normalizes to NFC first
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_end|>...) are special: matched whole, skipped when decoding with
    # skip_special_tokens. User-defined ones are matched whole but are ordinary text.
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFConvertError("rebuilt tokenizer size differs from the GGUF vocabulary")
    return tk


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
    }
    if "llama.context_length" in meta:
        config["model_max_length"] = int(meta["llama.context_length"])
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    ids = _special_ids(meta)
    eos = [ids[k] for k in ("eos_token_id",) if k in ids]
    eot = meta.get("tokenizer.ggml.eot_token_id")  # end-of-turn also ends generation
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids
