"""EngineArgs: the engine options as a user gives them (vLLM's names), resolved once into the
concrete, checked ``EngineConfig`` the engine runs with.

    args = EngineArgs.from_kwargs(max_num_seqs=8)          # LLM(model, backend, **options)
    EngineArgs.add_cli_args(parser)                        # generate / serve: a flag per field
    args = EngineArgs.from_cli_args(parser.parse_args())
    config = args.create_engine_config(model_config)       # "auto" resolved, checks run, here

Each option is written once, as a field below: its default, its help (vLLM's wording where vLLM
has the option) and its choices; the command line is built from the fields. Fields with
``cli=False`` are internal (tests, tools): ``from_kwargs`` only. Nothing is checked before
``create_engine_config``, which checks everything (types first, then ranges, then against the
model) and fills what the model and the backend decide.
"""

from __future__ import annotations

import argparse
import functools
import json
import types
from collections.abc import Iterable
from dataclasses import Field, dataclass, field, fields
from typing import Any, get_args, get_type_hints

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.executor.registry import AUTO, BACKEND_CHOICES, BACKENDS, check_backend, resolve_backend
from engine.jsonfile import is_int, is_number
from engine.kv.block_manager import DUPLICATE_POLICIES
from engine.parallel.plan import check_tensor_parallel

# --generation-config: where requests' default sampling parameters come from (vLLM's values;
# vLLM also takes a directory, which cuteinfer does not)
GENERATION_CONFIGS = ("auto", "vllm")
# long_prefill_token_threshold by default, per backend: on numpy a 2048-token chunk of the
# embedded model takes 20-35 s on 2 cores, so one long prompt would hold every other request
# back until its prefill is done; on cuda the whole budget is one fast step (no cap).
DEFAULT_LONG_PREFILL_TOKENS = {"numpy": 256, "cuda": 0}
# mixed_step_tokens by default, per backend: on cuda the largest mixed-step CUDA graph (128
# rows), so that a prompt admitted beside running streams does not stall them (issue 13's ITL
# aims; the scheduler lifts the cap where it would starve prompts: engine/scheduler.py); numpy
# has no graphs and its steps are host-bound (no cap).
DEFAULT_MIXED_STEP_TOKENS = {"numpy": 0, "cuda": 128}


# --dflash-draft-model-path DIR (pegainfer's flag): --speculative-config's dflash form
DFLASH_ALIAS = "dflash_draft_model_path"


def with_dflash_model(spec_json: str | None, model: str) -> str:
    """``--speculative-config`` (JSON text or None) with ``--dflash-draft-model-path``'s
    drafter folded in: method dflash, model DIR; ConfigError when they disagree."""
    value: Any = {}
    if spec_json:
        try:
            value = json.loads(spec_json)
        except ValueError as e:
            raise ConfigError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
    if value.get("method", "dflash") != "dflash" or value.get("model", model) != model:
        raise ConfigError(f"--{DFLASH_ALIAS.replace('_', '-')} {model} contradicts "
                          f"--speculative-config {spec_json}; give one of them")
    return json.dumps({**value, "method": "dflash", "model": model})


def _option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
            cli: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class EngineArgs:
    """Engine options, vLLM's names. See the module docstring."""

    model: str = _option(
        "", "The model to use: a Hugging Face checkpoint directory (config.json, safetensors, "
        "tokenizer), a hub id such as Qwen/Qwen3-0.6B (from the Hugging Face cache, "
        "downloaded when the hub is reachable; HF_HOME and HF_HUB_OFFLINE apply) or a Llama / "
        "Qwen3 .gguf file (converted once into the cache). Empty: the embedded default, "
        "SmolLM2-135M-Instruct (fetched once).")
    backend: str = _option(
        AUTO, "Where the model runs: cuda (CuTe DSL kernels and CUDA graphs on a Hopper GPU), "
        "numpy (the CPU reference) or auto (cuda when a Hopper GPU is usable, else numpy).",
        choices=BACKEND_CHOICES)
    tensor_parallel_size: int = _option(
        1, "Number of tensor parallel groups: the weights and KV heads are split over this many "
        "ranks (engine/parallel/plan.py). cuda: 1 only (the multi-GPU worker is not built "
        "yet); numpy: above 1 runs the sharded forward as a CPU simulation, a thread per rank.")
    max_model_len: int | None = _option(
        None, "Model context length (prompt and output). If unspecified, will be automatically "
        "derived from the model config (max_position_embeddings).")
    max_num_seqs: int = _option(
        256, "Maximum number of sequences to be processed in a single iteration.")
    max_num_batched_tokens: int = _option(
        2048, "Maximum number of tokens to be processed in a single iteration.")
    long_prefill_token_threshold: int | None = _option(
        None, "For chunked prefill, the most prompt tokens one request computes in a single "
        "iteration (0 = no cap), so that one long prompt leaves room for the other requests. "
        "If unspecified: 256 on numpy, no cap on cuda.")
    mixed_prefill_tokens: int = _option(
        0, "For chunked prefill, the most prompt tokens one iteration adds while other requests "
        "are decoding (0 = no cap beyond max_num_batched_tokens): a latency knob, so that new "
        "requests' prefills do not stall the running streams. On the H200, qwen3-8b serving 64 "
        "streams, 256 cut the longest inter-token gap from 51 to 23 ms and output throughput "
        "by 11% (docs/perf.md v11).")
    mixed_step_tokens: int | None = _option(
        None, "For chunked prefill, the most tokens one iteration computes in all (decode rows "
        "included) while requests decode, at least a quarter of it prompt tokens (0 = no cap): "
        "a latency knob, so that prompts admitted beside running streams do not stall them. On "
        "cuda, 128 (the largest mixed-step CUDA graph) makes every such step replay a graph. "
        "Lifted where it would starve prompts: a step whose decode rows read much KV (a burst "
        "over long shared prefixes) may add prompt tokens in proportion, and during a burst of "
        "admissions or once the oldest prompt has waited 32 steps a step may add 6x it "
        "(engine/scheduler.py). If "
        "unspecified: 128 on cuda, no cap on numpy. On an H100, qwen3-8b serving 64 streams "
        "in waves, 128 cut ITL p99 from 2.5x to 1.4x the median (docs/perf.md v27, v28, v35); "
        "0 is throughput-first (python -m tools.sim_schedule compares settings on a workload).")
    speculative_config: str | None = _option(
        None, "Speculative decoding, as JSON (vLLM's --speculative-config): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}, or {"method": "dflash", "model": DRAFTER_DIR} (a DFlash '
        "drafter, numpy and cuda backends; num_speculative_tokens defaults to its block_size - 1); "
        'also "disable_by_batch_size" (speculate only while fewer '
        "requests run, default 2: batch 1). The embedded LLM takes a dict. The accepted tokens "
        "are the ones plain decoding samples (greedy and seeded; on cuda the verify rows run "
        "plain decoding's kernels: the same bits at the same batch bucket).")
    block_size: int = _option(
        16, "Size of a contiguous cache block in number of tokens (a power of two).")
    enable_prefix_caching: bool = _option(True, "Whether to enable prefix caching.")
    num_gpu_blocks_override: int | None = _option(
        None, "Number of GPU blocks to use (>= 2: one is the padding page). This overrides the "
        "profiled num_gpu_blocks if specified; on numpy it is the number of KV pages. Used for "
        "testing preemption.")
    gpu_memory_utilization: float = _option(
        0.9, "The fraction of GPU memory to be used for the model executor, which can range "
        "from 0 to 1. For example, a value of 0.5 would imply 50% GPU memory utilization.")
    enforce_eager: bool = _option(
        False, "Whether to always run the model eagerly. If True, CUDA graphs are disabled; if "
        "False, decode steps replay the CUDA graph captured for their batch size.")
    enable_chunked_prefill: bool = _option(
        True, "If True, prefill requests can be chunked based on the remaining "
        "max_num_batched_tokens.")
    seed: int = _option(
        0, "Random seed for reproducibility: requests without a seed of their own draw theirs "
        "from it.")
    generation_config: str = _option(
        "auto", "Where the default sampling parameters come from. auto: the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, as vLLM applies them; "
        "fields a request sets override them). vllm: the built-in defaults, the file is "
        "ignored.", choices=GENERATION_CONFIGS)
    duplicate_policy: str = _option(
        "allow", "Prefix cache: a request completes a page whose tokens are already cached on "
        "another page. allow keeps both; reject swaps the cached page in and frees the new one.",
        choices=DUPLICATE_POLICIES, cli=False)
    cpu_kv_pages: int = _option(
        512, "numpy backend: KV pages to allocate when num_gpu_blocks_override is not given "
        "(at most what max_num_seqs requests of max_model_len need, and about 1 GiB).",
        cli=False)
    cuda_graph_max_bs: int | None = _option(
        None, "The largest batch size captured as a CUDA graph (default: max_num_seqs, at most "
        "256); larger decode batches run eagerly.")
    lazy_graph_capture: bool = _option(
        False, "Capture each batch size's CUDA graph when it is first used instead of at "
        "start-up (tests and the graph profiler).", cli=False)
    prompt_logprobs_prefix_cache: bool = _option(
        False, "Let requests that ask for prompt logprobs use the prefix cache (vLLM skips it "
        "for them); positions served from the cache then report None. Used by the golden gate.",
        cli=False)
    async_scheduling: bool = _option(
        True, "Plan the next decode step while the GPU runs the current one (vLLM's "
        "--async-scheduling): its input tokens are taken from the previous step's samples on "
        "the device, and the host's bookkeeping of a step overlaps the next one. Same tokens "
        "as without; a request that stops on a stop token or EOS computes one extra "
        "(discarded) token. On the H200, qwen3-8b serving 64 streams: TPOT 6.51 ms against "
        "7.40 without, the replay 6.05 (docs/perf.md v17). --no-async-scheduling turns it off.")

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """``EngineArgs(**kwargs)``, refusing a name that is not an option (and naming those
        that are) instead of Python's TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        if isinstance(kwargs.get("speculative_config"), dict):  # the LLM keyword's form
            kwargs["speculative_config"] = json.dumps(kwargs["speculative_config"])
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     exclude: Iterable[str] = ()) -> argparse.ArgumentParser:
        """Add a ``--flag-name`` per option (``cli=False`` ones and ``exclude`` left out):
        booleans as ``--x / --no-x``, the field's default, type, choices and help."""
        exclude = set(exclude)
        by_name = {f.name: f for f in fields(cls)}
        if exclude - by_name.keys():
            raise ValueError(f"exclude names {sorted(exclude - by_name.keys())} are not engine "
                             f"options; known: {sorted(by_name)}")
        group = parser.add_argument_group("engine options (vLLM's names)")
        for f in fields(cls):
            if f.name in exclude or not f.metadata["cli"]:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind, _ = _kind(f)
            helptext = f.metadata["help"].replace("%", "%%")
            if f.default not in (None, ""):
                helptext += " (default: %(default)s)"
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=f.default, help=helptext)
            else:
                group.add_argument(flag, type=kind, default=f.default,
                                   choices=f.metadata["choices"], help=helptext)
        if "speculative_config" not in exclude:
            group.add_argument(
                "--" + DFLASH_ALIAS.replace("_", "-"), metavar="DIR", default=None,
                help="A DFlash drafter checkpoint directory: the same as --speculative-config "
                '\'{"method": "dflash", "model": DIR}\' (other --speculative-config fields may '
                "be given with it).")
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The options in ``namespace`` (parsed after ``add_cli_args``); those not on the command
        line keep their defaults."""
        kw = {f.name: getattr(namespace, f.name) for f in fields(cls)
              if hasattr(namespace, f.name)}
        draft = getattr(namespace, DFLASH_ALIAS, None)
        if draft:
            kw["speculative_config"] = with_dflash_model(kw.get("speculative_config"), draft)
        return cls(**kw)

    # -- resolving -----------------------------------------------------------------------------
    def create_engine_config(self, model_config: ModelConfig,
                             backend: str | None = None) -> EngineConfig:
        """Check every option and resolve the ones the model and the backend decide:
        ``backend`` ("auto" becomes cuda or numpy; or pass the concrete backend already chosen),
        ``max_model_len`` (by default the context the model's RoPE covers: its
        max_position_embeddings, stretched by linear, dynamic and yarn scaling as vLLM does;
        never above it) and
        ``long_prefill_token_threshold`` (per backend). Raises ConfigError naming the option."""
        self._check()
        if backend is None:
            backend = resolve_backend(self.backend)
        else:
            check_backend(backend, BACKENDS)
            if self.backend not in (AUTO, backend):
                raise ConfigError(f"backend {backend!r} was chosen for options that ask for "
                                  f"backend {self.backend!r}; pass one of them only")
        max_pos = model_config.max_context_len
        mml = max_pos if self.max_model_len is None else self.max_model_len
        if mml > max_pos:
            rs = model_config.rope_scaling
            how = ("" if max_pos == model_config.max_position_embeddings else
                   f", stretched to {max_pos} by {rs.rope_type} RoPE scaling of factor "
                   f"{rs.factor}")
            raise ConfigError(
                f"max_model_len {mml} exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}{how}); lower max_model_len")
        model_config.sampling_defaults(self.generation_config)  # a bad default fails here
        check_tensor_parallel(model_config, self.tensor_parallel_size)  # names the field
        if backend == "cuda" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"tensor_parallel_size {self.tensor_parallel_size}: the cuda backend's "
                "multi-GPU worker (one process per GPU, NCCL all-reduce) is not built yet; use "
                "tensor_parallel_size 1, or --backend numpy to run the sharded forward as a CPU "
                "simulation")
        lp = self.long_prefill_token_threshold
        if lp is None:
            lp = DEFAULT_LONG_PREFILL_TOKENS[backend]
        mst = self.mixed_step_tokens
        if mst is None:
            mst = DEFAULT_MIXED_STEP_TOKENS[backend]
        from engine.speculative import SpeculativeConfig

        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None:
            spec.check(model_config, backend, self.tensor_parallel_size)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineConfig(**{**values, "backend": backend, "max_model_len": mml,
                               "long_prefill_token_threshold": lp, "mixed_step_tokens": mst,
                               "speculative_config": spec})

    def _check(self) -> None:
        for f in fields(self):
            kind, optional = _kind(f)
            v = getattr(self, f.name)
            if not (v is None and optional) and not _CHECKS[kind](v):
                what = _WHAT[kind] + (" or None" if optional else "")
                raise ConfigError(f"{f.name} must be {what}, got {v!r}")
        check_backend(self.backend)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0 (0 = no cap), got "
                              f"{self.long_prefill_token_threshold}")
        if self.mixed_step_tokens is not None and self.mixed_step_tokens < 0:
            raise ConfigError("mixed_step_tokens must be >= 0 (0 = no cap), got "
                              f"{self.mixed_step_tokens}")
        if self.mixed_prefill_tokens < 0:
            raise ConfigError("mixed_prefill_tokens must be >= 0 (0 = no cap), got "
                              f"{self.mixed_prefill_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("num_gpu_blocks_override must be >= 2 (one page is the padding "
                              f"page), got {self.num_gpu_blocks_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ConfigError(f"generation_config {self.generation_config!r}: use "
                              + " or ".join(repr(g) for g in GENERATION_CONFIGS))
        if self.duplicate_policy not in DUPLICATE_POLICIES:
            raise ConfigError(f"duplicate_policy {self.duplicate_policy!r}: use "
                              + " or ".join(repr(p) for p in DUPLICATE_POLICIES))
        if self.cpu_kv_pages < 1:
            raise ConfigError(f"cpu_kv_pages must be >= 1, got {self.cpu_kv_pages}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


_CHECKS = {bool: lambda v: isinstance(v, bool), int: is_int, float: is_number,
           str: lambda v: isinstance(v, str)}
_WHAT = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


@functools.cache
def _hints() -> dict[str, Any]:
    return get_type_hints(EngineArgs)


def _kind(f: Field[Any]) -> tuple[type, bool]:
    """(bool | int | float | str, whether None is allowed) of an option, from its annotation."""
    hint = _hints()[f.name]
    args = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    assert len(kinds) == 1 and kinds[0] in _CHECKS, f"{f.name}: unsupported type {hint}"
    return kinds[0], len(kinds) < len(args)
