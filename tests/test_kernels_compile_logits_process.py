"""The logits-processor kernels (cutlass_kernels/logits_process.py) compile for sm_90a on a
CPU-only machine, once per key, and their launchers check arguments. Their numbers are checked
against engine.sampling.process_logits on the GPU (tests/gpu/test_logits_process.py)."""

from __future__ import annotations

import pytest

VOCAB = [151936, 49152, 1000, 999]  # 999: not a multiple of 4 (scalar loads)


@pytest.mark.parametrize("vocab", VOCAB)
def test_logits_process_compiles(vocab):
    from cutlass_kernels.logits_process import compile_count_tokens, compile_logits_process

    assert compile_logits_process(vocab) is compile_logits_process(vocab)
    assert compile_count_tokens(vocab) is compile_count_tokens(vocab)


def test_padded_row_stride_compiles():
    from cutlass_kernels.logits_process import compile_logits_process

    launcher = compile_logits_process(49155, 49216)  # a vocabulary padded to the GEMM tile
    assert launcher.kernel.op.vec == 1 and launcher.words == (49155 + 31) // 32


@pytest.mark.parametrize("vocab,chunks", [(151936, 8), (999, 3), (1000, 64)])
def test_chunked_rows_compile(vocab, chunks, monkeypatch):
    """``chunks`` CTAs a row (CUTEINFER_LOGITS_CHUNKS): a kernel of its own per count, its
    ranges cover the row (the last ones short or empty)."""
    from cutlass_kernels.logits_process import compile_logits_process

    launcher = compile_logits_process(vocab, chunks=chunks)
    op = launcher.kernel.op
    assert op.chunks == chunks and launcher is not compile_logits_process(vocab, chunks=1)
    assert op.span == -(-op.nvec // chunks) and op.span * chunks >= op.nvec  # (k * span >=
    # nvec: an empty range, that CTA only reads its row's flag)
    monkeypatch.setenv("CUTEINFER_LOGITS_CHUNKS", str(chunks))
    assert compile_logits_process(vocab) is launcher
    monkeypatch.setenv("CUTEINFER_LOGITS_CHUNKS", "0")
    with pytest.raises(ValueError, match="CUTEINFER_LOGITS_CHUNKS must be an integer from 1"):
        compile_logits_process(vocab)


class _Buf:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


def test_launchers_check_arguments():
    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.logits_process import compile_count_tokens, compile_logits_process

    proc = compile_logits_process(1000)
    ptrs = [256] * 15
    with pytest.raises(KernelArgError, match="num_slots"):
        proc(*ptrs, 2, 0, 8, None)
    proc(*ptrs, 0, 1, 1, None)  # no rows: no launch (a null stream is never touched)
    with pytest.raises(KernelArgError, match="counts: buffer of 100 B"):
        ptrs[10] = _Buf(256, 100)
        proc(*ptrs, 2, 2, 8, None)
    with pytest.raises(KernelArgError, match="slot: device address 0x102 is not 4-byte"):
        compile_count_tokens(1000)(256, 258, 256, 256, 256, 256, 256, 2, 2, None)
    with pytest.raises(TypeError, match="Signature"):
        from cutlass_kernels._common import Ptr, Signature
        from cutlass_kernels.logits_process import CountTokens

        Signature(Ptr("x", "u32")).compile(CountTokens(1000))
