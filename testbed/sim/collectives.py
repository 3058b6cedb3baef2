"""Measured NCCL collective times (Vidur's published all-reduce and send/recv medians),
made compact by ``scripts/compact_vidur_profiles.py`` into
``data/collectives_<gpu>_<topology>.json``.

Between measured sizes a time is interpolated linearly in log size; above the largest it
grows linearly at the last segment's bandwidth; below the smallest it is the smallest's
(a small message costs the collective's latency)."""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
# A collective where none was measured (the roofline, a GPU without tables): a ring
# over the spec sheet's link, after a fixed start-up latency of NCCL's order.
RING_LATENCY_S = 20e-6


def ring_share(n: int) -> float:
    """The share of a message each of ``n`` ranks sends in a ring all-reduce."""
    return 2 * (n - 1) / n


class _Curve:
    """One collective's ms at knots of message size (bytes)."""

    __slots__ = ("_log", "_ms", "_sizes")

    def __init__(self, sizes: list[float], ms: list[float]) -> None:
        self._sizes, self._ms = sizes, ms
        self._log = [math.log(s) for s in sizes]

    def seconds(self, nbytes: float) -> float:
        xs, ys = self._sizes, self._ms
        if nbytes <= xs[0]:
            return ys[0] * 1e-3
        if nbytes >= xs[-1]:
            per_byte = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return (ys[-1] + (nbytes - xs[-1]) * per_byte) * 1e-3
        i = bisect.bisect_right(xs, nbytes)
        x0, x1 = self._log[i - 1], self._log[i]
        return (ys[i - 1] + (ys[i] - ys[i - 1]) * (math.log(nbytes) - x0) / (x1 - x0)) * 1e-3


def topologies(data_dir: Path | None = None) -> list[tuple[str, str]]:
    """The (gpu, topology) pairs with collective times in ``data_dir``."""
    folder = Path(data_dir) if data_dir is not None else DATA_DIR
    names = (p.stem.removeprefix("collectives_") for p in folder.glob("collectives_*.json"))
    return sorted(tuple(n.split("_", 1)) for n in names if "_" in n)


class Collectives:
    """NCCL all-reduce and send/recv times of one GPU kind in one topology.

    ``devices_per_node`` picks a measured placement (how many of the workers share a
    node); by default the most packed one measured: the workers of a tensor-parallel
    group in one box, and a pipeline hand-over inside a box."""

    def __init__(
        self,
        source: str,
        all_reduce: dict[tuple[int, int], _Curve],
        send_recv: dict[tuple[int, int], _Curve],
    ) -> None:
        self.source = source
        self._all_reduce, self._send_recv = all_reduce, send_recv

    @classmethod
    def load(cls, gpu: str, topology: str = "dgx", data_dir: Path | None = None) -> Collectives:
        """Read ``collectives_<gpu>_<topology>.json``; a ValueError lists what exists."""
        folder = Path(data_dir) if data_dir is not None else DATA_DIR
        path = folder / f"collectives_{gpu.lower()}_{topology.lower()}.json"
        if not path.is_file():
            known = ", ".join(f"{g}/{t}" for g, t in topologies(folder)) or "none"
            raise ValueError(
                f"no collective times for GPU {gpu!r} in topology {topology!r} in {folder}; "
                f"known (gpu/topology): {known}"
            )
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
        curves = {name: _curves(obj, name, path) for name in ("all_reduce", "send_recv")}
        commit = obj.get("source", {}).get("commit", "?")
        source = f"measured: NCCL {gpu.lower()} {topology.lower()} (vidur {commit})"
        return cls(source, curves["all_reduce"], curves["send_recv"])

    def all_reduce_s(
        self, nbytes: float, num_workers: int, devices_per_node: int | None = None
    ) -> float:
        """Seconds of an all-reduce of ``nbytes`` over ``num_workers`` GPUs (0 for one)."""
        if num_workers == 1:
            return 0.0
        return self._pick(self._all_reduce, "all_reduce", num_workers, devices_per_node, nbytes)

    def send_recv_s(self, nbytes: float, devices_per_node: int | None = None) -> float:
        """Seconds to send ``nbytes`` from one GPU to another."""
        return self._pick(self._send_recv, "send_recv", 2, devices_per_node, nbytes)

    def workers(self) -> list[int]:
        """The all-reduce group sizes measured."""
        return sorted({w for w, _ in self._all_reduce})

    def _pick(self, curves, name, num_workers, devices_per_node, nbytes) -> float:
        if nbytes < 0:
            raise ValueError(f"{name}: nbytes must be >= 0, got {nbytes}")
        placements = sorted(d for w, d in curves if w == num_workers)
        if not placements:
            measured = sorted({w for w, _ in curves})
            raise ValueError(
                f"{name} over {num_workers} workers was not measured ({self.source}); "
                f"measured: {measured} workers"
            )
        dpn = placements[-1] if devices_per_node is None else devices_per_node
        if dpn not in placements:
            raise ValueError(
                f"{name} over {num_workers} workers with {dpn} per node was not measured "
                f"({self.source}); measured devices_per_node: {placements}"
            )
        if nbytes == 0:
            return 0.0
        return curves[(num_workers, dpn)].seconds(nbytes)


def _curves(obj: dict[str, Any], name: str, path: Path) -> dict[tuple[int, int], _Curve]:
    """One collective's curves from its JSON form, checked field by field."""
    out = {}
    for i, entry in enumerate(obj.get(name) or []):
        where = f"{path}: {name}[{i}]"
        try:
            key = (int(entry["num_workers"]), int(entry["devices_per_node"]))
            sizes, ms = [float(s) for s in entry["bytes"]], [float(t) for t in entry["ms"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
        if len(sizes) < 2 or len(sizes) != len(ms) or sorted(set(sizes)) != sizes or sizes[0] <= 0:
            raise ValueError(f"{where}: bytes/ms must be two matching lists, sizes rising from > 0")
        out[key] = _Curve(sizes, ms)
    if not out:
        raise ValueError(f"{path}: no {name} entries")
    return out
