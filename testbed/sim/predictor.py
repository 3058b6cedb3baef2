"""Which latency model predicts a run's steps: the measured profile of its
hardware and model where one exists, else the GPU operator model where the
hardware has measured operator times, else the spec sheet's roofline."""

from __future__ import annotations

from pathlib import Path

from testbed.hardware import HardwareSpec
from testbed.models import DTYPE_BYTES, ModelSpec
from testbed.profile_table import profile_path
from testbed.sim.gpu_model import GPUStepModel, Parallelism, operator_gpu
from testbed.sim.latency import LatencyModel
from testbed.sim.profile_model import ProfileModel
from testbed.sim.roofline import RooflineModel

CHOICES = ("auto", "profile", "operators", "roofline")


def make_latency_model(
    model: ModelSpec,
    hw: HardwareSpec,
    dtype: str,
    profiles_dir: str | Path | None,
    parallel: Parallelism | None = None,
    choice: str = "auto",
) -> LatencyModel:
    """The model ``choice`` names; ``auto``: the profile of (hardware, model) where
    one exists for a one-GPU replica, else the operator model where the hardware
    has measured operator times, else the roofline."""
    if choice not in CHOICES:
        raise ValueError(f"mode.latency_model={choice!r}: one of {', '.join(CHOICES)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    parallel = parallel or Parallelism()
    parallel.check(model)
    if choice in ("auto", "profile"):
        path = profile_path(profiles_dir, hw.name, model.name) if profiles_dir else None
        if path is not None and path.exists() and parallel.num_gpus == 1:
            return ProfileModel(path)
        if choice == "profile":
            where = f"at {path}" if path is not None else "(no profiles_dir)"
            raise ValueError(
                f"mode.latency_model=profile: no profile of {model.name} on {hw.name} {where}"
                + (" for one GPU" if parallel.num_gpus > 1 else "")
            )
    if choice == "operators" or (choice == "auto" and operator_gpu(hw.name) is not None):
        return GPUStepModel(model, hw, dtype, parallel)
    return RooflineModel(model, hw, dtype, parallel.tensor, parallel.pipeline)
