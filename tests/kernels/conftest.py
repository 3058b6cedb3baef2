"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest

from testbed.kernels import cpu_native


@pytest.fixture
def native():
    """The CPU path's C++ kernel; the test is skipped, with the reason, where it
    cannot be built."""
    if cpu_native.kernel() is None:
        pytest.skip(cpu_native.unavailable_reason())
