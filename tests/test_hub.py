"""``--model``: hub ids and GGUF files.

``Org/Name`` resolves through huggingface_hub against a Hugging Face cache directory built here
(``models--Org--Name/{blobs,snapshots/<commit>,refs/main}``), never the network: offline
(HF_HUB_OFFLINE=1) and with an unreachable hub (HF_ENDPOINT at a closed port). huggingface_hub
reads its variables when it is imported, so those cases run in a subprocess. ``file.gguf``
(Llama, Qwen3) is converted once into the cache, from synthetic GGUFs written with gguf."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGUFWriter, RopeScalingType
from safetensors.numpy import load_file

from engine.api import LLM, SamplingParams
from engine.config import ModelConfig
from engine.model.gguf_convert import GGUFConvertError
from engine.model.hub import is_hub_id, model_name, resolve_model
from engine.model.loader import load_checkpoint
from engine.model.synthetic import write_checkpoint
from engine.tokenizer import Tokenizer
from tests.test_gguf_convert import (
    FFN,
    GGUF_NAMES,
    HEAD_DIM,
    HIDDEN,
    LAYERS,
    MERGES,
    N_HEAD,
    N_KV,
    TOKENS,
    TYPES,
    hf_weights,
    permute,
)

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo_id: str) -> Path:
    """A hub cache holding a tiny checkpoint as ``repo_id``, laid out as huggingface_hub lays
    it out (files in blobs/ by hash, the snapshot's files symlinks to them). Returns the
    snapshot directory."""
    src = write_checkpoint(root / "src", "tiny-qwen3", quiet=True)
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(cache),
            "HF_HOME": str(cache.parent / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hub")
    return fake_hub_cache(root, "TestOrg/Tiny-Qwen3"), root / "hub"


GENERATE = """
from engine.api import LLM, SamplingParams
llm = LLM(model="TestOrg/Tiny-Qwen3", backend="numpy", max_model_len=64)
print(llm.engine.model_dir)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
"""


def test_offline_resolves_from_the_cache_and_runs(hub: tuple[Path, Path]) -> None:
    snap, cache = hub
    r = run(GENERATE, cache, HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(snap), "3"]


def test_unreachable_hub_falls_back_to_the_cache(hub: tuple[Path, Path]) -> None:
    snap, cache = hub
    code = "from engine.model.hub import resolve_model; print(resolve_model('TestOrg/Tiny-Qwen3'))"
    r = run(code, cache, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(snap)


def cli_error(cache: Path, **env: str) -> tuple[int, str]:
    r = run("import sys; from engine.cli import main; "
            "sys.exit(main(['generate', 'hi', '--model', 'TestOrg/Missing', '--backend', "
            "'numpy']))", cache, **env)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[cuteinfer]")]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    return r.returncode, lines[0]


def test_offline_miss_is_one_line_saying_what_to_do(hub: tuple[Path, Path]) -> None:
    _, cache = hub
    code, line = cli_error(cache, HF_HUB_OFFLINE="1")
    assert code == 1 and line.startswith("cuteinfer: error: 'TestOrg/Missing' is not a local")
    assert f"not in the Hugging Face cache ({cache})" in line
    assert "HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE" in line
    assert "hf download TestOrg/Missing" in line


def test_unreachable_miss_says_the_hub_could_not_be_reached(hub: tuple[Path, Path]) -> None:
    _, cache = hub
    code, line = cli_error(cache, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert code == 1 and "'TestOrg/Missing'" in line and str(cache) in line
    assert "the hub could not be reached" in line and "HF_ENDPOINT" in line


def test_what_is_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B-Instruct", "gpt2"):
        assert is_hub_id(name), name
    for name in ("/abs/path", "./rel", "../up", "~/m", "a/b/c", "Org/Na--me", "Org/x.git", ""):
        assert not is_hub_id(name), name
    # a local directory wins over the hub id it looks like; a path that is no hub id stays a path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert resolve_model("Org/Name") == Path("Org/Name")
    assert resolve_model("./missing/dir/x") == Path("missing/dir/x")
    # the server's default served name: the hub id, as vLLM serves it; else the file's or dir's
    snap = Path("/c/models--Qwen--Qwen3-0.6B/snapshots") / COMMIT
    assert model_name("Qwen/Qwen3-0.6B", snap) == "Qwen/Qwen3-0.6B"
    assert model_name("Org/Name", Path("Org/Name")) == "Name"  # the local directory
    assert model_name("/m/SmolLM2.Q4.gguf", Path("/cache/x.hf-v1")) == "SmolLM2.Q4"
    assert model_name("", Path("/cache/default.hf-v1")) == "default.hf-v1"


# -- --model file.gguf: Llama and Qwen3 GGUF files through the converter --------------------------
def write_gguf(path: Path, arch: str, weights: dict, *, theta: float = 50000.0,
               pre: str = "smollm", rope_freqs: np.ndarray | None = None,
               scaling: tuple[str, float] | None = None) -> None:
    """A GGUF as llama.cpp's converter writes it (tests/test_gguf_convert.py's shapes and
    vocabulary): Llama's Q/K rows permuted, Qwen3's kept, with its q/k norms."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    if scaling is not None:
        w.add_rope_scaling_type(RopeScalingType(scaling[0]))
        w.add_rope_scaling_factor(scaling[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {**GGUF_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, x in weights.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                x = permute(x, N_HEAD if module == "self_attn.q_proj" else N_KV)
            gname = f"blk.{i}.{names[module]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight":
                     "output.weight", "model.norm.weight": "output_norm.weight"}[name]
        w.add_tensor(gname, x if x.ndim == 1 else x.astype(np.float16))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def qwen3_weights() -> dict:
    weights = hf_weights(tied=True)
    rng = np.random.default_rng(3)
    for i in range(LAYERS):
        for n in ("q_norm", "k_norm"):
            x = (1 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(ml_dtypes.bfloat16)
            weights[f"model.layers.{i}.self_attn.{n}.weight"] = x.astype(np.float32)
    return weights


def llama3_factors(theta: float, factor: float) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1's llama3 scaling (convert_hf_to_gguf.py)."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CUTEINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_model_is_converted_once_and_runs(tmp_path: Path, cache: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, "llama", hf_weights(tied=False))
    llm = LLM(model=str(gguf), backend="numpy")
    d = llm.engine.model_dir
    assert d.parent == cache / "models" and d.name.startswith("tiny-")
    assert llm.engine.model_config.architecture == "llama"
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    made = (d / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(gguf)) == d and (d / "model.safetensors").stat().st_mtime_ns == made
    write_gguf(gguf, "llama", hf_weights(tied=True))  # a changed file is converted again
    assert resolve_model(str(gguf)) != d


def test_qwen3_gguf(tmp_path: Path, cache: Path) -> None:
    weights = qwen3_weights()
    write_gguf(tmp_path / "q.gguf", "qwen3", weights, pre="qwen2", theta=1e6)
    d = resolve_model(str(tmp_path / "q.gguf"))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == HEAD_DIM
    tensors = load_file(str(d / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.self_attn.k_norm.weight"):  # no Q/K permutation to undo
        np.testing.assert_array_equal(tensors[name].astype(np.float32), weights[name], name)
    assert load_checkpoint(d).config.qk_norm
    tok = Tokenizer.from_pretrained(d)
    assert tok is not None
    assert [TOKENS[i] for i in tok.encode("hello world!12")] == ["hello", "Ġworld", "!", "1",
                                                                 "2"]


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path: Path, cache: Path) -> None:
    write_gguf(tmp_path / "l.gguf", "llama", hf_weights(tied=True), theta=500000.0,
               pre="llama-bpe", rope_freqs=llama3_factors(500000.0, 8.0))
    d = resolve_model(str(tmp_path / "l.gguf"))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in load_file(str(d / "model.safetensors"))
    assert ModelConfig.from_pretrained(d).rope_scaling.rope_type == "llama3"
    tok = Tokenizer.from_pretrained(d)
    assert tok is not None and [TOKENS[i] for i in tok.encode("12")] == ["12"]  # \p{N}{1,3}
    write_gguf(tmp_path / "x.gguf", "llama", hf_weights(tied=True),
               rope_freqs=np.array([1.0, 2.0, 1.0, 3.0]))
    with pytest.raises(GGUFConvertError, match="not Llama 3.1's llama3 scaling"):
        resolve_model(str(tmp_path / "x.gguf"))
    write_gguf(tmp_path / "lin.gguf", "llama", hf_weights(tied=True), scaling=("linear", 2.0))
    lin = json.loads((resolve_model(str(tmp_path / "lin.gguf")) / "config.json").read_text())
    assert lin["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
