"""Serving benchmark in the shape of ``vllm bench serve``, against any OpenAI-compatible server.

    python -m tools.bench_serving --base-url http://127.0.0.1:8000 \\
        --random-input-len 128 --random-output-len 256 --num-prompts 512 --max-concurrency 64 \\
        [--request-rate inf] [--prompt-kind ids|words] [--ignore-eos] [--out result.json]

The command line of ``engine.server.bench_client`` (the streaming client, the statistics and the
report live there); ``--help`` lists every option.
"""

from __future__ import annotations

import sys

from engine.server.bench_client import main

if __name__ == "__main__":
    sys.exit(main())
