"""The block manager's Hypothesis state machine (engine.kv.machine), run under the profile chosen
by HYPOTHESIS_PROFILE (default ``ci``; see engine.kv.testing for why its size is enough), and
against each deliberately broken variant, which it must catch."""

from __future__ import annotations

import pytest
from hypothesis import Phase
from hypothesis.stateful import run_state_machine_as_test

from engine.kv import KVCacheError
from engine.kv.testing import kv_settings, kv_state_machine
from tests.kv import mutants


def test_block_manager_state_machine() -> None:
    run_state_machine_as_test(kv_state_machine(), settings=kv_settings())


@pytest.mark.parametrize("manager_cls", mutants.ALL, ids=lambda c: c.__name__)
def test_state_machine_catches_broken_variant(manager_cls: type) -> None:
    # Deterministic and without shrinking, so cheap and never flaky: at this seed each variant
    # is caught within its first 8 workloads (random seeds: 2-69, see engine/kv/testing.py).
    settings = kv_settings("ci", derandomize=True, phases=[Phase.generate],
                           report_multiple_bugs=False, print_blob=False)
    with pytest.raises((AssertionError, KVCacheError)):
        run_state_machine_as_test(kv_state_machine(manager_cls), settings=settings)


def test_check_kv_command(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["check-kv", "--examples", "3", "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "actions (rules fired):" in out and "OK: every invariant held" in out


def test_check_kv_command_fails_on_a_broken_manager(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main
    from engine.kv import testing

    real = testing.kv_state_machine
    monkeypatch.setattr(testing, "kv_state_machine",
                        lambda: real(mutants.OldEngineBlockManager))
    assert main(["check-kv", "--examples", "20", "--steps", "20"]) == 1
    assert "FAILED" in capsys.readouterr().out
