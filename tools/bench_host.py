"""Host overhead of a decode step, without a GPU: the engine (scheduler, block manager, step
builder, output processing) over a null executor that returns tokens after ``--gpu-ms`` of
sleep (the time a real step waits on the GPU, GIL released).

    python -m tools.bench_host --batch 64                 # engine.step alone
    python -m tools.bench_host --batch 64 --server        # + the OpenAI server, streaming clients

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
    """Returns random tokens after sleeping ``gpu_ms`` (stands in for the GPU)."""

    num_pages, page_size = 0, 16

    def __init__(self, gpu_ms: float, vocab: int) -> None:
        self.gpu_s, self.vocab = gpu_ms / 1e3, vocab
        self.rng = np.random.default_rng(0)

    def execute(self, b):
        if self.gpu_s:
            time.sleep(self.gpu_s)
        n = b.sample_token_idx.shape[0]
        return StepOutput(sampled=self.rng.integers(10, self.vocab, n).astype(np.int32),
                          graph=b.is_decode)


def make_engine(batch: int, gpu_ms: float, model_dir: Path):
    from engine.server.testing import make_engine as make
    from engine.server.testing import write_test_checkpoint

    if not (model_dir / "config.json").exists():
        write_test_checkpoint(model_dir, "tiny")
    eng = make(model_dir, max_num_seqs=batch, max_model_len=1024,
               num_gpu_blocks_override=batch * 64 + 8, max_num_batched_tokens=8192)
    eng.executor = NullExecutor(gpu_ms, min(eng.model_config.vocab_size, 1000))
    return eng


def bench_engine(batch: int, gpu_ms: float, model_dir: Path) -> dict:
    eng = make_engine(batch, gpu_ms, model_dir)
    rng = np.random.default_rng(1)
    for _ in range(batch):
        eng.add_request(rng.integers(10, 1000, 128).tolist(),
                        SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0))
    eng.step()  # the prefill
    done = eng.stats.steps
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    host = (np.array(times) - gpu_ms / 1e3) * 1e3
    # steps: decode steps completed (with async scheduling the first call only launches one,
    # so there is one call more than steps)
    return {"mode": "engine", "batch": batch, "gpu_ms": gpu_ms, "steps": eng.stats.steps - done,
            "host_ms_median": round(float(np.median(host)), 3),
            "host_ms_p90": round(float(np.percentile(host, 90)), 3)}


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
    ap.add_argument("--port", type=int, default=8479)
    args = ap.parse_args(argv)
    gpu_ms = args.gpu_ms if args.gpu_ms is not None else (8.0 if args.server else 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        if args.server:
            print(bench_server(args.batch, gpu_ms, model_dir, args.port))
        else:
            print(bench_engine(args.batch, gpu_ms, model_dir))


if __name__ == "__main__":
    main()
