"""The device a real engine runs on: which one, its dtype, the cores it is pinned
to, and the machine's name that profiles and real runs record."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

import torch

from testbed.errors import InputError
from testbed.host import cpu_fields


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The named dtype; unnamed (None or ``auto``): float32 on a CPU (exact, and the
    precision CPU profiles are taken in), bfloat16 on an accelerator."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r}: not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def pin_cpus(cpus: Sequence[int]) -> None:
    """Pin this process (the engine's loop and torch's threads) to ``cpus``, so
    that other work on the machine runs on the other cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("hardware.cpus: pinning to cores needs Linux (os.sched_setaffinity)")
    wanted = set(cpus) if isinstance(cpus, Sequence) else set()
    if not wanted or not all(isinstance(c, int) and not isinstance(c, bool) for c in wanted):
        raise ValueError(f"hardware.cpus must be a non-empty list of core numbers, got {cpus!r}")
    usable = set(range(os.cpu_count() or 1))
    if not wanted <= usable:
        raise ValueError(
            f"hardware.cpus: cores {sorted(wanted - usable)} do not exist on this machine "
            f"(cores 0-{max(usable)})"
        )
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as e:  # cores this process may not use (a container's cpuset)
        raise ValueError(f"hardware.cpus: cannot pin to cores {sorted(wanted)}: {e}") from e


def cpu_name() -> str:
    """The host CPU's model name and widest vector extension (Linux; what
    ``platform`` knows elsewhere): two VMs of one kind may differ 2-3x in a small
    model's step time (an AVX-512 CPU against an AVX2 one)."""
    fields = cpu_fields()
    if not fields:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    vector = next((f for f in ("avx512f", "avx2", "avx", "neon") if f in flags), "")
    name = fields.get("model name") or platform.machine()
    return name + (f", {vector.removesuffix('f').upper()}" if vector else "")


def machine_name(device: torch.device) -> str:
    """What a step's latency depends on beyond the engine's settings: the GPU's
    name for a CUDA device, else :func:`cpu_name`. A profile records it
    (``machine``) and so does every real run's ``metrics.json``, so that a run
    compared with a profile measured elsewhere says so
    (the fidelity experiment, experiments/fidelity)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
