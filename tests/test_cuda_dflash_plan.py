"""The cuda DFlash drafter's host side (engine/executor/cuda_dflash.py), no GPU: the draft
block's page rows and scratch slots, the weight layouts it uploads, its memory plan."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.executor.cuda_dflash import (
    CudaDrafter,
    DrafterShapes,
    drafter_fixed_bytes,
    gate_up_blocks,
    padded_fc,
    scratch_pages,
)
from engine.executor.cuda_model import Sizes, plan_num_pages
from engine.model.dflash import DFlashConfig
from engine.model.synthetic import drafter_config, hf_config

MC = ModelConfig.from_dict(hf_config("qwen3-8b"))
DC = DFlashConfig.from_dict(drafter_config("qwen3-8b-dflash"))


def test_scratch_pages_hold_a_partial_page_and_the_block() -> None:
    assert scratch_pages(16, 16) == 2
    for ps in (8, 16, 32):
        for b in range(2, 40):
            s = scratch_pages(ps, b)
            assert s * ps >= ps - 1 + b and (s - 1) * ps < ps - 1 + b


@pytest.mark.parametrize("n_ctx", [1, 15, 16, 17, 37, 48, 255, 1025])
def test_every_key_of_the_block_maps_to_its_pool_or_scratch_slot(n_ctx: int) -> None:
    """Positions below the last full page read the request's pool pages; the rest (the copied
    partial page and the block) the scratch pages, at the slots the block's K/V are written."""
    rng = np.random.default_rng()
    ps, num_pages, pps = 16, 5000, 80
    d = object.__new__(CudaDrafter)
    d.shapes = DrafterShapes.of(MC, DC, ps)
    d.config, d.num_pages = DC, num_pages
    d.buf = SimpleNamespace(pps=pps + d.shapes.scratch)
    pages = rng.permutation(num_pages)[:-(-n_ctx // ps) + 1].astype(np.int32)
    got = d.block_inputs(n_ctx, 77, pages)
    b = DC.block_size
    assert got["ids"].tolist() == [77] + [DC.mask_token_id] * (b - 1)
    assert got["positions"].tolist() == list(range(n_ctx, n_ctx + b))
    assert (got["context_lens"] == n_ctx + b).all()
    table = got["page_indices"]
    assert table.shape == (b, d.buf.pps) and (table == table[0]).all()
    full = n_ctx // ps
    pos = np.arange(n_ctx + b)
    slot = table[0][pos // ps].astype(np.int64) * ps + pos % ps
    assert (slot[:full * ps] == pages[pos[:full * ps] // ps] * ps + pos[:full * ps] % ps).all()
    tail = slot[full * ps:]
    assert (tail == num_pages * ps + np.arange(tail.size)).all()  # scratch, in order
    assert (slot[n_ctx:] == got["slots"]).all()  # the block's K/V land where they are read
    assert tail.max() < (num_pages + d.shapes.scratch) * ps


def test_gate_up_blocks_interleave_32_rows() -> None:
    g = np.arange(64 * 3).reshape(64, 3)
    u = -g
    out = gate_up_blocks(g, u, 64)
    assert (out[:32] == g[:32]).all() and (out[32:64] == u[:32]).all()
    assert (out[64:96] == g[32:]).all() and (out[96:] == u[32:]).all()


def test_padded_fc_pads_each_captured_layers_block() -> None:
    fc = np.arange(3 * 6, dtype=np.float32).reshape(3, 6)  # H = 3, two layers
    out = padded_fc(fc, 2, 3, 4)
    assert out.shape == (4, 8)
    assert (out[:3, 0:3] == fc[:, 0:3]).all() and (out[:3, 4:7] == fc[:, 3:6]).all()
    assert (out[3] == 0).all() and (out[:, 3] == 0).all() and (out[:, 7] == 0).all()
    assert padded_fc(fc, 2, 3, 3) is fc


def test_the_memory_plan_makes_room_for_the_drafter() -> None:
    """Its weights and buffers come out of the fixed part and its five layers' K/V out of every
    page: fewer pages than without it, within the same bytes."""
    from engine.args import EngineArgs

    ec = EngineArgs.from_kwargs(max_model_len=4096).create_engine_config(MC, "numpy")
    s = Sizes.of(MC, ec)
    shapes = DrafterShapes.of(MC, DC, 16)
    extra = drafter_fixed_bytes(shapes, s.t_max, s.pages_per_seq)
    h = 4096
    weights = 2 * (h * len(DC.target_layer_ids) * h + 2 * h + DC.num_hidden_layers * (
        2 * h + MC.qkv_size * h + h * MC.q_size + 3 * 12288 * h + 2 * 128))
    feats = 2 * s.t_max * (len(DC.target_layer_ids) * h + 2 * h)  # features, ctx, normed ctx
    assert weights + feats < extra < weights + feats + (32 << 20)
    total = 140 << 30
    n0, b0 = plan_num_pages(MC, ec, total, total, 0)
    n1, b1 = plan_num_pages(MC, ec, total, total, 0, extra, DC.num_hidden_layers)
    assert n1 < n0 and abs(b1 - b0) < (4 << 20)
    per_page = 16 * 8 * 128 * 2  # one K or V array
    assert n1 * per_page * 2 * (36 + 5) + extra <= b1


class _Buf:
    """A device buffer stand-in: records what is uploaded into it."""

    def __init__(self) -> None:
        self.host: np.ndarray | None = None

    def upload(self, a: np.ndarray, _stream=None) -> None:
        self.host = np.array(a)


def _drafter(blocks: int, buckets=(1, 2, 4, 8, 16, 24)) -> CudaDrafter:
    """A CudaDrafter's host side at qwen3-8b's drafter shapes, page size 16, 5000 pool pages,
    ``blocks`` blocks a launch; uploads recorded, page copies and kernel runs logged."""
    d = object.__new__(CudaDrafter)
    d.shapes = DrafterShapes.of(MC, DC, 16)
    d.config, d.num_pages, d.max_blocks = DC, 5000, blocks
    d.block_buckets = sorted({x for x in buckets if x <= blocks} | {blocks})
    names = ("ids", "positions", "slots", "context_lens", "page_indices", "src", "sampled")
    d.buf = SimpleNamespace(pps=80 + d.shapes.scratch, rows=blocks * DC.block_size,
                            **{n: _Buf() for n in names})
    d.queue, d.drafted, d.graphs, d.log = [], False, {}, []
    d._copy_page = lambda src, dst, st: d.log.append(("copy", src, dst))
    d.body = lambda ex, n=1, sample=True: d.log.append(("body", n))
    return d


def test_blocks_are_staged_side_by_side_with_their_own_scratch_pages() -> None:
    """A launch of 4 blocks for 3 requests: each request's rows are its ``block_inputs`` at
    its block index (its own scratch pages and slots), its partial page is copied into its own
    scratch page (a request on a page boundary copies nothing), the 4th block is padding that
    attends to its own keys only."""
    rng = np.random.default_rng()
    d, ex = _drafter(8), SimpleNamespace(stream=None)
    bb, ps, sc, pb = DC.block_size, 16, d.shapes.scratch, d.shapes.page_bytes
    reqs = []
    for n_ctx in (37, 48, 1):
        pages = rng.permutation(5000)[:n_ctx // ps + 1].astype(np.int32)
        reqs.append((n_ctx, int(rng.integers(100, 1000)), pages))
    d.stage(ex, reqs, 4)
    b = d.buf
    assert b.ids.host.shape == (4 * bb,) and b.page_indices.host.shape == (4 * bb, b.pps)
    for j, (n_ctx, pending, pages) in enumerate(reqs):
        want = d.block_inputs(n_ctx, pending, pages, j)
        rows = slice(j * bb, (j + 1) * bb)
        for name, a in want.items():
            assert (getattr(b, name).host[rows] == a).all(), (j, name)
        first = 5000 + j * sc
        assert want["slots"][0] == first * ps + n_ctx % ps
        assert (want["page_indices"][0][n_ctx // ps:n_ctx // ps + sc]
                == first + np.arange(sc)).all()
    copies = [x for x in d.log if x[0] == "copy"]
    assert copies == [("copy", int(reqs[0][2][2]) * pb, 5000 * pb),
                      ("copy", int(reqs[2][2][0]) * pb, (5000 + 2 * sc) * pb)]
    pad = slice(3 * bb, 4 * bb)
    assert (b.context_lens.host[pad] == bb).all()
    assert (b.positions.host[pad] == np.arange(bb)).all()
    assert (b.slots.host[pad] == (5000 + 3 * sc) * ps + np.arange(bb)).all()
    assert (b.page_indices.host[pad][:, :sc] == 5000 + 3 * sc + np.arange(sc)).all()
    with pytest.raises(ValueError, match="draft blocks"):
        d.stage(ex, reqs, 2)  # more requests than the launch holds
    with pytest.raises(ValueError, match="draft blocks"):
        d.stage(ex, [], 16)  # more blocks than the buffers hold


def test_the_queue_drafts_once_per_step_in_its_bucket() -> None:
    """Proposals queue (a block index each) up to ``max_blocks``; ``flush`` runs them once, in
    the launch of their bucket or a larger one asked for; a new proposal makes them stale
    again; ``release`` empties the queue."""
    d, ex = _drafter(4), SimpleNamespace(stream=None)
    pages = np.arange(10, dtype=np.int32)
    assert [d.enqueue(20 + i, 7, pages) for i in range(5)] == [0, 1, 2, 3, None]
    assert d.queue[0][2].tolist() == [0, 1]  # the full pages and the partial one, copied
    assert [d.blocks_for(n) for n in (1, 2, 3, 4, 9)] == [1, 2, 4, 4, 4]
    d.flush(ex)
    d.flush(ex)
    assert [x for x in d.log if x[0] == "body"] == [("body", 4)] and d.drafted
    d.release()
    assert d.queue == [] and not d.drafted
    d.log.clear()
    d.enqueue(20, 7, pages)
    d.flush(ex, 2)  # the verify step's bucket
    d.enqueue(21, 7, pages)
    assert not d.drafted
    d.flush(ex, 1)
    assert [x for x in d.log if x[0] == "body"] == [("body", 2), ("body", 2)]


def test_place_sources_map_each_span_to_its_blocks_drafts() -> None:
    """``stage_src``: a span of k drafts at input row r takes its block's drafts 1..k (rows
    ``block * B + 1 ..`` of the blocks' samples); every other row keeps its own token; a span
    past the step's rows, a block never proposed or a k of 0 / more than B - 1 is refused."""
    d, ex = _drafter(4), SimpleNamespace(stream=None)
    bb = DC.block_size
    for n in (30, 40, 50):
        d.enqueue(n, 1, np.arange(5, dtype=np.int32))
    dd = np.array([[2, 1, 3], [0, 6, 15]], np.int32)  # (block, first draft row, k)
    d.stage_src(ex, dd, 32)
    src = d.buf.src.host
    assert src.shape == (32,)
    assert src[1:4].tolist() == [2 * bb + 1, 2 * bb + 2, 2 * bb + 3]
    assert src[6:21].tolist() == list(range(1, bb))
    keep = np.ones(32, bool)
    keep[1:4] = keep[6:21] = False
    assert (src[keep] == -1).all()
    for bad in ([[3, 1, 2]], [[0, 1, 0]], [[0, 1, bb]], [[0, 30, 3]]):
        with pytest.raises(ValueError, match="device drafts"):
            d.stage_src(ex, np.array(bad, np.int32), 32)


@pytest.mark.parametrize(("below", "max_num_seqs", "want"), [
    (2, 256, 1), (3, 256, 2), (5, 256, 4), (6, 256, 8), (9, 256, 8), (12, 256, 16),
    (40, 256, 16), (7, 6, 6), (8, 4, 4), (0, 256, 1)])
def test_a_launch_drafts_the_largest_speculating_bucket(below, max_num_seqs, want) -> None:
    """``CudaExecutor._draft_blocks``: the bucket of ``disable_by_batch_size - 1`` sequences
    (a verify graph of that bucket drafts all its blocks), at most ``MAX_DRAFT_BLOCKS``."""
    from engine.executor.cuda_executor import CudaExecutor
    from engine.speculative import SpeculativeConfig

    ex = object.__new__(CudaExecutor)
    spec = SpeculativeConfig(method="dflash", num_speculative_tokens=15,
                             disable_by_batch_size=below) if below else None
    ex.config = SimpleNamespace(speculative_config=spec, max_num_seqs=max_num_seqs,
                                cuda_graph_max_bs=None)
    assert ex._draft_blocks() == want


@pytest.mark.parametrize(("below", "max_num_seqs", "want"), [
    (2, 256, [1]), (8, 256, [1, 2, 4, 8]), (8, 4, [1, 2, 4]), (3, 2, [1, 2]), (9, 6, [1, 2, 4, 6]),
    (64, 256, [1, 2, 4, 8])])
def test_verify_graphs_cover_the_batches_that_speculate(below, max_num_seqs, want) -> None:
    """``CudaExecutor._verify_buckets``: a verify graph for every bucket up to the one of the
    most sequences that may speculate (fewer than ``disable_by_batch_size``, at most
    ``max_num_seqs``: a ``disable_by_batch_size`` above ``max_num_seqs`` once left no graph at
    all), whose ``bucket x (k + 1)`` rows fit the step buffers (b_max 128 here)."""
    from engine.executor.cuda_executor import CudaExecutor
    from engine.speculative import SpeculativeConfig

    ex = object.__new__(CudaExecutor)
    ex.config = SimpleNamespace(
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=15,
                                             disable_by_batch_size=below),
        max_num_seqs=max_num_seqs, cuda_graph_max_bs=None)
    ex.sizes = SimpleNamespace(b_max=128)
    assert ex._verify_buckets() == want


class _Runner:
    """A verify GraphRunner stand-in: every bucket of ``buckets`` replays."""

    def __init__(self, buckets) -> None:
        self.buckets, self.replayed = buckets, []

    def can_replay(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def pad(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def replay(self, b: int) -> None:
        self.replayed.append(b)


def _verify_step(fused: bool, queued: int, num_seqs: int, graphs: bool = True):
    """``CudaExecutor._verify`` over stand-ins (k = 15, blocks 8): what it stages, drafts,
    places and replays for a step of ``num_seqs`` sequences with ``queued`` proposed blocks,
    the first ``num_seqs`` of them taken by the step's spans."""
    from engine.executor.cuda_executor import CudaExecutor

    log = []
    ex = object.__new__(CudaExecutor)
    ex.fused_spec = fused
    ex.verify = _Runner([1, 2, 4, 8]) if graphs else None
    d = _drafter(8)
    d.queue = [(20 + j, 5, np.arange(3, dtype=np.int32)) for j in range(queued)]
    stage, stage_src = d.stage, d.stage_src
    d.stage = lambda e, reqs, blocks: (log.append(("stage", len(reqs), blocks)),
                                       stage(e, reqs, blocks))
    d.stage_src = lambda e, dd, rows: (log.append(("src", rows)), stage_src(e, dd, rows))
    d.place = lambda e, rows: log.append(("place", rows))
    ex.dflash = d
    ex.config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=15))
    ex.stream = None
    ex.upload = lambda b, pad_to=None: log.append(("upload", pad_to))
    ex.upload_sampling = lambda b, pad_to=None: None
    ex._sampled = lambda b, n: np.zeros(n, np.int32)
    ex.verify_body = lambda n, seqs: log.append(("verify_body", n))
    dd = np.array([[j, 16 * j + 1, 15] for j in range(num_seqs)], np.int32)
    rows = SimpleNamespace(num_seqs=16 * num_seqs, device_drafts=dd)
    ex._verify(rows, num_seqs)
    return log, d, ex


def test_a_fused_verify_stages_its_blocks_and_lets_the_graph_draft() -> None:
    log, d, ex = _verify_step(True, 3, 3)
    assert log[:3] == [("stage", 3, 4), ("upload", 64), ("src", 64)]
    assert [x for x in d.log if x[0] == "body"] == []  # the graph drafts
    assert ex.verify.replayed == [4] and d.drafted
    assert d.buf.src.host[1:16].tolist() == list(range(1, 16))


def test_more_blocks_than_the_bucket_are_drafted_first() -> None:
    """Blocks proposed for requests that are not in the step (their span did not fit): the
    queue outgrows the bucket; its blocks are drafted in their own launch first, the graph
    then redrafts the first bucket's worth over the same staged inputs and places them."""
    log, d, ex = _verify_step(True, 3, 1)
    assert ("body", 4) in d.log and log[-1] == ("src", 16)
    assert not any(x[0] == "stage" and x[2] == 1 for x in log)
    assert ex.verify.replayed == [1]


def test_split_and_eager_verifies_draft_then_place() -> None:
    log, d, ex = _verify_step(False, 2, 2)
    assert [x for x in d.log if x[0] == "body"] == [("body", 2)]
    assert log[-2:] == [("src", 32), ("place", 32)] and ex.verify.replayed == [2]
    log, d, ex = _verify_step(True, 2, 2, graphs=False)
    assert [x for x in d.log if x[0] == "body"] == [("body", 2)]
    assert log[-3:] == [("src", 32), ("place", 32), ("verify_body", 32)]
