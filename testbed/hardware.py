"""A device as the simulator and the KV-cache sizing see it: its spec sheet, and
how much of it an engine achieves (``conf/hardware/``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class HardwareSpec:
    """A device from its spec sheet, plus how much of it an engine achieves."""

    name: str
    peak_flops: float  # dense FLOP/s at the model's dtype
    mem_bandwidth: float  # bytes/s
    memory_bytes: float
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s (MFU)
    bandwidth_efficiency: float = 0.8  # achieved fraction of bandwidth (MBU)
    step_overhead_s: float = 0.0  # per step: scheduling, input preparation, launches
    request_overhead_s: float = 0.0  # per request in the batch
    activation_reserve_bytes: float = 0.0
    source: str = ""

    @classmethod
    def from_config(cls, hardware: Mapping[str, Any]) -> HardwareSpec:
        """The spec of a hardware config group entry (``testbed.config_schema.HardwareConfig``),
        less its settings of the engine on the device."""
        names = {f.name for f in fields(HardwareSpec)}
        return HardwareSpec(**{k: v for k, v in hardware.items() if k in names})

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "mem_bandwidth",
            "memory_bytes",
            "compute_efficiency",
            "bandwidth_efficiency",
            "step_overhead_s",
            "request_overhead_s",
            "activation_reserve_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(
                    f"hardware {self.name}: {name} must be a number >= 0, got {value!r}"
                )
