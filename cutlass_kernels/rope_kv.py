"""Per-head q/k RMSNorm (Qwen3, compile-time flag) + neox RoPE + KV-cache write by slot.

For token t at position ``p = positions[t]`` and each head of ``qkv[t]`` (q heads, then k heads,
then v heads, ``head_dim`` = d each):
  q, k heads: optional ``x = bf16(bf16(x * rstd) * w)`` (w = q_norm_w or k_norm_w, rstd over the
  head), then with ``c = bf16(cos_sin[p, :d/2])``, ``s = bf16(cos_sin[p, d/2:])``:
  ``out1 = bf16(bf16(x1*c) - bf16(x2*s))``, ``out2 = bf16(bf16(x2*c) + bf16(x1*s))``
  (``x1 = x[:d/2]``, ``x2 = x[d/2:]``). q goes to ``q_out[t]``; k, and v as is, go to the caches
  at ``slot = slot_mapping[t]`` (skipped when slot < 0; untouched cache memory keeps its bytes).

Constraints: head_dim in {64, 128} (any multiple of 16 works), page_size, head counts and the
qk-norm flag are compile-time; T, max_pos and eps are runtime. Positions are clamped into
``[0, max_pos)`` (never an out-of-bounds read; the host keeps positions < max_pos).

Layout:
  qkv      bf16 [T, (nq + 2*nkv) * d]   row-major contiguous
  q_out    bf16 [T, nq * d]
  caches   bf16 [num_pages, nkv, page_size, d] ("HND"); slot = page * page_size + offset;
           element offset ((page * nkv + h) * page_size + offset) * d + i, computed in Int64
  cos_sin  f32  [max_pos, d]  (cos | sin), norm weights bf16 [d], positions i32 [T],
           slot_mapping i64 [T]
Threads: a head is served by d/16 consecutive lanes; lane j holds elements [8j, 8j+8) of x1 and
the same of x2 (two 128-bit loads), so RoPE pairs stay in one thread and the head's sum of squares
is a butterfly over d/16 lanes. Grid ``(T, ceil(units * d/16 / block), 1)`` with
``units = nq + 2*nkv`` heads per token and ``block = min(512, ceil32(units * d/16))``.
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64

from cutlass_kernels._common import Ptr, Scalar, Signature, Unused

VEC = 8


@cute.jit
def norm_rope(x1: cute.TensorSSA, x2: cute.TensorSSA, rW: cute.Tensor, c: cute.TensorSSA,
              s: cute.TensorSSA, eps: Float32, hd: cutlass.Constexpr,
              qk_norm: cutlass.Constexpr):
    """One lane's 8 + 8 elements (x1 = x[8j:8j+8], x2 = x[d/2+8j:...], fp32 of bf16) of a head
    -> the bf16 (out1, out2) of the optional per-head RMSNorm (its sum of squares a butterfly
    over the head's d/16 lanes: every lane of the warp takes part) and neox RoPE, rounded as the
    module docstring says. Shared by RopeKV and the decode attention's rope prologue
    (decode_attention.py): the same code, so the same bits."""
    if cutlass.const_expr(qk_norm):
        ss = (x1 * x1 + x2 * x2).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        ss = cute.arch.warp_reduction(ss, lambda a, b: a + b, threads_in_group=hd // 16)
        rstd = cute.math.rsqrt(ss / Float32(hd) + eps)
        x1 = (x1 * rstd).to(BFloat16).to(Float32) * rW[None, 0].load()
        x2 = (x2 * rstd).to(BFloat16).to(Float32) * rW[None, 1].load()
        x1 = x1.to(BFloat16).to(Float32)
        x2 = x2.to(BFloat16).to(Float32)
    o1 = ((x1 * c).to(BFloat16).to(Float32) - (x2 * s).to(BFloat16).to(Float32))
    o2 = ((x2 * c).to(BFloat16).to(Float32) + (x1 * s).to(BFloat16).to(Float32))
    return o1.to(BFloat16), o2.to(BFloat16)


class RopeKV:
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 qk_norm: bool, pdl: bool = False) -> None:
        if head_dim % 16:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 16")
        self.nq, self.nkv, self.hd, self.ps = num_q_heads, num_kv_heads, head_dim, page_size
        self.qk_norm = qk_norm
        self.pdl = bool(pdl)
        self.tpu = head_dim // 16  # lanes per head: a power of two dividing 32 for d <= 512
        if 32 % self.tpu:
            raise ValueError(f"head_dim={head_dim}: head_dim / 16 must divide 32")
        self.units = num_q_heads + 2 * num_kv_heads
        self.width = self.units * head_dim
        lanes = self.units * self.tpu
        self.threads = min(512, (lanes + 31) // 32 * 32)
        self.ctas_per_token = (lanes + self.threads - 1) // self.threads

    @cute.jit
    def __call__(self, qkv: cute.Pointer, positions: cute.Pointer, slot_mapping: cute.Pointer,
                 q_norm_w: cute.Pointer, k_norm_w: cute.Pointer, cos_sin: cute.Pointer,
                 q_out: cute.Pointer, k_cache: cute.Pointer, v_cache: cute.Pointer,
                 num_tokens: Int32, max_pos: Int32, eps: Float32, stream: cuda.CUstream):
        hd, half, tpu = self.hd, self.hd // 2, self.tpu
        # (token, head, half, lane, 8)
        mQKV = cute.make_tensor(qkv, cute.make_layout((num_tokens, self.units, 2, tpu, VEC),
                                                      stride=(self.width, hd, half, VEC, 1)))
        mCS = cute.make_tensor(cos_sin, cute.make_layout((max_pos, 2, tpu, VEC),
                                                         stride=(hd, half, VEC, 1)))
        wl = cute.make_layout((2, tpu, VEC), stride=(half, VEC, 1))
        mWq = cute.make_tensor(q_norm_w, wl)
        mWk = cute.make_tensor(k_norm_w, wl)
        mPos = cute.make_tensor(positions, cute.make_layout(num_tokens))
        mSlot = cute.make_tensor(slot_mapping, cute.make_layout(num_tokens))
        self.kernel(mQKV, mPos, mSlot, mWq, mWk, mCS, q_out, k_cache, v_cache, max_pos, eps).launch(
            grid=[num_tokens, self.ctas_per_token, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQKV: cute.Tensor, mPos: cute.Tensor, mSlot: cute.Tensor, mWq: cute.Tensor,
               mWk: cute.Tensor, mCS: cute.Tensor, q_out: cute.Pointer, k_cache: cute.Pointer,
               v_cache: cute.Pointer, max_pos: Int32, eps: Float32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        tidx, _, _ = cute.arch.thread_idx()
        t, cta, _ = cute.arch.block_idx()
        lane = cta * self.threads + tidx
        u = lane // self.tpu  # head ("unit") of this lane: q heads, k heads, v heads
        j = lane % self.tpu
        valid = u < self.units
        u = u if valid else self.units - 1  # spare lanes load a real head, store nothing

        # Before griddepcontrol.wait (PDL): what the previous kernel does not write (positions,
        # slots: host uploads; the cos/sin table and the norm weights); qkv after it.
        pos = mPos[t]
        pos = pos if pos >= 0 else 0
        pos = pos if pos < max_pos else max_pos - 1
        c = mCS[pos, 0, j, None].load().to(BFloat16).to(Float32)
        s = mCS[pos, 1, j, None].load().to(BFloat16).to(Float32)
        slot = mSlot[t]
        rW = cute.make_rmem_tensor(cute.make_layout((VEC, 2), stride=(1, VEC)), Float32)
        if cutlass.const_expr(self.qk_norm):
            if u < self.nq:
                rW[None, 0].store(mWq[0, j, None].load().to(Float32))
                rW[None, 1].store(mWq[1, j, None].load().to(Float32))
            else:
                rW[None, 0].store(mWk[0, j, None].load().to(Float32))
                rW[None, 1].store(mWk[1, j, None].load().to(Float32))
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()

        x1b = mQKV[t, u, 0, j, None].load()
        x2b = mQKV[t, u, 1, j, None].load()
        x1 = x1b.to(Float32)
        x2 = x2b.to(Float32)

        o1b, o2b = norm_rope(x1, x2, rW, c, s, eps, self.hd, self.qk_norm)

        # One exit path for all three head kinds: pick the destination address and the values,
        # then store twice 8 bf16 (x1 half, x2 half) with 128-bit stores.
        rOut = cute.make_rmem_tensor(cute.make_layout((VEC, 2), stride=(1, VEC)), BFloat16)
        rOut[None, 0].store(o1b)
        rOut[None, 1].store(o2b)
        page = slot // Int64(self.ps)
        off = slot - page * Int64(self.ps)
        h = u - self.nq
        dst = k_cache.toint()
        if u >= self.nq + self.nkv:
            h = u - self.nq - self.nkv
            dst = v_cache.toint()
            rOut[None, 0].store(x1b)
            rOut[None, 1].store(x2b)
        elem = ((page * Int64(self.nkv) + Int64(h)) * Int64(self.ps) + off) * Int64(self.hd)
        do_store = valid & (slot >= Int64(0))
        if u < self.nq:
            dst = q_out.toint()
            elem = Int64(t * self.nq + u) * Int64(self.hd)
            do_store = valid
        if do_store:
            addr = dst + (elem + Int64(j * VEC)) * Int64(2)
            self._store(addr, rOut[None, 0].load())
            self._store(addr + Int64(self.hd), rOut[None, 1].load())

    @cute.jit
    def _store(self, addr: Int64, vals: cute.TensorSSA):
        """Store 8 bf16 at byte address ``addr`` (16-byte aligned): one 128-bit store."""
        p = cute.make_ptr(BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16)
        cute.make_tensor(p, cute.make_layout(VEC)).store(vals)


# ---------------------------------------------------------------------------------------------
# Host side

SIGNATURE = Signature(
    Ptr("qkv", "bf16", shape=("num_tokens", "width")),
    Ptr("positions", "i32", 4, ("num_tokens",)),
    Ptr("slot_mapping", "i64", 8, ("num_tokens",)),
    Ptr("q_norm_w", "bf16", shape=("hd",)), Ptr("k_norm_w", "bf16", shape=("hd",)),
    Ptr("cos_sin", "f32", shape=("max_pos", "hd")),
    Ptr("q_out", "bf16", shape=("num_tokens", "nq", "hd")),
    Ptr("k_cache", "bf16"), Ptr("v_cache", "bf16"),  # written at slots < the cache's size
    Scalar("num_tokens", Int32), Scalar("max_pos", Int32), Scalar("eps", Float32, fake=1e-6))


class RopeKVLauncher:
    """``launcher(qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, q_out, k_cache,
    v_cache, num_tokens, max_pos, eps, stream)``.

    qkv bf16[T, (nq+2nkv)*d]; positions i32[T]; slot_mapping i64[T]; q_norm_w, k_norm_w bf16[d]
    (None when compiled without qk_norm); cos_sin f32[max_pos, d]; q_out bf16[T, nq*d];
    k_cache, v_cache bf16[num_pages, nkv, page_size, d] (one layer); eps: Python float.
    positions / slot_mapping need their natural alignment (4 / 8 bytes), the rest 16 bytes.
    """

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.op = kernel, kernel.op

    def __call__(self, qkv: Any, positions: Any, slot_mapping: Any, q_norm_w: Any,
                 k_norm_w: Any, cos_sin: Any, q_out: Any, k_cache: Any, v_cache: Any,
                 num_tokens: int, max_pos: int, eps: float, stream: Any) -> None:
        op, t, max_pos = self.op, int(num_tokens), int(max_pos)
        if (q_norm_w is None or k_norm_w is None) == op.qk_norm:
            raise common.KernelArgError(
                "q_norm_w and k_norm_w must be given exactly when compiled with qk_norm=True")
        if max_pos <= 0:
            raise common.KernelArgError(f"max_pos={max_pos}: the cos/sin table must have rows")
        if t <= 0:
            return
        if not op.qk_norm:  # never read; any valid bf16 pointer fills the slot
            q_norm_w = k_norm_w = Unused(qkv)
        self.kernel(qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, q_out, k_cache,
                    v_cache, t, max_pos, float(eps), stream)


def compile_rope_kv(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                    qk_norm: bool = True, pdl: bool = False) -> RopeKVLauncher:
    """Compile (once per head counts, head_dim, page_size, qk_norm, pdl) the q/k-norm+RoPE+KV
    kernel. ``pdl``: launched with programmatic dependent launch; it lets its successor launch
    first thing and reads the positions, slots, cos/sin and norm weights before
    ``griddepcontrol.wait``, qkv after it (the bits are the same)."""
    key = ("rope_kv", num_q_heads, num_kv_heads, head_dim, page_size, bool(qk_norm)) + (
        ("pdl",) if pdl else ())

    def build() -> RopeKVLauncher:
        op = RopeKV(num_q_heads, num_kv_heads, head_dim, page_size, bool(qk_norm), bool(pdl))
        return RopeKVLauncher(SIGNATURE.compile(op))

    return common.cached_compile(key, build)
