"""Helpers for kernels built on the warp-level mma.sync m16n8k16 (prefill_attention.py,
decode_attention.py's ``mma`` variant): the accumulator's (rows, cols) view and the reductions
over the quad of lanes that share an accumulator row.

The m16n8 accumulator of lane l holds rows g = l // 4 and g + 8, columns 2 * (l % 4) + {0, 1}
(PTX ISA, mma.m16n8k16): a row's values sit in the four lanes of one quad.
"""

import cutlass_kernels._common  # noqa: F401, I001  (sets CUTE_DSL_ARCH before cutlass)
import cutlass
import cutlass.cute as cute


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2), MMA_M, MMA_N) accumulator -> ((2, MMA_M) rows, (2, MMA_N) cols) view."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def quad_max(x: cutlass.Float32) -> cutlass.Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


def quad_sum(x: cutlass.Float32) -> cutlass.Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def swizzled_rows(shape: tuple) -> cute.ComposedLayout:
    """bf16 tile (rows, cols[, stages]) of 128-byte-swizzled rows: 8 rows x 64 elements per
    atom, conflict-free for 16-byte cp.async stores and ldmatrix loads."""
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                     cute.make_layout((8, 64), stride=(64, 1)))
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))
