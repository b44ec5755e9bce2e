"""Many concurrent requests over a few long shared prompts (the prefix cache under load).

    python -m tools.bench_shared_prefix --base-url http://127.0.0.1:8000 \\
        --clients 256 --prefixes 2 --prefix-len 3000 --question-len 32 --output-len 64

Each request is one of ``--prefixes`` random token-id prefixes plus its own random question,
streamed from /v1/completions; all start at once. Reports how many succeeded, TTFT (mean, p50,
p99, max), ITL, the cached-token share the server reported, and whether one fresh request after
the burst succeeds. JSON on stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np


def _body(model: str, prompt: list[int], out_len: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": out_len,
                       "ignore_eos": True, "stream": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()


async def _one(session, url: str, body: bytes) -> dict:
    """One streamed request. ``body`` is encoded before the burst: encoding 256 bodies of
    3,000 ids inside it (~0.4 ms each, one client process) would spread the arrivals by the
    client's own JSON work."""
    t0 = time.perf_counter()
    ttft, last, gaps, cached, n = None, None, [], 0, 0
    try:
        async with session.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return {"ok": False, "error": str(ev["error"])[:200]}
                now = time.perf_counter()
                if ev.get("choices") and ev["choices"][0].get("text") is not None:
                    n += 1
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                usage = ev.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", cached) or cached
    except Exception as e:  # noqa: BLE001 -- reported per request
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": ttft is not None, "ttft": ttft, "gaps": gaps, "cached": cached, "chunks": n}


def _pct(v: list[float], q: float) -> float:
    return float(np.percentile(np.array(v) * 1e3, q)) if v else 0.0


async def run(a: argparse.Namespace) -> dict:
    import aiohttp

    rng = np.random.default_rng(a.seed)
    lo, hi = a.vocab_range
    prefixes = [rng.integers(lo, hi, a.prefix_len).tolist() for _ in range(a.prefixes)]
    prompts = [prefixes[i % a.prefixes] + rng.integers(lo, hi, a.question_len).tolist()
               for i in range(a.clients)]
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=a.timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async with session.get(f"{a.base_url}/v1/models") as r:
            model = a.model or (await r.json())["data"][0]["id"]
        bodies = [_body(model, p, a.output_len) for p in prompts]
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(session, a.base_url, b) for b in bodies])
        dt = time.perf_counter() - t0
        ttft_at = sorted(t0 + r["ttft"] for r in res if r["ok"])
        fresh = await _one(session, a.base_url,
                           _body(model, rng.integers(lo, hi, a.question_len).tolist(), 8))
    ok = [r for r in res if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    return {"clients": a.clients, "prefixes": a.prefixes, "prefix_len": a.prefix_len,
            "question_len": a.question_len, "output_len": a.output_len,
            "succeeded": len(ok), "failed": len(res) - len(ok),
            "errors": sorted({r.get("error", "") for r in res if not r["ok"]})[:5],
            "duration_s": round(dt, 3),
            # perf_counter (CLOCK_MONOTONIC: the server's step trace reads the same clock)
            "burst_start": t0,
            "ttft_ms": {"mean": round(float(np.mean(ttft)) * 1e3, 1) if ttft else 0.0,
                        "p50": round(_pct(ttft, 50), 1), "p99": round(_pct(ttft, 99), 1),
                        "max": round(max(ttft) * 1e3, 1) if ttft else 0.0},
            "itl_ms": {"p50": round(_pct(gaps, 50), 2), "p99": round(_pct(gaps, 99), 2),
                       "max": round(max(gaps) * 1e3, 2) if gaps else 0.0},
            "cached_tokens_mean": round(float(np.mean([r["cached"] for r in ok])), 1)
            if ok else 0.0,
            "fresh_request_ok": bool(fresh["ok"]),
            "first_tokens_at_s": [round(x - t0, 4) for x in ttft_at[::16]]}  # every 16th


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--prefixes", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 30000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = asyncio.run(run(a))
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["failed"] == 0 and out["fresh_request_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
