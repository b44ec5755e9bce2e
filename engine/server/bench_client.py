"""Serving benchmark in the shape of ``vllm bench serve``, against any OpenAI-compatible server.

    python -m tools.bench_serving --base-url http://127.0.0.1:8000 \\
        --random-input-len 128 --random-output-len 256 --num-prompts 512 --max-concurrency 64 \\
        [--request-rate inf] [--prompt-kind ids|words] [--ignore-eos] [--out result.json]

Random prompts of the given input length (token ids, or random words for servers that take
text only), streamed through ``/v1/completions`` with ``stream_options.include_usage``, at a fixed
concurrency and/or a Poisson request rate. Reports output tok/s, TTFT, TPOT (time per output token
after the first) and ITL (gaps between streamed chunks) as mean, p50 and p99, as a table and as
JSON (``--out``). Needs only the standard library and aiohttp. The client is a library too
(``make_prompts``, ``run_benchmark``): the server's load tests drive it; ``tools/bench_serving.py``
is this module's command line (``main``) under its old name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass
class RequestResult:
    success: bool = False
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, request sent -> [DONE]
    itl: list[float] = field(default_factory=list)  # seconds between token-bearing chunks
    finish_reasons: list[str] = field(default_factory=list)  # one per terminal chunk seen
    stream_errors: int = 0  # error events in the stream
    done: bool = False  # saw "data: [DONE]"
    text: str = ""
    start: float = 0.0  # time.perf_counter() when sent (CLOCK_MONOTONIC: comparable with the
    # engine's step trace, which stamps perf_counter in another process of the same host)

    @property
    def terminal_events(self) -> int:
        return len(self.finish_reasons) + self.stream_errors

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_prompts(n: int, input_len: int, kind: str = "ids", seed: int = 0,
                 vocab_range: tuple[int, int] = (1000, 30000),
                 range_ratio: float = 0.0) -> list[str | list[int]]:
    """``n`` random prompts of ``input_len`` tokens (or words), lengths varied by
    ``+-range_ratio`` as vLLM's random dataset does."""
    rng = random.Random(seed)
    lo = max(1, math.floor(input_len * (1 - range_ratio)))
    hi = max(lo, math.ceil(input_len * (1 + range_ratio)))
    out: list[str | list[int]] = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        if kind == "ids":
            out.append([rng.randrange(*vocab_range) for _ in range(k)])
        else:
            out.append(" ".join(rng.choice(WORDS) for _ in range(k)))
    return out


async def send_one(session: aiohttp.ClientSession, url: str,
                   payload: dict[str, Any]) -> RequestResult:
    """POST one streamed completion and time its chunks."""
    res = RequestResult()
    t0 = time.perf_counter()
    res.start = t0
    last = t0
    try:
        async with session.post(url, json=payload) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            chunks = 0
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        body = line[5:].strip()
                        if body == b"[DONE]":
                            res.done = True
                            continue
                        obj = json.loads(body)
                        if "error" in obj:
                            res.stream_errors += 1
                            res.error = str(obj["error"].get("message", obj["error"]))
                            continue
                        if obj.get("usage"):
                            res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                            res.output_tokens = obj["usage"].get("completion_tokens", 0)
                        for ch in obj.get("choices") or []:
                            now = time.perf_counter()
                            if chunks == 0:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
                            res.text += ch.get("text") or ""
                            if ch.get("finish_reason"):
                                res.finish_reasons.append(ch["finish_reason"])
            res.latency = time.perf_counter() - t0
            if not res.output_tokens:
                res.output_tokens = chunks
            res.success = (res.done and res.stream_errors == 0 and len(res.finish_reasons) == 1)
            if not res.success and not res.error:
                res.error = (f"stream ended without exactly one terminal chunk (done={res.done}, "
                             f"finish_reasons={res.finish_reasons})")
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def get_model(base_url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{base_url}/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def run_benchmark(base_url: str, prompts: list[str | list[int]], output_len: int, *,
                        model: str | None = None, max_concurrency: int | None = None,
                        request_rate: float = math.inf, ignore_eos: bool = False,
                        temperature: float = 0.0, seed: int = 0, timeout: float = 600.0,
                        extra_body: dict[str, Any] | None = None
                        ) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send every prompt (Poisson arrivals at ``request_rate``, at most ``max_concurrency`` in
    flight); returns (summary, per-request results in prompt order)."""
    base_url = base_url.rstrip("/")
    model = model or await get_model(base_url)
    url = f"{base_url}/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(prompt: str | list[int]) -> RequestResult:
            payload = {"model": model, "prompt": prompt, "max_tokens": output_len,
                       "temperature": temperature, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra_body or {})}
            if ignore_eos:
                payload["ignore_eos"] = True
            if sem is None:
                return await send_one(session, url, payload)
            async with sem:
                return await send_one(session, url, payload)

        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return summarize(results, duration), results


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(v) - 1)
    return v[f] + (v[c] - v[f]) * (k - f)


def _stats(values: list[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in values]
    return {"mean": sum(ms) / len(ms) if ms else 0.0, "p50": percentile(ms, 50),
            "p99": percentile(ms, 99), "max": max(ms) if ms else 0.0}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }


def format_table(s: dict[str, Any]) -> str:
    rows = [("Successful requests:", f"{s['completed']}"),
            ("Failed requests:", f"{s['failed']}"),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", f"{s['total_input_tokens']}"),
            ("Total generated tokens:", f"{s['total_output_tokens']}"),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        st = s[key]
        lines += [f"{f'Mean {short} (ms):':<40}{st['mean']:<10.2f}",
                  f"{f'Median {short} (ms):':<40}{st['p50']:<10.2f}",
                  f"{f'P99 {short} (ms):':<40}{st['p99']:<10.2f}",
                  f"{f'Max {short} (ms):':<40}{st['max']:<10.2f}"]
    lines.append("=" * 50)
    for e in s.get("errors") or []:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--prompt-kind", choices=["ids", "words"], default="ids",
                    help="token-id prompts (exact lengths) or random words (text-only servers)")
    ap.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 30000],
                    metavar=("LO", "HI"), help="token ids are drawn from [LO, HI)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s (Poisson arrivals); inf = all at once (default)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly the output len")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--save-detailed", action="store_true",
                    help="include per-request results in the JSON")
    a = ap.parse_args(argv)
    prompts = make_prompts(a.num_prompts, a.random_input_len, a.prompt_kind, a.seed,
                           tuple(a.vocab_range), a.random_range_ratio)
    summary, results = asyncio.run(run_benchmark(
        a.base_url, prompts, a.random_output_len, model=a.model,
        max_concurrency=a.max_concurrency, request_rate=a.request_rate,
        ignore_eos=a.ignore_eos, temperature=a.temperature, seed=a.seed, timeout=a.timeout))
    print(format_table(summary))
    if a.out:
        config = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                  for k, v in vars(a).items()}
        doc: dict[str, Any] = {"config": config, "summary": summary}
        if a.save_detailed:
            doc["requests"] = [{**asdict(r), "tpot": r.tpot} for r in results]
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
