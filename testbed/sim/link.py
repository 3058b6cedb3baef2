"""KV links between instances: a transfer takes ``latency + bytes / bandwidth``,
and transfers that share a link share its bandwidth equally (processor sharing),
as concurrent flows over one NVLink, PCIe or network path do.

:class:`LinkSpec` and its :data:`LINK_PRESETS` describe a link; :class:`Link` is
one link's state, driven by whoever owns the clock (:mod:`testbed.sim.kv_transfer`
in the simulator): a transfer joins the link's sharing after its latency and
leaves when its bytes are through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bandwidths are per direction, as a KV transfer uses one.
LINK_PRESETS: dict[str, dict[str, float | str]] = {
    # NVLink 4 (H100 / H200 SXM): 900 GB/s both ways per GPU.
    "nvlink": dict(latency_s=5e-6, bandwidth_bytes_s=450e9, source="NVLink 4, 450 GB/s a way"),
    # PCIe 5.0 x16: 64 GB/s a way, about 50 in practice.
    "pcie": dict(latency_s=10e-6, bandwidth_bytes_s=50e9, source="PCIe 5.0 x16, 50 GB/s"),
    # One 400 Gb/s InfiniBand NDR (or RoCE) NIC with GPUDirect RDMA.
    "infiniband": dict(latency_s=10e-6, bandwidth_bytes_s=50e9, source="IB NDR 400 Gb/s, RDMA"),
    # The real engine's transfer between two worker processes on the 2-core CPU VM
    # (gloo over loopback, the pull through the parent, gather and scatter included),
    # as benchmarks/kv_transfer_cpu.py measured it on 64 KB - 8 MB of KV
    # (results/kv_transfer_cpu.json; held out: kv_transfer_cpu_heldout.json).
    "cpu": dict(
        latency_s=1.94e-3, bandwidth_bytes_s=0.905e9, source="measured: 2 engine processes, gloo"
    ),
}


@dataclass(frozen=True)
class LinkSpec:
    """A link's fixed latency per transfer and its bandwidth (bytes per second)."""

    name: str
    latency_s: float
    bandwidth_bytes_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.bandwidth_bytes_s > 0:
            raise ValueError(
                f"link {self.name!r}: latency_s must be >= 0 and bandwidth_bytes_s > 0 "
                f"(got {self.latency_s}, {self.bandwidth_bytes_s})"
            )

    @classmethod
    def preset(cls, name: str) -> LinkSpec:
        if name not in LINK_PRESETS:
            raise ValueError(f"unknown link {name!r}; known: {', '.join(sorted(LINK_PRESETS))}")
        return cls(name, **LINK_PRESETS[name])

    def alone_s(self, num_bytes: float) -> float:
        """How long a transfer takes with the link to itself."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_s


class Link:
    """One link's transfers in flight, sharing its bandwidth equally.

    Call :meth:`advance` to the current time before changing anything; then
    :meth:`add` a transfer (its data phase starting now), or take the ones
    :meth:`next_finish` said were due with :meth:`pop_finished`."""

    # Bytes left that count as none (float rounding): this much of the transfer.
    REL_EPS = 1e-9

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.remaining: dict[object, float] = {}  # transfer -> bytes still to move
        self._size: dict[object, float] = {}
        self.now = 0.0
        self.busy_s = 0.0  # time with at least one transfer moving data

    def advance(self, now: float) -> None:
        """Move every transfer's data on to ``now``."""
        dt = now - self.now
        if dt < 0:
            raise ValueError(f"link {self.spec.name}: time went back from {self.now} to {now}")
        if self.remaining and dt > 0:
            share = dt * self.spec.bandwidth_bytes_s / len(self.remaining)
            for key in self.remaining:
                self.remaining[key] -= share
            self.busy_s += dt
        self.now = now

    def add(self, key: object, num_bytes: float) -> None:
        """A transfer's data phase starts (at the link's current time)."""
        if key in self.remaining:
            raise ValueError(f"link {self.spec.name}: transfer {key!r} is already on it")
        self.remaining[key] = self._size[key] = float(num_bytes)

    def next_finish(self) -> float:
        """When the next transfer is through, if nothing joins before (inf: none)."""
        if not self.remaining:
            return math.inf
        least = min(self.remaining.values())
        return self.now + max(least, 0.0) * len(self.remaining) / self.spec.bandwidth_bytes_s

    def pop_finished(self) -> list[object]:
        """The transfers through by now (in the order they joined), taken off."""
        # Through: nothing left to speak of, or too little to end later than now on
        # a float clock (the rest would take under one ulp of the time).
        per_byte = len(self.remaining) / self.spec.bandwidth_bytes_s
        done = [
            k
            for k, left in self.remaining.items()
            if left <= self.REL_EPS * self._size[k] or self.now + left * per_byte <= self.now
        ]
        for k in done:
            del self.remaining[k], self._size[k]
        return done
