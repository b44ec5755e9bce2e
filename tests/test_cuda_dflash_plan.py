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
