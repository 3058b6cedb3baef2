"""The engine's OpenMP pool sleeps rather than spins unless the user chose, set
before torch loads it (testbed/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.models import PROJECT_ROOT

SHOW = "import json, os; {first}; from testbed.threads import thread_settings; " + (
    "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), thread_settings()]))"
)


def settings(first: str, **env: str) -> tuple[str | None, dict]:
    base = {k: v for k, v in os.environ.items() if "OMP_WAIT_POLICY" not in k}
    out = subprocess.run(
        [sys.executable, "-c", SHOW.format(first=first)],
        capture_output=True, text=True, cwd=PROJECT_ROOT, env={**base, **env}, check=True,
    )  # fmt: skip
    return tuple(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("first", "env", "policy", "recorded"),
    [
        ("import testbed", {}, "PASSIVE", "PASSIVE"),
        ("import testbed", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE", "ACTIVE"),
        ("import testbed", {"TESTBED_OMP_WAIT_POLICY": "openmp"}, None, "openmp default"),
        ("import torch, testbed", {}, None, "openmp default (torch was loaded before testbed)"),
    ],
)
def test_the_wait_policy_is_passive_unless_chosen_and_a_run_says_which(
    first, env, policy, recorded
):
    seen, recorded_as = settings(first, **env)
    assert seen == policy and recorded_as["omp_wait_policy"] == recorded
    assert recorded_as["threads"] >= 1 and recorded_as["interop_threads"] >= 1
