"""Regression: prompt-logprobs requests re-admitted after preemption. Two bugs: the admission
estimate counted 0 cached tokens while ``create()`` matched the request's own earlier pages under
its private salt (too many tokens scheduled: the step died with a KVUsageError); and a re-admitted
request whose cached prefix reached into its output got None prompt-logprob entries past its
prompt (61 entries for a 58-token prompt)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.sampling_params import SamplingParams
from engine.server.testing import make_engine, write_test_checkpoint


def test_prompt_logprobs_requests_survive_preemption(tmp_path: Path) -> None:
    model = write_test_checkpoint(tmp_path / "tiny", "tiny")
    eng = make_engine(model, block_size=4, num_gpu_blocks_override=80, max_model_len=200,
                      max_num_batched_tokens=40)
    rng = np.random.default_rng(0)
    reqs = [eng.add_request(rng.integers(10, 500, int(rng.integers(20, 60))).tolist(),
                            SamplingParams(temperature=0.0, max_tokens=int(rng.integers(20, 80)),
                                           ignore_eos=True,
                                           prompt_logprobs=1 if i % 2 == 0 else None))
            for i in range(12)]
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert eng.scheduler.num_preemptions > 0, "the workload must preempt to test re-admission"
    assert eng.stats.failed_steps == 0
    for r in reqs:
        assert r.finish_reason.value == "length", (r.request_id, r.finish_reason, r.error)
        assert len(r.output_token_ids) == r.params.max_tokens
        if r.params.prompt_logprobs is not None:
            assert len(r.prompt_logprobs) == len(r.prompt_token_ids)
