"""Block-wide reduction for kernels that give one CTA to a row (rmsnorm.py, sampling.py).

    each warp: butterfly over its 32 lanes, offsets 16, 8, 4, 2, 1: ``v = op(v, shuffled v)``
    lane 0 of warp w: ``smem[w] = v``;  barrier
    every thread: ``acc = smem[0]; acc = op(acc, smem[w])`` for w = 1 .. nwarps-1, in warp order

The order is fixed (no atomics), so a float result has the same bits run to run, eager or
replayed in a graph; changing it changes rmsnorm's bits. A reduction carries a tuple of values
(a sum: one; an argmax: value and index; an online softmax: max and sum), one shared-memory
array of at least ``nwarps`` elements per value, and ``op(mine, other) -> tuple``.
"""

import cutlass_kernels._common  # noqa: F401, I001  (sets CUTE_DSL_ARCH before cutlass)
from collections.abc import Callable

import cutlass
import cutlass.cute as cute


def _shuffle(vals: tuple, offset: int) -> tuple:
    return tuple(cute.arch.shuffle_sync_bfly(v, offset=offset) for v in vals)


def _store(smem: tuple, w, vals: tuple) -> None:
    for s, v in zip(smem, vals, strict=True):
        s[w] = v


def _load(smem: tuple, w) -> tuple:
    return tuple(s[w] for s in smem)


@cute.jit
def block_reduce(vals: tuple, op: Callable, smem: tuple, nwarps: int,
                 reuse_smem: bool = True) -> tuple:
    """The block-wide ``op`` of every thread's ``vals``; every thread gets the result.

    ``reuse_smem``: end with a barrier, so the caller may write ``smem`` again right after
    (leave it off only when ``smem`` is never written again)."""
    for off in cutlass.range_constexpr(4, -1, -1):
        vals = op(vals, _shuffle(vals, 1 << off))
    # warp_idx() is a warp-wide shuffle: evaluate it with every lane active
    wid = cute.arch.warp_idx()
    if cute.arch.lane_idx() == 0:
        _store(smem, wid, vals)
    cute.arch.sync_threads()
    vals = _load(smem, 0)
    for w in cutlass.range_constexpr(1, nwarps):
        vals = op(vals, _load(smem, w))
    if cutlass.const_expr(reuse_smem):
        cute.arch.sync_threads()
    return vals


def add(a: tuple, b: tuple) -> tuple:
    """``op`` of a sum of one value."""
    return (a[0] + b[0],)
