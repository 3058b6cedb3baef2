"""A device as the simulator and the KV-cache sizing see it: its spec sheet, and
how much of it an engine achieves (``conf/hardware/``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import yaml

from testbed.models import PROJECT_ROOT

HARDWARE_CONFIGS = PROJECT_ROOT / "conf" / "hardware"
# Cards with an entry in conf/hardware, by the name torch.cuda.get_device_name
# gives them; the entries describe the SXM parts with the most memory.
_GPU_ENTRIES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))
_OTHER_PARTS = ("PCIe", "NVL", "40GB")  # other bandwidths than their entry's


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
    # The most a step's activations take at once, beside the weights and the KV
    # cache: the simulator's input to the KV-cache formula (testbed.models.GPUMemory)
    # where the real engine measures its own after a warm-up pass at the largest step.
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


def gpu_entry(gpu_name: str) -> str | None:
    """The ``conf/hardware`` entry describing a GPU by its reported name
    ("NVIDIA H100 80GB HBM3" -> "h100"), or None where none does: a GPU check
    labels its profile and results with it, and the benchmarks take its peaks."""
    if any(part in gpu_name for part in _OTHER_PARTS):
        return None
    return next((entry for key, entry in _GPU_ENTRIES if key in gpu_name), None)


def spec_sheet(entry: str) -> HardwareSpec:
    """``conf/hardware/<entry>.yaml`` read without Hydra (the device machine has none)."""
    return HardwareSpec.from_config(_entry_fields(entry))


def _entry_fields(entry: str) -> dict[str, Any]:
    """An entry's fields over those of the entries its ``defaults`` list names
    (the schema's defaults are HardwareSpec's own)."""
    path = HARDWARE_CONFIGS / f"{entry}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in HARDWARE_CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"no hardware config {path} (known: {known})")
    own = yaml.safe_load(path.read_text())
    merged: dict[str, Any] = {}
    for parent in own.pop("defaults", []):
        if isinstance(parent, str) and parent not in ("_self_", "base_hardware"):
            merged |= _entry_fields(parent)
    return merged | own
