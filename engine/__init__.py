"""cuteinfer: LLM inference for Qwen3 and Llama-family models on Hopper GPUs.

The public API follows vLLM: ``from engine import LLM, SamplingParams``.
Imports are lazy so that ``engine.kv`` (pure Python) and the CLI start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from engine.api import LLM, CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine import api

        return getattr(api, name)
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
