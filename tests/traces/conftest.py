"""Shared helpers: the real trace files, skipped with a clear message where absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from traces import traces_dir


def shared_path(relative: str) -> Path:
    """A path under traces_dir(), or skip the test saying which path is missing."""
    path = traces_dir() / relative
    if not path.exists():
        pytest.skip(f"shared trace data not found: {path} (set TESTBED_TRACES_DIR to its folder)")
    return path


@pytest.fixture
def shared() -> object:
    """``shared("azure_llm_2023/...")``: the path, or a skip naming it."""
    return shared_path
