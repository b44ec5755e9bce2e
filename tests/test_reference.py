"""The numpy reference forward against Hugging Face float32 goldens (no torch needed)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.model.loader import load_checkpoint
from engine.model.reference import ReferenceModel
from engine.sampling import log_softmax
from tests.conftest import golden_names, greedy_cases, split_sequences
from tests.tolerances import TOL


@pytest.mark.parametrize("name", golden_names())
def test_teacher_forced_logprobs_match_hf_float32(golden_case, name):
    d, data = golden_case(name)
    model = ReferenceModel(load_checkpoint(d))
    worst = 0.0
    for tokens, target, top_ids, top_lp in split_sequences(data):
        lp = log_softmax(model.forward(tokens))
        n = len(tokens)
        got = lp[np.arange(n - 1), tokens[1:]]
        worst = max(worst, float(np.abs(got - target[:-1]).max(initial=0.0)))
        # top-5 logprobs by value (ids may swap on near-ties, values may not)
        np.testing.assert_allclose(np.sort(lp, axis=1)[:, ::-1][:, :5], top_lp, atol=1e-3)
        np.testing.assert_allclose(np.take_along_axis(lp, top_ids.astype(np.int64), 1), top_lp,
                                   atol=1e-3)
    assert worst <= TOL["ref_vs_hf_f32"]["max_abs"], worst


@pytest.mark.parametrize("name", golden_names())
def test_greedy_continuation_matches_hf(golden_case, name):
    d, data = golden_case(name)
    model = ReferenceModel(load_checkpoint(d))
    for prompt, expected in greedy_cases(data):
        seq = list(prompt)
        for _ in range(len(expected)):
            seq.append(int(np.argmax(model.forward(seq)[-1])))
        assert seq[len(prompt):] == expected
