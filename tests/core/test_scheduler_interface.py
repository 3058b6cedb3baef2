"""The scheduler's callers use only its declared surface, and the scheduler and the
fast path only the KV-cache manager's (``testbed/core/scheduler_interface.py``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Generic, Protocol

import pytest

from testbed.core.config import SchedulerConfig
from testbed.core.kv_cache import KVCacheManager
from testbed.core.policy import Policy
from testbed.core.scheduler import Scheduler
from testbed.core.scheduler_interface import (
    EngineProcessScheduler,
    FastPathScheduler,
    KVCacheInterface,
    SchedulerInterface,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER_TYPES = {"Scheduler", "SchedulerInterface", "FastPathScheduler", "EngineProcessScheduler"}

# Each caller, and the surface it may use of the scheduler.
CALLERS = {
    "testbed/core/engine.py": SchedulerInterface,
    "testbed/core/cluster.py": SchedulerInterface,
    "testbed/core/fast_forward.py": FastPathScheduler,
    "testbed/sim/simulator.py": FastPathScheduler,
    "testbed/sim/disagg.py": SchedulerInterface,
    "testbed/engine/cluster.py": SchedulerInterface,
    "testbed/engine/llm.py": SchedulerInterface,
    "testbed/modes/sim.py": SchedulerInterface,
    "testbed/engine/worker.py": EngineProcessScheduler,
}


def declared(protocol: type) -> set[str]:
    """The names a protocol declares, its protocol bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def accesses(source: str) -> list[tuple[str, int, str]]:
    """Attributes read of a scheduler (``sched``, ``scheduler``, ``x.scheduler``, or
    a parameter annotated with a scheduler type) and of a KV-cache manager (``kv``,
    ``x.kv``): ``(of what, line, attribute)``."""
    tree = ast.parse(source)
    sched_names = {"sched", "scheduler"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            ann = node.annotation
            name = ann.id if isinstance(ann, ast.Name) else getattr(ann, "value", None)
            if name in SCHEDULER_TYPES:
                sched_names.add(node.arg)

    def is_scheduler(e: ast.expr) -> bool:
        return (isinstance(e, ast.Name) and e.id in sched_names) or (
            isinstance(e, ast.Attribute) and e.attr == "scheduler"
        )

    def is_kv(e: ast.expr) -> bool:
        return (isinstance(e, ast.Name) and e.id == "kv") or (
            isinstance(e, ast.Attribute) and e.attr == "kv"
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if is_scheduler(node.value):
                found.append(("scheduler", node.lineno, node.attr))
            elif is_kv(node.value):
                found.append(("kv", node.lineno, node.attr))
    return found


def undeclared(source: str, surface: type) -> list[str]:
    allowed = {"scheduler": declared(surface), "kv": declared(KVCacheInterface)}
    return [
        f"line {line}: {of}.{attr}"
        for of, line, attr in accesses(source)
        if attr not in allowed[of]
    ]


@pytest.mark.parametrize("path", sorted(CALLERS))
def test_callers_use_only_the_declared_scheduler_surface(path):
    bad = undeclared((ROOT / path).read_text(), CALLERS[path])
    assert not bad, f"{path} reaches past the scheduler's declared surface: {bad}"


def test_scheduler_uses_only_the_declared_kv_cache_surface():
    # The scheduler's own attributes are its business; only what it reads of the
    # manager (``self.kv``, ``kv``) is checked.
    bad = [
        f"line {line}: kv.{attr}"
        for of, line, attr in accesses((ROOT / "testbed/core/scheduler.py").read_text())
        if of == "kv" and attr not in declared(KVCacheInterface)
    ]
    assert not bad, f"the scheduler reaches past the KV-cache manager's surface: {bad}"


@pytest.mark.parametrize(
    "source",
    [
        "def f(sched):\n    return sched.kv.pool\n",
        "def f(engine):\n    return engine.scheduler.waiting\n",
        "def f(s: 'Scheduler'):\n    return s.sending\n",
        "def f(sched):\n    kv = sched.kv\n    return kv.req_to_blocks\n",
    ],
)
def test_the_scan_catches_a_reach_past_the_surface(source):
    assert undeclared(source, SchedulerInterface)


def test_the_scheduler_and_the_manager_implement_what_they_declare():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, Policy())
    missing = sorted(n for n in declared(FastPathScheduler) if not hasattr(sched, n))
    assert not missing, f"Scheduler lacks {missing}"
    missing = sorted(n for n in declared(KVCacheInterface) if not hasattr(kv, n))
    assert not missing, f"KVCacheManager lacks {missing}"


def test_prefix_cache_statistics_are_the_managers_to_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.record_admission(28, 12)
    kv.record_admission(10, 0)
    assert (kv.stats.queries, kv.stats.hits) == (38, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kv.stats.hits += 1  # type: ignore[misc]
