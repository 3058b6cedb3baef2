"""testbed/host.py: what this machine's CPU is and which cores a process may use,
as the device's name, the C++ kernel's build and the cluster's threads read them."""

from __future__ import annotations

import os
import sys

import pytest

from testbed import host
from testbed.engine.device import cpu_name
from testbed.kernels import cpu_native

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")


@linux
def test_the_first_processors_fields_name_the_cpu():
    fields = host.cpu_fields()
    assert fields.get("processor") == "0"  # the first block, not a later one's
    assert fields.get("flags") or fields.get("Features")
    assert cpu_name().startswith(fields.get("model name", ""))


def test_the_kernels_build_is_named_per_cpu_feature_set(monkeypatch):
    """-march=native code must not be loaded on a CPU with other features."""
    monkeypatch.setattr(cpu_native, "cpu_fields", lambda: {"flags": "fpu sse2 avx2"})
    avx2 = cpu_native._build_name()
    monkeypatch.setattr(cpu_native, "cpu_fields", lambda: {"flags": "fpu sse2 avx2 avx512f"})
    assert cpu_native._build_name() != avx2
    assert avx2.startswith("testbed_cpu_")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_usable_cores_follow_this_process_affinity():
    cores = os.sched_getaffinity(0)
    assert host.usable_cores() == len(cores) <= (os.cpu_count() or 1)
    os.sched_setaffinity(0, {min(cores)})  # tests/conftest.py puts it back
    assert host.usable_cores() == 1
