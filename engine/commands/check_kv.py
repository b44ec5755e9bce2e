"""``cuteinfer check-kv``: a property-based run of the block manager, and what it covered.

Runs the state machine of ``engine.kv.machine`` (the ``long`` profile unless told otherwise) over
random workloads, checking every invariant after every step, then prints what was exercised.
Exit status 0 when every invariant held; 1 with Hypothesis' falsifying example otherwise.
"""

from __future__ import annotations

import argparse
import time
import traceback

from engine.commands.generate import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=positive_int, default=None, metavar="N",
                        help="random workloads to run (default: the profile's; long: 2000)")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="M",
                        help="maximum steps per workload (default: the profile's; long: 120)")
    parser.add_argument("--profile", choices=("ci", "long"), default="long",
                        help="Hypothesis profile to start from (default: long)")


def run(args: argparse.Namespace) -> int:
    # Without Hypothesis this raises ModuleNotFoundError, which the CLI reports with the fix.
    from hypothesis.stateful import run_state_machine_as_test

    from engine.kv.testing import kv_settings, kv_state_machine, reset_coverage

    overrides: dict[str, object] = {}
    if args.examples is not None:
        overrides["max_examples"] = args.examples
    if args.steps is not None:
        overrides["stateful_step_count"] = args.steps
    chosen = kv_settings(args.profile, **overrides)
    print(f"check-kv: profile {args.profile}, {chosen.max_examples} workloads, "
          f"up to {chosen.stateful_step_count} steps each")
    coverage = reset_coverage()
    start = time.perf_counter()
    failed = False
    try:
        run_state_machine_as_test(kv_state_machine(), settings=chosen)
    except Exception:  # the falsifying example has been printed by Hypothesis
        traceback.print_exc()
        failed = True
    print(coverage.report())
    print(f"{'FAILED' if failed else 'OK: every invariant held after every step'} "
          f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0
