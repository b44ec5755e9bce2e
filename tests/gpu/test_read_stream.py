"""GPU: the read-only streaming kernel (cutlass_kernels/read_stream.py) against numpy: the
wrapping 32-bit sum of fresh random words, exact, over edge sizes (a partial vector tail is not
possible: sizes are whole vectors; fewer vectors than threads, one per thread, many per thread)
and launch shapes; the partial-sum buffer is poisoned and longer than the grid, so a CTA that
does not write, or writes past its slot, shows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.helpers import report


@pytest.mark.parametrize("threads,unroll", [(512, 4), (256, 1), (1024, 8)])
@pytest.mark.parametrize("num_vec", [1, 3, 511, 4097, 1_000_003])
def test_read_stream_sums_every_word_once(cuda_ctx, stream, threads, unroll, num_vec):
    from cutlass_kernels.read_stream import compile_read_stream
    from engine.cuda.driver import device_array, to_device

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, (num_vec, 4), dtype=np.uint32)
    src = to_device(words)
    for ctas in (1, 7, 2 * cuda_ctx.num_sms):
        out = device_array(ctas + 5, np.uint32)
        out.fill_bytes(0xA5, stream)
        compile_read_stream(threads, unroll)(src, out, num_vec, ctas, stream)
        stream.synchronize()
        got = out.download()
        want = int(words.sum(dtype=np.uint64) % 2**32)
        what = f"num_vec={num_vec} threads={threads} unroll={unroll} ctas={ctas} seed={seed}"
        assert int(got[:ctas].sum(dtype=np.uint64) % 2**32) == want, what
        assert (got[ctas:] == 0xA5A5A5A5).all(), f"{what}: wrote past the grid"
    report({"test": "read_stream", "num_vec": num_vec, "threads": threads, "seed": seed})
