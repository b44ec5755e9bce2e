"""What structured output costs a batch: decode step time of 64 requests, some constrained.

    python -m tools.bench_structured --model DIR [--batch 64] [--constrained 16] [--out f.json]

Runs the same batch twice through ``LLMEngine``: every request plain, then ``--constrained`` of
them under a JSON schema (a long string field, so no request completes its grammar early; the
others unconstrained). Each run admits all requests, then times ``--steps`` calls of
``step()`` in which every request is running: milliseconds per generated token of a request
(with async scheduling a call completes one step and launches the next), so the runs compare
one batch size at one context. Also a run with penalties on the same rows (a device-side
processor, no host mask).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tools.report import emit

SCHEMAS = {
    # one long free-text string (the default; the v17/v18 numbers). Dev box, 2 rows, numpy,
    # 30 steps: 0.43 ms of masks per step against 2.5 ms for "records" -- llguidance's masks
    # inside keys, bounded integers and short strings cost more than inside free text
    "string": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}},
               "required": ["text"]},
    # an array of typed records (short strings, bounded integers, enums, booleans), the shape
    # of most extraction / tool-argument schemas (minItems: no request completes its grammar
    # within the run)
    "records": {"type": "array", "minItems": 200, "maxItems": 400, "items": {  # never closes
        "type": "object", "additionalProperties": False,
        "required": ["name", "age", "role", "active"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "active": {"type": "boolean"}}}},
    # the records without the length and range bounds, as most extraction schemas are written:
    # llguidance's masks inside a string with maxLength cost 1-3 ms each (dev box; no fast path
    # for a bounded string), 30 us median without it (docs/perf.md v20)
    "records_unbounded": {"type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False,
        "required": ["name", "age", "role", "active"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "role": {"enum": ["admin", "user", "guest"]},
                       "active": {"type": "boolean"}}}},
}


class _Timed:
    """Wraps ``obj.name`` to add its wall time (ms) to ``acc[key]``."""

    def __init__(self, acc: dict, key: str, obj, name: str, events: list | None = None) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                acc[key] = acc.get(key, 0.0) + (t1 - t0) * 1e3
                if events is not None:
                    events.append((key, t0, t1))

        setattr(obj, name, timed)


def host_loop_ms(repeats: int = 5) -> float:
    """The best of ``repeats`` runs of a fixed pure-Python loop (dict updates), ms: the engine
    thread's CPU speed at that moment. On the GPU hosts' shared vCPUs it varies up to ~1.8x
    between vCPUs and runs (docs/perf.md v32 item 4), so a slow structured run whose loop is
    slow too is the host, not the code."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        d: dict[int, int] = {}
        for i in range(40000):
            d[i & 1023] = d.get(i & 1023, 0) + i
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def _run(eng, n: int, params_of, prompt_len: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    reqs = [eng.add_request(rng.integers(100, 20000, prompt_len).tolist(), params_of(i))
            for i in range(n)]
    while any(len(r.output_token_ids) == 0 for r in reqs):  # prefill everything
        eng.step()
    for _ in range(5):  # the first steps may capture or warm up
        eng.step()
    times = []
    acc = eng._bench_acc
    acc.clear()
    eng._bench_events.clear()
    probe = reqs[-1]  # unconstrained: runs through every timed step
    n0, t_start = len(probe.output_token_ids), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    elapsed = (time.perf_counter() - t_start) * 1e3
    tokens = len(probe.output_token_ids) - n0
    running = sum(not r.is_finished for r in reqs)
    for r in reqs:
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    for r in reqs:
        eng.pop_finished(r.request_id)
    t = np.array(times)
    # under async scheduling a call of step() completes the step before the one it launches,
    # and a call that only launches returns early: time per token is the measure
    return {"ms_per_token": elapsed / max(tokens, 1), "tokens": tokens,
            "host_loop_ms": host_loop_ms(),
            "call_ms_p50": float(np.median(t)), "still_running": running,
            # per step: where the time went (executor.execute includes the GPU wait)
            **{f"{k}_ms": v / steps for k, v in acc.items()},
            "timeline": _timeline(eng._bench_events)}


def _timeline(events: list) -> dict:
    """Where a structured step's critical path goes (medians, ms): the sampled tokens arrive
    (``finish`` returns) -> the mask job starts (``tokens_to_masks``) -> it ends (``masks``) ->
    the main thread reaches ``launch_procs`` (``masks_to_launch``: positive, the masks waited
    for the main thread; negative, the main thread waited for the masks). ``finish_wait``: the
    main thread blocked on the GPU (near 0: the host is the bottleneck)."""
    ev = sorted(events, key=lambda e: e[1])
    fin = [e for e in ev if e[0] == "finish"]
    masks = [e for e in ev if e[0] == "masks"]
    lp = [e for e in ev if e[0] == "launch_procs"]
    a, m, b = [], [], []
    for _, t0, t1 in masks:
        f = [e for e in fin if e[2] <= t0]
        n = [e for e in lp if e[1] >= t0]
        if f and n:
            a.append((t0 - f[-1][2]) * 1e3)
            m.append((t1 - t0) * 1e3)
            b.append((n[0][1] - t1) * 1e3)
    med = (lambda x: round(float(np.median(x)), 4) if x else None)
    return {"steps": len(m), "tokens_to_masks": med(a), "masks": med(m),
            "masks_to_launch": med(b), "finish_wait": med([(t1 - t0) * 1e3 for _, t0, t1 in fin])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--constrained", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="string",
                    help="the constrained rows' JSON schema (see SCHEMAS)")
    ap.add_argument("--core-only", action="store_true",
                    help="no detokenization in the engine, as the server's engine core runs "
                         "(engine/core/process.py); default: the embedded LLM's engine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from engine.args import EngineArgs
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

    eng = LLMEngine(EngineArgs(model=a.model, backend=a.backend, max_num_seqs=a.batch,
                               max_model_len=1024), process_outputs=not a.core_only)
    n_out = a.steps + 16
    eng._bench_acc = acc = {}
    eng._bench_events = ev = []
    _Timed(acc, "execute", eng.executor, "execute")
    _Timed(acc, "launch_procs", eng.executor, "launch_procs", ev)
    _Timed(acc, "launch_deferred", eng.executor, "launch_deferred")
    if hasattr(eng.executor, "launch_gated"):  # (CUTEINFER_GRAMMAR_GATE=1)
        _Timed(acc, "launch_gated", eng.executor, "launch_gated")
        _Timed(acc, "launch", eng.executor, "launch")
    _Timed(acc, "finish", eng.executor, "finish", ev)
    _Timed(acc, "outputs", eng.output_processor, "process")
    _Timed(acc, "masks", eng.processors.grammars, "fill_bitmasks", ev)
    _Timed(acc, "prepare", eng.processors, "prepare")
    _Timed(acc, "after_step", eng.processors, "after_step")
    _Timed(acc, "start_early", eng.processors, "start_early")  # (the matchers' advance inside)
    # the hand-off to the mask thread (it waits until that thread holds the GIL; docs/perf.md
    # v25 item 4)
    from engine.step import ProcessorRows

    _Timed(acc, "fill_async", ProcessorRows, "fill_async")
    # CUTEINFER_GRAMMAR_PROCESS=1: the engine thread's waits for the grammar worker's outcomes
    # (``after_step``) and masks (``launch_procs``)
    from engine.structured.remote import Job

    _Timed(acc, "worker_outcomes", Job, "outcomes")
    _Timed(acc, "worker_masks", Job, "result")
    _Timed(acc, "update", eng.scheduler, "update_from_output")
    _Timed(acc, "schedule", eng.scheduler, "schedule_continuation")
    _Timed(acc, "build", eng, "_build")
    _Timed(acc, "stage", eng.executor.buf.procs, "stage") if hasattr(eng.executor, "buf") \
        else None

    def plain(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.7, max_tokens=n_out, ignore_eos=True, seed=i)

    def constrained(i: int) -> SamplingParams:
        if i >= a.constrained:
            return plain(i)
        return SamplingParams(temperature=0.7, max_tokens=n_out, ignore_eos=True, seed=i,
                              structured_outputs=StructuredOutputsParams(json=SCHEMAS[a.schema]))

    def penalized(i: int) -> SamplingParams:
        if i >= a.constrained:
            return plain(i)
        return SamplingParams(temperature=0.7, max_tokens=n_out, ignore_eos=True, seed=i,
                              repetition_penalty=1.1, presence_penalty=0.5,
                              frequency_penalty=0.3, logit_bias={11: 2.0})

    _run(eng, a.batch, plain, a.prompt_len, 10)  # warm: graphs, the grammar tokenizer
    _run(eng, a.batch, constrained, a.prompt_len, 10)
    res = {"batch": a.batch, "constrained": a.constrained, "schema": a.schema,
           "core_only": a.core_only, "grammar_process": eng.processors.remote,
           "grammar_gate": eng._gate_on}
    for name, fn in (("plain", plain), ("structured", constrained), ("penalties", penalized),
                     ("plain_again", plain)):
        res[name] = _run(eng, a.batch, fn, a.prompt_len, a.steps)
    base = (res["plain"]["ms_per_token"] + res["plain_again"]["ms_per_token"]) / 2
    res["structured_over_plain"] = res["structured"]["ms_per_token"] / base
    res["penalties_over_plain"] = res["penalties"]["ms_per_token"] / base
    emit(res, a.out)


if __name__ == "__main__":
    main()
