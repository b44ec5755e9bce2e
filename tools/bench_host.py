"""Host overhead of a decode step, without a GPU: the engine (scheduler, block manager, step
builder, output processing) over a null executor that returns tokens after ``--gpu-ms`` of
sleep (the time a real step waits on the GPU, GIL released).

    python -m tools.bench_host --batch 64                 # engine.step alone
    python -m tools.bench_host --batch 64 --constrained 16  # + 16 rows under a JSON schema
    python -m tools.bench_host --batch 64 --server        # + the OpenAI server, streaming clients

``--constrained N``: the batch runs twice over a Qwen3-tokenizer checkpoint, all rows plain, then
N of them under ``--schema`` (tools/bench_structured.py's schemas): the host's share of a
structured-output step (logits processor rows, matcher advances, the grammar masks' thread), the
quantity issue 17's 0.6b aim is short of. The null executor samples, for a constrained row, the
lowest token its mask allows, and reports how long it waited for the masks (``mask_wait_ms``).

``--server`` starts the server in this process and drives it with tools/bench_serving.py
(token-id prompts, 128 in / 256 out, concurrency = batch); the TPOT above ``--gpu-ms`` is the
host's share of a serving step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.executor.base import Executor
from engine.sampling_params import SamplingParams
from engine.step import StepOutput


class NullExecutor(Executor):
    """Returns random tokens after sleeping ``gpu_ms`` (stands in for the GPU); a row under a
    grammar gets the lowest token its mask allows (after waiting for the masks)."""

    num_pages, page_size = 0, 16

    def __init__(self, gpu_ms: float, vocab: int) -> None:
        self.gpu_s, self.vocab = gpu_ms / 1e3, vocab
        self.rng = np.random.default_rng(0)
        self.mask_wait_s = 0.0

    def execute(self, b):
        if self.gpu_s:
            time.sleep(self.gpu_s)
        n = b.sample_token_idx.shape[0]
        out = self.rng.integers(10, self.vocab, n).astype(np.int32)
        if b.procs is not None:
            t = time.perf_counter()
            b.procs.fill_masks()
            self.mask_wait_s += time.perf_counter() - t
            _allowed(out, b.procs)
        return StepOutput(sampled=out, graph=b.is_decode)


def _allowed(out: np.ndarray, procs) -> None:
    """``out[r]`` = the lowest token row r's grammar mask allows, for every constrained row."""
    rows = np.flatnonzero(procs.grammar_row >= 0)
    if not rows.size:
        return
    masks = procs.grammar_mask[procs.grammar_row[rows]]
    words = (masks != 0).argmax(axis=1)
    for i, (r, w) in enumerate(zip(rows.tolist(), words.tolist(), strict=True)):
        x = int(masks[i, w])
        out[r] = w * 32 + (x & -x).bit_length() - 1


def make_engine(batch: int, gpu_ms: float, model_dir: Path, kind: str = "tiny"):
    from engine.server.testing import make_engine as make
    from engine.server.testing import write_test_checkpoint

    if not (model_dir / "config.json").exists():
        write_test_checkpoint(model_dir, kind)
    eng = make(model_dir, max_num_seqs=batch, max_model_len=1024,
               num_gpu_blocks_override=batch * 64 + 8, max_num_batched_tokens=8192)
    eng.executor = NullExecutor(gpu_ms, min(eng.model_config.vocab_size, 1000))
    return eng


def bench_engine(batch: int, gpu_ms: float, model_dir: Path, constrained: int = 0,
                 schema: str = "records_unbounded", kind: str = "tiny",
                 max_tokens: int = 256) -> dict:
    from engine.sampling_params import StructuredOutputsParams

    eng = make_engine(batch, gpu_ms, model_dir, kind)
    rng = np.random.default_rng(1)
    for i in range(batch):
        so = None
        if i < constrained:
            from tools.bench_structured import SCHEMAS

            so = StructuredOutputsParams(json=SCHEMAS[schema])
        eng.add_request(rng.integers(10, 1000, 128).tolist(),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                       structured_outputs=so))
    done = eng.stats.steps
    eng.step()  # the prefill (with async scheduling: launched, completed by the next call)
    times = []
    wait0 = eng.executor.mask_wait_s
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    host = (np.array(times) - gpu_ms / 1e3) * 1e3
    # steps: decode steps completed (a call may complete the step launched by the call before)
    steps = eng.stats.steps - done - 1
    rec = {"mode": "engine", "batch": batch, "gpu_ms": gpu_ms, "steps": steps,
           "host_ms_median": round(float(np.median(host)), 3),
           "host_ms_p90": round(float(np.percentile(host, 90)), 3)}
    if constrained:
        rec.update(constrained=constrained, schema=schema, mask_wait_ms=round(
            (eng.executor.mask_wait_s - wait0) / max(steps, 1) * 1e3, 3))
    return rec


def bench_server(batch: int, gpu_ms: float, model_dir: Path, port: int) -> dict:
    from engine.server.launch import OpenAIServer

    eng = make_engine(batch, gpu_ms, model_dir)
    srv = OpenAIServer(eng, host="127.0.0.1", port=port, log_level="warning")
    srv.start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tools.bench_serving", "--base-url",
             f"http://127.0.0.1:{port}", "--random-input-len", "128", "--random-output-len",
             "256", "--num-prompts", str(2 * batch), "--max-concurrency", str(batch),
             "--ignore-eos", "--vocab-range", "10", "1000"],
            capture_output=True, text=True, timeout=600)
    finally:
        srv.stop()
    tpot = [float(line.split()[-1]) for line in out.stdout.splitlines()
            if line.startswith("Mean TPOT")]
    if not tpot:
        raise RuntimeError(f"bench_serving failed:\n{out.stdout}\n{out.stderr}")
    return {"mode": "server", "batch": batch, "gpu_ms": gpu_ms, "tpot_ms": tpot[0],
            "host_ms": round(tpot[0] - gpu_ms, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpu-ms", type=float, default=None,
                    help="null executor's sleep per step (default 0, or 8 with --server)")
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--constrained", type=int, default=0, metavar="N",
                    help="also run with N of the rows under --schema (needs a tokenizer: a "
                         "Qwen3-tokenizer checkpoint is written)")
    ap.add_argument("--schema", default="records_unbounded",
                    help="tools/bench_structured.py's schema for --constrained rows")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=8479)
    args = ap.parse_args(argv)
    gpu_ms = args.gpu_ms if args.gpu_ms is not None else (8.0 if args.server else 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        if args.server:
            print(bench_server(args.batch, gpu_ms, model_dir, args.port))
        elif args.constrained:
            model_dir = Path(tmp) / "chat"
            plain = bench_engine(args.batch, gpu_ms, model_dir, 0, kind="chat",
                                 max_tokens=args.max_tokens)
            con = bench_engine(args.batch, gpu_ms, model_dir, args.constrained, args.schema,
                               kind="chat", max_tokens=args.max_tokens)
            print({**con, "plain_host_ms_median": plain["host_ms_median"],
                   "added_ms_median": round(con["host_ms_median"]
                                            - plain["host_ms_median"], 3)})
        else:
            print(bench_engine(args.batch, gpu_ms, model_dir, max_tokens=args.max_tokens))


if __name__ == "__main__":
    main()
