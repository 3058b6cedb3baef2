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
# gives them: (what the name contains, the entry, what names another part with
# other bandwidths or memory, which that entry does not describe). Compared in
# lower case; the first row that matches decides.
_GPU_ENTRIES = (
    ("h100 pcie", "h100-pcie", ()),
    ("a100-sxm4-40gb", "a100-40gb", ()),
    ("l40s", "l40s", ()),
    ("rtx 4090", "rtx4090", ("4090 d", "laptop")),  # fewer SMs / a mobile part
    ("h200", "h200", ("nvl", "gh200")),  # another power limit / Grace Hopper's memory
    ("h100", "h100", ("pcie", "nvl")),
    ("a100", "a100", ("pcie", "40gb")),
)
INTERCONNECTS = ("nvlink", "pcie", "none")


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
    # What joins it to its tensor-parallel peers: bytes/s one GPU sends them, one
    # direction (NVLink; PCIe where no NVLink); 0 with "none": a single device.
    interconnect_bandwidth: float = 0.0
    interconnect: str = "none"  # nvlink | pcie | none
    gpus_per_node: int = 1  # GPUs one such link joins (a node's)
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
            "interconnect_bandwidth",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"hardware {self.name}: {name} must be a number >= 0, got {value!r}"
                )
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(
                f"hardware {self.name}: gpus_per_node must be an integer >= 1, "
                f"got {self.gpus_per_node!r}"
            )
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(
                f"hardware {self.name}: interconnect must be one of "
                f"{', '.join(INTERCONNECTS)}, got {self.interconnect!r}"
            )
        if (self.interconnect == "none") != (self.interconnect_bandwidth == 0):
            raise ValueError(
                f"hardware {self.name}: interconnect={self.interconnect} with "
                f"interconnect_bandwidth={self.interconnect_bandwidth!r}: a link "
                "(nvlink, pcie) needs a bandwidth > 0, none needs 0"
            )


def gpu_entry(gpu_name: str) -> str | None:
    """The ``conf/hardware`` entry describing a GPU by its reported name
    ("NVIDIA H100 80GB HBM3" -> "h100"), or None where none does: a GPU check
    labels its profile and results with it, and the benchmarks take its peaks."""
    name = gpu_name.lower()
    for key, entry, other_parts in _GPU_ENTRIES:
        if key in name:
            return None if any(part in name for part in other_parts) else entry
    return None


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
