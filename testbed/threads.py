"""The real engine's CPU thread pools: OpenMP's wait policy, and what a run used.

torch's intra-op threads, its matrix library's and the C++ attention kernel's are
one OpenMP (libgomp) pool. By default its threads spin after every parallel
region before they sleep; on a machine where another process holds a core, a
spinning or descheduled thread stalls every barrier of every layer, and the
engine slows several times more than losing that core would cost. A passive
pool sleeps at once. OpenMP reads the policy once, when torch loads it, so it is
set when ``testbed`` is imported (before torch), unless the user set
``OMP_WAIT_POLICY`` or ``TESTBED_OMP_WAIT_POLICY=openmp`` (OpenMP's own default).
"""

from __future__ import annotations

import os
import sys
from typing import Any

WAIT_POLICY = "PASSIVE"
KEEP = "openmp"  # TESTBED_OMP_WAIT_POLICY's value that leaves OpenMP's default
_LATE = False  # torch was loaded before the policy could be set


def set_wait_policy() -> None:
    """Set ``OMP_WAIT_POLICY`` for the engine's pool where nobody chose one (child
    processes inherit it); a no-op once torch is loaded, which is remembered."""
    global _LATE
    if "OMP_WAIT_POLICY" in os.environ or os.environ.get("TESTBED_OMP_WAIT_POLICY") == KEEP:
        return
    if "torch" in sys.modules:
        _LATE = True
        return
    os.environ["OMP_WAIT_POLICY"] = os.environ.get("TESTBED_OMP_WAIT_POLICY", WAIT_POLICY)


def thread_settings() -> dict[str, Any]:
    """What a real run's CPU work ran on: torch's intra-op and inter-op threads and
    the pool's wait policy (``metrics.json``)."""
    import torch

    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is None:
        policy = "openmp default" + (" (torch was loaded before testbed)" if _LATE else "")
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": policy,
    }
