"""The backend registry: the one place that knows which executors exist and how each is built.

    backend = resolve_backend("auto")        # "cuda" on a usable Hopper GPU, else "numpy"
    executor, num_pages = create_executor(backend, ckpt, config)

``BACKENDS`` are the concrete backends (what ``EngineConfig.backend`` holds); ``BACKEND_CHOICES``
adds ``"auto"`` (what a user may ask for: ``--backend`` choices, ``LLM(backend=...)``). Executor
modules are imported only when built: the numpy path never imports the CUDA stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from engine.config import EngineConfig
    from engine.executor.base import Executor
    from engine.model.loader import Checkpoint

BACKENDS = ("numpy", "cuda")
AUTO = "auto"
BACKEND_CHOICES = (AUTO, *BACKENDS)
# numpy backend: the most float32 KV it allocates when num_gpu_blocks_override is not given
NUMPY_KV_BYTES = 1 << 30


def check_backend(name: object, choices: tuple[str, ...] = BACKEND_CHOICES) -> str:
    """``name`` if it is one of ``choices``, else a ConfigError naming them."""
    if not isinstance(name, str) or name not in choices:
        raise ConfigError(f"backend {name!r}: use one of {', '.join(choices)}")
    return name


def resolve_backend(name: str) -> str:
    """The concrete backend for ``name``: "auto" is "cuda" when a Hopper GPU is usable here,
    else "numpy"; a concrete name is returned as is."""
    if check_backend(name) != AUTO:
        return name
    from engine.cuda.driver import gpu_usable

    return "cuda" if gpu_usable() else "numpy"


def create_executor(backend: str, ckpt: Checkpoint, config: EngineConfig
                    ) -> tuple[Executor, int]:
    """Build the executor of ``backend`` (concrete) over ``ckpt``; returns it and the number of
    KV pages it allocated (padding page included)."""
    check_backend(backend, BACKENDS)
    if backend == "numpy":
        from engine.executor.numpy_executor import NumpyExecutor

        n = config.num_gpu_blocks_override
        if n is None:
            per_seq = config.max_pages_per_seq
            width = 0  # a DFlash drafter's captured features live beside the KV (per slot)
            spec = config.speculative_config
            if spec is not None and spec.method == "dflash":
                from engine.model.dflash import DFlashConfig

                width = DFlashConfig.from_pretrained(spec.model).capture_width
            fit = max(1, NUMPY_KV_BYTES // NumpyExecutor.bytes_per_page(
                ckpt, config.block_size, width))
            want = config.max_num_seqs * per_seq + 1
            n = max(min(config.cpu_kv_pages, want, fit), min(per_seq + 1, fit), 2)
        if config.tensor_parallel_size > 1:  # the sharded forward, simulated on the CPU
            from engine.parallel.sim import TensorParallelNumpyExecutor

            return TensorParallelNumpyExecutor(ckpt, n, config.block_size,
                                               config.tensor_parallel_size), n
        return NumpyExecutor(ckpt, n, config.block_size), n
    from engine.executor.cuda_executor import CudaExecutor

    ex = CudaExecutor(ckpt, config)
    return ex, ex.num_pages
