"""Random logits-processor steps for the kernel and graph tests: a mixed batch of rows with
penalties, logit_bias, min_tokens, allowed_token_ids and grammar masks, and rows with none."""

from __future__ import annotations

import numpy as np

from engine.logits_processors import LogitsProcessorState, token_bits
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step import FLAG_GRAMMAR, FLAG_SAVE_RAW, ProcessorRows


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    kw: dict = {}
    u = rng.random()
    if u < 0.25:  # nothing: a plain row in the mixed batch
        return SamplingParams(max_tokens=64)
    if rng.random() < 0.7:
        kw["repetition_penalty"] = float(rng.choice([0.5, 0.9, 1.0, 1.3, 2.0]))
        kw["frequency_penalty"] = float(rng.choice([-1.0, 0.0, 0.4, 2.0]))
        kw["presence_penalty"] = float(rng.choice([-0.5, 0.0, 0.7, 1.5]))
    if rng.random() < 0.5:
        ids = rng.choice(vocab, int(rng.integers(1, 60)), replace=False)
        kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in ids}
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = rng.choice(vocab, int(rng.integers(1, vocab // 2)),
                                             replace=False).tolist()
    if rng.random() < 0.4:
        kw["min_tokens"] = int(rng.integers(1, 12))
        kw["stop_token_ids"] = rng.choice(vocab, 3, replace=False).tolist()
    if rng.random() < 0.3:
        kw["logprobs"] = 2
    return SamplingParams(max_tokens=64, **kw)


def random_step(rng: np.random.Generator, rows: int, vocab: int, num_slots: int
                ) -> tuple[ProcessorRows, np.ndarray, list[Request]]:
    """(rows, sample_steps, requests): every row's processors, about a third of the rows also
    constrained by a random grammar mask (some tokens always allowed)."""
    state = LogitsProcessorState(None, vocab, (), num_slots=num_slots)
    reqs = []
    for i in range(rows):
        if i == 0:  # one row always has processors
            params = SamplingParams(max_tokens=64, logit_bias={1: 5.0}, repetition_penalty=1.2)
        elif i == rows - 1:  # and one (of two or more) none: the batch is always mixed
            params = SamplingParams(max_tokens=64)
        else:
            params = random_params(rng, vocab)
        req = Request(f"r{i}", rng.integers(0, vocab, int(rng.integers(1, 50))).tolist(),
                      params, seed=i, arrival=i, eos_token_ids=(3,), max_model_len=4096)
        req.output_token_ids = rng.integers(0, vocab // 4, int(rng.integers(0, 40))).tolist()
        state.attach(req)
        reqs.append(req)
    step = state.prepare(reqs)
    assert step is not None
    constrained = np.nonzero(rng.random(max(rows - 1, 1)) < 0.35)[0]  # never the plain row
    masks = []
    for j, r in enumerate(constrained):
        keep = rng.random(vocab) < rng.choice([0.001, 0.05, 0.5])
        keep[rng.integers(0, vocab, 3)] = True
        masks.append(token_bits(np.nonzero(keep)[0], vocab))
        step.flags[r] |= FLAG_GRAMMAR
        step.grammar_row[r] = j
    if masks:
        step.grammar_mask = np.stack(masks)
    for r in range(rows):
        if int(step.flags[r]) & ~FLAG_GRAMMAR and reqs[r].params.logprobs is not None:
            step.flags[r] |= FLAG_SAVE_RAW
    steps = np.array([len(r.output_token_ids) for r in reqs], np.uint32)
    return step, steps, reqs
