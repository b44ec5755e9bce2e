"""GrammarCache's shards (engine/structured/matcher.py) on CPU, with Qwen3's real tokenizer: the
masks of a batch computed in the pool equal, bit for bit, each matcher's mask computed alone by
an independently compiled matcher fed the same tokens; concurrent requests of a grammar get
their own lexers up to ``max_shards`` and a later request reuses the least loaded one."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")

from engine.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from engine.structured import matcher as mm  # noqa: E402
from engine.structured.grammar import grammar_text  # noqa: E402
from engine.structured.matcher import GrammarCache  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

VOCAB, EOS = 151936, (151645,)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text", "n"],
          "properties": {"text": {"type": "string", "maxLength": 40},
                         "n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer) -> Tokenizer:
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def ll_tok(tokenizer: Tokenizer):
    return GrammarCache(tokenizer, VOCAB, EOS).ll_tokenizer()


def _cache(tokenizer: Tokenizer, ll_tok, **kw) -> GrammarCache:
    gc = GrammarCache(tokenizer, VOCAB, EOS, **kw)
    gc._ll_tok = ll_tok  # (the LLTokenizer is the same for every cache of this tokenizer)
    return gc


def _bits(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


GRAMMARS = [grammar_text(SO(json=SCHEMA)), grammar_text(SO(regex=r"[a-z]{1,30}( [a-z]{1,30})*")),
            grammar_text(SO(choice=["yes", "no", "maybe later"]))]


@pytest.mark.parametrize("threads,shards", [(2, None), (3, 2), (2, 1)])
def test_pool_masks_equal_masks_computed_alone(tokenizer, ll_tok, threads, shards) -> None:
    from llguidance import LLMatcher

    gc = _cache(tokenizer, ll_tok, threads=threads, max_shards=shards)
    rng = np.random.default_rng(threads)
    reqs, refs = [], []
    one = np.empty((1, gc.words), np.uint32)
    for i in range(9):  # three grammars, each at several depths, some complete
        g = GRAMMARS[i % 3]
        r = gc.matcher(g)
        ref = LLMatcher(ll_tok, g, log_level=0)
        for _ in range([0, 2, 7, 30][i % 4]):
            if r.matcher.is_stopped():
                break
            gc.fill_bitmasks([r], one)
            t = int(rng.choice(np.flatnonzero(_bits(one[0]))))
            assert r.accept(t) is not mm.Advance.ERROR and ref.consume_token(t)
        reqs.append(r)
        refs.append(ref)
    assert any(r.matcher.is_stopped() for r in reqs)
    if shards != 1:
        assert len({r.lexer for r in reqs}) > 3  # several lexers for a grammar
    out = np.full((len(reqs) + 1, gc.words), 0xDEADBEEF, np.uint32)  # one row more than asked
    gc.fill_bitmasks(reqs, out)
    alone = np.empty((len(reqs), gc.words), np.uint32)
    for i, ref in enumerate(refs):
        ref.unsafe_compute_mask_ptr(alone[i].ctypes.data, gc.words * 4)
    np.testing.assert_array_equal(out[:-1], alone)
    assert (out[-1] == 0xDEADBEEF).all()
    for i, r in enumerate(reqs):  # stopped: EOS only; else the JSON rows allow '"' or a digit
        allowed = _bits(out[i])
        if r.matcher.is_stopped():
            assert allowed.sum() == 1 and allowed[EOS[0]]
        else:
            assert 1 <= allowed.sum() < VOCAB


def test_shards_spread_concurrent_requests_and_are_reused(tokenizer, ll_tok) -> None:
    gc = _cache(tokenizer, ll_tok, threads=4, max_shards=3)
    g = GRAMMARS[0]
    first = [gc.matcher(g) for _ in range(3)]
    assert len({r.lexer for r in first}) == 3 and gc.shard_loads(g) == [1, 1, 1]
    more = [gc.matcher(g) for _ in range(2)]
    assert gc.shard_loads(g) == [2, 2, 1]  # no fourth shard: the least loaded ones
    assert {r.lexer for r in more} <= {r.lexer for r in first}
    del first, more
    assert gc.shard_loads(g) == [0, 0, 0]  # finished requests free their shard
    again = [gc.matcher(g) for _ in range(4)]  # the three shards, then the least loaded
    assert gc.shard_loads(g) == [2, 1, 1] and len(gc._templates[g].templates) == 3
    a, b = again[0], again[3]  # copies of one shard are independent matchers
    assert a.lexer == b.lexer
    for t in ll_tok.tokenize_str('{"text": "hi'):
        assert a.accept(t) is mm.Advance.CONTINUE
    out = np.empty((2, gc.words), np.uint32)
    gc.fill_bitmasks([a, b], out)
    assert not _bits(out[1])[ll_tok.tokenize_str("hi")[0]]  # b is still before the object
    assert b.accept(ll_tok.tokenize_str("{")[0]) is mm.Advance.CONTINUE


def test_one_lexer_when_a_grammar_compiles_slowly(tokenizer, ll_tok, monkeypatch) -> None:
    monkeypatch.setattr(mm, "MAX_SHARD_COMPILE_S", 0.0)
    gc = _cache(tokenizer, ll_tok, threads=4)
    g = grammar_text(SO(json={"type": "object", "properties": {"k": {"type": "string"}}}))
    reqs = [gc.matcher(g) for _ in range(4)]
    assert gc.shard_loads(g) == [4] and len({r.lexer for r in reqs}) == 1


def test_shards_default_to_threads_or_the_environment(tokenizer, monkeypatch) -> None:
    monkeypatch.delenv("CUTEINFER_GRAMMAR_SHARDS", raising=False)
    assert GrammarCache(tokenizer, VOCAB, EOS, threads=5).max_shards == 5
    assert GrammarCache(tokenizer, VOCAB, EOS).threads == mm.default_threads()
    monkeypatch.setenv("CUTEINFER_GRAMMAR_SHARDS", "1")
    assert GrammarCache(tokenizer, VOCAB, EOS, threads=5).max_shards == 1
    assert GrammarCache(tokenizer, VOCAB, EOS, threads=5, max_shards=2).max_shards == 2
    monkeypatch.setenv("CUTEINFER_GRAMMAR_SHARDS", "0")
    with pytest.raises(ValueError, match="CUTEINFER_GRAMMAR_SHARDS"):
        GrammarCache(tokenizer, VOCAB, EOS)


def test_ll_tokenizer_is_built_once_per_cache(tokenizer, monkeypatch) -> None:
    gc = GrammarCache(tokenizer, VOCAB, EOS)
    calls = []
    real = type(tokenizer).backend_tokenizer.fget

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(type(tokenizer), "backend_tokenizer", property(counted))
    first = gc.ll_tokenizer()
    assert gc.ll_tokenizer() is first and len(calls) == 1
