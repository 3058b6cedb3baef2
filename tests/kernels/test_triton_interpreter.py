"""Runs ``interp_cases.py`` (Triton kernels vs references) in the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before ``testbed.kernels.triton_kernels`` is imported, and
set in this process it would turn every later Triton import into the interpreter's.
So each group of cases runs in its own pytest subprocess with the variable set; its
output is shown when it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("interp_cases.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def run_cases(keyword: str, marker: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    cmd += ["-m", marker, "-k", keyword]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # Exit code 5 (nothing collected) fails too: a renamed case must not pass silently.
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)}\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}", pytrace=False)


@pytest.mark.parametrize(
    "kernel", ["reshape_and_cache", "decode", "prefill", "select_backend", "warm_up", "engine"]
)
def test_triton_kernel_in_interpreter(kernel):
    run_cases(f"test_{kernel}", "not slow")


@pytest.mark.slow
def test_triton_kernels_in_interpreter_wider_grid():
    run_cases("test_", "slow")
