"""GPU tests: run on a Hopper GPU with nvidia-cutlass-dsl; skipped elsewhere, saying why."""

from __future__ import annotations

import importlib.util

import pytest


def _skip_reason() -> str | None:
    from engine.cuda.driver import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        return reason
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not importable (stage the bundle: bash .gpu/stage.sh)"
    return None


_REASON = _skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {_REASON}"))


@pytest.fixture(scope="session")
def cuda_ctx():
    from engine.cuda.driver import Context

    return Context.get()


@pytest.fixture(scope="session")
def stream(cuda_ctx):
    from engine.cuda.driver import Stream

    s = Stream()
    yield s
    s.destroy()
