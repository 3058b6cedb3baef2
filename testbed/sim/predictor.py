"""Which latency model predicts a run's steps: the measured profile of its
hardware and model where one exists, else the spec sheet's roofline."""

from __future__ import annotations

from pathlib import Path

from testbed.hardware import HardwareSpec
from testbed.models import DTYPE_BYTES, ModelSpec
from testbed.profile_table import profile_path
from testbed.sim.latency import LatencyModel
from testbed.sim.profile_model import ProfileModel
from testbed.sim.roofline import RooflineModel


def make_latency_model(
    model: ModelSpec, hw: HardwareSpec, dtype: str, profiles_dir: str | Path | None
) -> LatencyModel:
    """The profile of (hardware, model) where one exists, else the roofline model."""
    if profiles_dir is not None:
        path = profile_path(profiles_dir, hw.name, model.name)
        if path.exists():
            return ProfileModel(path)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return RooflineModel(model, hw, dtype)
