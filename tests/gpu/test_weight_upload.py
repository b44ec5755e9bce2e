"""WeightUploader: file-backed and in-memory arrays, chunk edges, several threads, exact bytes."""

from __future__ import annotations

import numpy as np

from engine.cuda.driver import device_array
from engine.executor.weight_upload import WeightUploader
from engine.model.loader import BF16
from engine.model.safetensors_io import open_tensors, save_file


def test_uploads_every_byte_to_its_offset(tmp_path, cuda_ctx):
    rng = np.random.default_rng()
    chunk = 1 << 12
    # sizes around the chunk: 1 element, exactly one chunk, one past, many chunks
    sizes = [1, chunk // 2, chunk // 2 + 1, 3 * chunk // 2 + 7, 10 * chunk]
    tensors = {f"t{i}": rng.standard_normal(n).astype(BF16) for i, n in enumerate(sizes)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    mapped = open_tensors(path)
    mem = [rng.standard_normal(n).astype(BF16) for n in sizes]  # not file-backed
    total = sum(2 * n for n in sizes) * 2
    dev = device_array(total // 2, BF16)
    dev.fill_bytes(0xFF)  # poison
    seen = []
    up = WeightUploader(cuda_ctx, workers=3, chunk=chunk, on_bytes=seen.append)
    off, want = 0, []
    for name, a in zip(tensors, mem, strict=True):
        for src in (np.asarray(mapped[name]), a):
            up.copy(dev, off, src)
            want.append(np.asarray(src))
            off += src.nbytes
    up.run()
    got = dev.download(np.empty(total // 2, BF16))
    np.testing.assert_array_equal(got.view(np.uint16), np.concatenate(want).view(np.uint16))
    assert sum(seen) == total == up.bytes
