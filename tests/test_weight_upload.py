"""What the weight uploader reads from where (CPU): a tensor of a memory-mapped safetensors file
is found in its file at the right offset; anything else is copied from memory."""

from __future__ import annotations

import numpy as np

from engine.executor.weight_upload import SerialUploader, file_range
from engine.model.loader import BF16
from engine.model.safetensors_io import open_tensors, save_file


def test_file_range_points_at_the_tensor_bytes(tmp_path):
    rng = np.random.default_rng()
    want = {f"t{i}": rng.standard_normal((int(rng.integers(1, 40)), 24)).astype(BF16)
            for i in range(5)}
    want["odd"] = rng.standard_normal(7).astype(np.float32)
    path = tmp_path / "m.safetensors"
    save_file(want, path)
    got = open_tensors(path)
    raw = path.read_bytes()
    for name, a in got.items():
        where = file_range(np.asarray(a))
        assert where is not None and where[0] == str(path)
        off = where[1]
        assert raw[off:off + a.nbytes] == want[name].tobytes(), name
        sub = np.asarray(a)[1:] if a.shape[0] > 1 else None  # a row-slice: still contiguous
        if sub is not None:
            s_path, s_off = file_range(sub)
            assert raw[s_off:s_off + sub.nbytes] == want[name][1:].tobytes()
    t0 = np.asarray(got["t0"])
    if t0.shape[0] > 1:
        assert file_range(t0[:, ::2]) is None  # not contiguous: copied from memory
    assert file_range(want["t1"]) is None  # plain memory
    assert file_range(np.asarray(got["t1"]).astype(np.float32)) is None


class _Buf:
    def __init__(self, shape):
        self.shape, self.got = shape, None

    def upload(self, a, stream):
        self.got = a.copy()


class _Stream:
    def synchronize(self):
        pass


def test_serial_uploader_stacks_the_parts_of_a_buffer():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((n, 8)).astype(np.float32) for n in (6, 2, 2))
    buf, one = _Buf((10, 8)), _Buf((3,))
    up = SerialUploader(_Stream())
    up.copy(buf, 0, q)
    up.copy(buf, q.nbytes, k)
    up.copy(one, 0, np.arange(3.0))
    up.copy(buf, q.nbytes + k.nbytes, v)
    up.run()
    np.testing.assert_array_equal(buf.got, np.concatenate([q, k, v]))
    np.testing.assert_array_equal(one.got, np.arange(3.0))
