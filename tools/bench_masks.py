"""Host time of a step's grammar masks: N requests of one JSON schema, serial vs the pool.

    CUTEINFER_QWEN3_TOKENIZER=DIR python -m tools.bench_masks [--n 16] [--threads 1,4,8,12]
        [--shards 1,t] [--gap-ms 0,2] [--steps 40]

Qwen3's tokenizer (``engine.model.fetch.qwen3_tokenizer_dir``: CUTEINFER_QWEN3_TOKENIZER or the
cached download), the schema of tools/bench_structured.py. For each lexers-per-grammar setting
(``--shards``: ``1`` is one lexer for all, whose lock serializes the masks; ``t``, the default
``GrammarCache``, one per pool thread), thread count and gap, N requests are put inside the
string (``{"text": "`` and a few random tokens); then each step times
``GrammarCache.fill_bitmasks`` on the N rows and advances every request by a random token its
mask allows inside the string (a new lexer state, as in a decode: a mask at an unchanged state
is a cache hit), then sleeps ``gap`` ms (the engine's host work between two steps' masks, in
which the pool's threads fall asleep: waking them is part of the time). Median over ``--steps``.

``cold``: the first batch on fresh templates (their DFAs are built as they go); ``warm``: a
second batch of new requests on the templates the first left, as in a server that has seen the
schema. ``serial``: one row at a time on the calling thread, no pool. ``busy``: the process's
CPU time / wall time in the masks, about how many threads worked at once (a pool serialized on a
lock, or whose threads wake late, stays near 1). Run on an otherwise idle host.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}},
          "required": ["text"]}
VOCAB = 151936
EOS = (151645, 151643)


def main() -> None:
    from engine.model.fetch import qwen3_tokenizer_dir
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured.grammar import grammar_text
    from engine.structured.matcher import GrammarCache, default_threads
    from engine.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="constrained requests")
    ap.add_argument("--threads", default=None,
                    help="comma list (default 1, 2, 4, .. up to the pool's default)")
    ap.add_argument("--shards", default="1,t",
                    help="comma list of lexers per grammar (t: as many as threads)")
    ap.add_argument("--gap-ms", default="0,2", help="comma list of sleeps between steps")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    top = default_threads()
    threads = ([int(x) for x in a.threads.split(",")] if a.threads else
               sorted({1, top, *[t for t in (2, 4, 8, 16, 32) if t < top]}))
    gaps = [float(x) for x in a.gap_ms.split(",")]
    tok = Tokenizer.from_pretrained(qwen3_tokenizer_dir())
    g = grammar_text(StructuredOutputsParams(json=SCHEMA))
    ll = GrammarCache(tok, VOCAB, EOS, threads=1).ll_tokenizer()
    # tokens that stay inside a JSON string: printable, no quote or backslash, whole UTF-8
    safe = []
    for t in range(VOCAB):
        b = ll.decode_bytes([t])
        if b and b'"' not in b and b"\\" not in b and min(b) >= 0x20 \
                and not ll.is_special_token(t):
            try:
                b.decode()
                safe.append(t)
            except UnicodeDecodeError:
                pass
    safe_ids = np.array(safe)
    prefix = ll.tokenize_str('{"text": "')
    print(f"cpus {len(os.sched_getaffinity(0))}, pool default {top}; n={a.n}; steps={a.steps}")

    def batch(gc: GrammarCache, rng: np.random.Generator, serial: bool,
              gap: float) -> tuple[float, float]:
        """``--n`` new requests run ``--steps`` steps: (median us of a step's masks, busy)."""
        reqs = [gc.matcher(g) for _ in range(a.n)]
        out = np.empty((a.n, gc.words), np.uint32)

        def sample(i: int) -> None:  # a token of row i's mask that stays inside the string
            row = out[i]
            for t in rng.choice(safe_ids, 256):
                if row[t >> 5] >> (t & 31) & 1:
                    break
            else:
                raise AssertionError("no allowed token inside the string")
            m = reqs[i].matcher
            assert m.consume_token(int(t)), m.get_error()

        for i, r in enumerate(reqs):
            for t in prefix:
                assert r.matcher.consume_token(t)
            for _ in range(int(rng.integers(3, 30))):
                gc.fill_bitmasks([r], out[i:i + 1])
                sample(i)
        ts, cpu = [], []
        for _ in range(a.steps):
            c0, t0 = time.process_time(), time.perf_counter()
            if serial:
                for i, r in enumerate(reqs):
                    gc.fill_bitmasks([r], out[i:i + 1])
            else:
                gc.fill_bitmasks(reqs, out)
            ts.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            for i in range(a.n):
                sample(i)
            if gap:
                time.sleep(gap / 1e3)
        return float(np.median(ts[3:])) * 1e6, sum(cpu[3:]) / sum(ts[3:])

    def run(threads: int, shards: int, serial: bool, gap: float):
        """(cold, warm): a first batch on fresh templates, then a second batch of new
        requests on the templates (lexer DFAs) the first one left, as in a server."""
        rng = np.random.default_rng(0)
        gc = GrammarCache(tok, VOCAB, EOS, threads=threads, max_shards=shards)
        gc._ll_tok = ll  # (one LLTokenizer for every run)
        return batch(gc, rng, serial, gap), batch(gc, rng, serial, gap)

    print(f"{'threads':>7} {'shards':>6} {'gap_ms':>6} {'mode':>6} {'cold_us':>8} "
          f"{'warm_us':>8} {'warm_per_mask':>13} {'busy':>5}")
    for spec in a.shards.split(","):
        for gap in gaps:
            for th, serial in [(top, True)] + [(th, False) for th in threads]:
                shards = th if spec == "t" else int(spec)
                (cold, _), (warm, busy) = run(th, shards, serial, gap)
                print(f"{'-' if serial else th:>7} {shards:>6} {gap:6g} "
                      f"{'serial' if serial else 'pool':>6} {cold:8.0f} {warm:8.0f} "
                      f"{warm / a.n:13.1f} {busy:5.2f}", flush=True)


if __name__ == "__main__":
    main()
