"""Which kernels ``CudaExecutor.forward`` launches, on which buffers, checked without a GPU: the
executor's own forward runs over recording stand-ins for its kernels.

What must hold (docs/perf.md v21): a step whose four decoder GEMMs all run their fused skinny
kernel for its M (``fuses``; ``tile_as`` decides for verify rows) runs six kernels a layer, the
GEMMs reading the residual stream itself (qkv, gate_up: the norm inside) and adding into it
(o, down), and ends with the final norm of the residual; any other step runs the separate norms
(unit weight: the norm weights are folded into qkv / gate_up), SiLU and residual adds, each GEMM
through ``unfused``. The GPU tests (graphs, golden gate, odd shapes, mixed steps) check the
numbers of both paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import engine.executor.cuda_executor as cx

LAYERS = 2


class _Gemm:
    """A GEMM launcher: fused up to ``fused_max`` rows; logs (name, a, c, m, tile_as, mode)."""

    def __init__(self, log: list, name: str, fused_max: int = 128) -> None:
        self.log, self.name, self.fused_max = log, name, fused_max

    def fuses(self, m: int) -> bool:
        return m <= self.fused_max

    def __call__(self, a, w, c, m, st, tile_as=None) -> None:
        assert self.fuses(m if tile_as is None else tile_as), "fused kernel off its path"
        self.log.append((self.name, a, c, m, tile_as, "fused"))

    def unfused(self, a, w, c, m, st, tile_as=None) -> None:
        assert not self.fuses(m if tile_as is None else tile_as), "plain call on the fused path"
        self.log.append((self.name, a, c, m, tile_as, "plain"))


def _executor(fused_max: dict[str, int] | None = None, rope_in_attention: bool = False):
    log: list = []
    e = object.__new__(cx.CudaExecutor)
    e.log = log
    e.__dict__["_rope_in_attention"] = rope_in_attention  # the cached_property's value
    lim = {"qkv": 128, "o": 128, "gate_up": 128, "down": 128, **(fused_max or {})}
    rec = lambda name: (lambda *a: log.append((name, *[x for x in a if isinstance(x, str)])))  # noqa: E731
    e.kernels = SimpleNamespace(
        embed_src=rec("embed"), norm=rec("norm"), add_norm=rec("add_norm"), rope=rec("rope"),
        decode=rec("decode"), decode_rope=rec("decode_rope"), prefill=rec("prefill"),
        silu=rec("silu"),
        **{g: _Gemm(log, g, lim[g]) for g in ("qkv", "o", "gate_up", "down")})
    names = ("input_ids", "input_src", "sampled", "resid", "delta", "h", "ones", "qkv",
             "positions", "slot_mapping", "cos_sin", "q", "attn", "gate_up", "act",
             "page_indices", "context_lens",
             "workspace", "cu_seqlens", "pre_cu_seqlens", "pre_context_lens",
             "pre_page_indices")
    e.buf = SimpleNamespace(**{n: n for n in names})
    layer = {"qkv": "w_qkv", "o": "w_o", "gate_up": "w_gate_up", "down": "w_down",
             "in_norm": "in_norm", "post_norm": "post_norm"}
    e.weights = SimpleNamespace(embed="w_embed", norm="final_norm",
                                layers=[dict(layer) for _ in range(LAYERS)])
    e.stream, e.scale = None, 0.1
    e.mc = SimpleNamespace(rms_norm_eps=1e-6, vocab_size=1000, num_hidden_layers=LAYERS)
    e.sizes = SimpleNamespace(pages_per_seq=4, max_pos=64, logit_rows=8)
    e.k_cache, e.v_cache = ["k"] * LAYERS, ["v"] * LAYERS
    e.decode_splits = lambda n: 1
    return e


def _gemms(log: list) -> list:
    return [x for x in log if isinstance(x, tuple) and x[-1] in ("fused", "plain")]


def test_a_decode_step_runs_the_fused_layer() -> None:
    e = _executor()
    e.forward(16, 16, True, 1, 1)
    kinds = [x[0] for x in e.log]
    assert kinds == ["embed"] + ["qkv", "rope", "decode", "o", "gate_up", "down"] * LAYERS + [
        "norm"]
    per_layer = [(x[0], x[1], x[2]) for x in _gemms(e.log)[:4]]
    assert per_layer == [("qkv", "resid", "qkv"), ("o", "attn", "resid"),
                         ("gate_up", "resid", "act"), ("down", "act", "resid")]
    assert all(x[-1] == "fused" and x[3] == 16 for x in _gemms(e.log))
    final = e.log[-1]
    assert final[:4] == ("norm", "resid", "final_norm", "h")  # the real norm weight, once


def test_a_decode_step_with_rope_in_attention_runs_five_kernels_a_layer() -> None:
    """CUTEINFER_FUSE_ROPE (rope_attention_options): plain decode runs decode_rope, which
    reads qkv and writes attn; every other step keeps rope_kv as its own kernel."""
    e = _executor(rope_in_attention=True)
    e.forward(16, 16, True, 1, 1)
    kinds = [x[0] for x in e.log]
    assert kinds == ["embed"] + ["qkv", "decode_rope", "o", "gate_up", "down"] * LAYERS + [
        "norm"]
    call = e.log[kinds.index("decode_rope")]
    assert call[1:4] == ("qkv", "positions", "slot_mapping") and "attn" in call
    assert "q" not in call  # no q buffer between rope and attention
    for args, kw in (((16, 16, True, 1, 1), {"tile_as": 16}),  # verify rows
                     ((300, 2, False, 200, 1), {})):  # prefill
        e = _executor(rope_in_attention=True)
        e.forward(*args, **kw)
        kinds = [x[0] for x in e.log]
        assert "decode_rope" not in kinds and kinds.count("rope") == LAYERS


def test_a_big_step_runs_the_separate_kernels_with_unit_norms() -> None:
    e = _executor()
    e.forward(300, 2, False, 200, 1)
    kinds = [x[0] for x in e.log]
    layer = ["qkv", "rope", "prefill", "o", "add_norm", "gate_up", "silu", "down"]
    assert kinds == (["embed", "norm"] + layer + ["add_norm"] + layer + ["add_norm"])
    norms = [x for x in e.log if x[0] in ("norm", "add_norm")]
    assert all("ones" in x for x in norms[:-1])  # folded weights: a unit norm weight
    assert "final_norm" in norms[-1] and "ones" not in norms[-1]
    g = _gemms(e.log)[:4]
    assert [(x[0], x[1], x[2], x[-1]) for x in g] == [
        ("qkv", "h", "qkv", "plain"), ("o", "attn", "delta", "plain"),
        ("gate_up", "h", "gate_up", "plain"), ("down", "act", "delta", "plain")]
    assert ("silu", "gate_up", "act") == e.log[kinds.index("silu")][:3]


def test_verify_rows_follow_the_kernel_of_their_tile() -> None:
    """300 verify rows run the kernels of a 64-row call (tile_as): the fused layer."""
    e = _executor()
    e.forward(300, 300, True, 1, 1, tile_as=64)
    assert all(x[-1] == "fused" and x[3] == 300 and x[4] == 64 for x in _gemms(e.log))
    e = _executor()
    e.forward(16, 16, True, 1, 1, tile_as=200)  # a tile past the skinny path: unfused
    assert all(x[-1] == "plain" and x[4] == 200 for x in _gemms(e.log))


@pytest.mark.parametrize("gemm", ["qkv", "o", "gate_up", "down"])
def test_gemms_that_disagree_on_fusing_are_an_error_before_any_launch(gemm: str) -> None:
    """The four GEMMs share their path options, so they fuse at the same M; if they did not,
    neither path's buffers would fit: a typed error before any launch."""
    e = _executor({gemm: 64})
    with pytest.raises(cx.ExecutorError, match="disagree"):
        e.forward(100, 100, True, 1, 1)
    assert e.log == []
    e.forward(64, 64, True, 1, 1)  # where all four fuse: the fused layer
    assert {x[-1] for x in _gemms(e.log)} == {"fused"}


class _Drafter:
    """A DFlash drafter's hooks (engine/executor/cuda_dflash.py), logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def capture(self, layer, resid, t, st) -> None:
        self.log.append(("capture", layer, resid, t))

    def materialize(self, ex, t) -> None:
        self.log.append(("materialize", t))


@pytest.mark.parametrize("args", [(16, 16, True, 1, 1), (300, 2, False, 200, 1)],
                         ids=["fused", "unfused"])
def test_a_drafter_captures_each_layers_finished_residual_then_materializes(args) -> None:
    """Fused: a layer's residual is final after its down GEMM adds into it; unfused: after the
    next add_norm (the final one for the last layer). The context K/V come last, once."""
    e = _executor()
    e.dflash = _Drafter(e.log)
    e.forward(*args)
    names = [x[0] for x in e.log]
    caps = [i for i, n in enumerate(names) if n == "capture"]
    assert [e.log[i][1] for i in caps] == list(range(LAYERS))
    assert all(e.log[i][2:] == ("resid", args[0]) for i in caps)
    fused = args[2]
    for i in caps:
        prev = e.log[i - 1][0]
        assert prev == ("down" if fused else "add_norm")
    assert names[-1] == "materialize" and names.count("materialize") == 1
    assert e.log[-1] == ("materialize", args[0])
    if not fused:  # the last layer's capture follows the final add_norm
        assert names[-3:] == ["add_norm", "capture", "materialize"]
