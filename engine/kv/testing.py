"""Property-based testing of the block manager: workloads, profiles, coverage, the state machine.

A product feature, not only CI: drive ``BlockManager`` (or a subclass) with your own workloads::

    from hypothesis.stateful import run_state_machine_as_test
    from engine.kv.testing import kv_settings, kv_state_machine, workloads
    run_state_machine_as_test(kv_state_machine(workload=workloads(max_pool=64)),
                              settings=kv_settings("long"))

The pieces live in two modules this one re-exports: ``engine.kv.workloads`` (workloads, prompts,
coverage) and ``engine.kv.machine`` (the state machine, which imports the workloads, never this
module: no import circle). Hypothesis is imported in these three only; ``engine.kv`` itself never
needs it. ``cuteinfer check-kv`` runs the ``long`` profile and prints ``COVERAGE``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from engine.kv.block_manager import BlockManager
from engine.kv.machine import KVStateMachine
from engine.kv.prefix_cache import page_hash
from engine.kv.workloads import (
    COVERAGE,
    DEFAULT_MIX,
    Coverage,
    Workload,
    prompts,
    reset_coverage,
    weak_hash,
    workloads,
)

# Why the CI profile is enough: 200 random workloads x up to 100 steps (~13,000 steps, every
# invariant checked after each) take ~18 s on one core of the 2-core dev box. Measured with
# `cuteinfer check-kv --profile ci`, a run fires every action hundreds of times and covers both
# duplicate policies (~25 allowed, ~30 rejected), pinned primaries released, ~130 collisions on
# the weak hash, ~1,100 refused allocations, ~230 evictions, ~200 cache drains, ~400 speculative
# steps and ~300-700 steps whose by-reference total exceeds the physical pool. Each deliberately
# broken variant in tests/kv/mutants.py was caught in 10 of 10 random runs, within 2-83
# workloads (median <= 11): a 2.4x margin below 200 (re-measured once the manager stopped keeping
# token ids and the machine passed them at every commit). The pools are tiny (2-16 pages, page
# sizes 1-4, alphabets of 2-3 tokens), so near-capacity and prefix collisions are the common case.
# `long` (2,000 x 120, ~3 min) is for soak runs and `cuteinfer check-kv`.
PROFILES: dict[str, settings] = {
    "ci": settings(max_examples=200, stateful_step_count=100, deadline=None, database=None,
                   print_blob=True, suppress_health_check=[HealthCheck.too_slow]),
    "long": settings(max_examples=2000, stateful_step_count=120, deadline=None, database=None,
                     print_blob=True, suppress_health_check=[HealthCheck.too_slow]),
}


def profile_from_env() -> str:
    """``HYPOTHESIS_PROFILE`` (default ``ci``). Read here, not in ``engine.envs``, because
    ``engine.kv`` imports nothing else from the engine."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "").strip() or "ci"
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: use one of {sorted(PROFILES)}")
    return name


def kv_settings(profile: str | None = None, **overrides: object) -> settings:
    """Settings of a profile (``ci`` | ``long``; default from the environment), with overrides
    such as ``max_examples=...``. Passed explicitly, so other suites' profiles are untouched."""
    base = PROFILES[profile or profile_from_env()]
    return settings(base, **overrides) if overrides else base  # type: ignore[arg-type]


def kv_state_machine(manager_cls: type[BlockManager] = BlockManager,
                     workload: st.SearchStrategy[Workload] | None = None) -> type:
    """The state machine class for a manager class (a subclass, or a broken variant) and a
    workload strategy. Run it with ``hypothesis.stateful.run_state_machine_as_test``."""
    attrs = {"manager_cls": manager_cls, "workload_strategy": workload or workloads()}
    return type(f"KVStateMachine_{manager_cls.__name__}", (KVStateMachine,), attrs)


__all__ = ["COVERAGE", "DEFAULT_MIX", "Coverage", "KVStateMachine", "PROFILES", "Workload",
           "kv_settings", "kv_state_machine", "page_hash", "profile_from_env", "prompts",
           "reset_coverage", "weak_hash", "workloads"]
