"""Measured NCCL collective times: interpolation in log size, extrapolation by bandwidth,
placements and errors."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from testbed.sim.collectives import Collectives, topologies


def entry(workers, dpn, sizes, ms):
    return {"num_workers": workers, "devices_per_node": dpn, "bytes": sizes, "ms": ms}


def write(folder: Path, gpu="x100", topology="box") -> Path:
    obj = {
        "gpu": gpu,
        "topology": topology,
        "source": {"commit": "abc"},
        "all_reduce": [
            entry(2, 2, [1024, 4096, 1 << 20], [0.01, 0.02, 0.1]),
            entry(4, 2, [1024, 1 << 20], [0.05, 1.0]),  # across two nodes
            entry(4, 4, [1024, 1 << 20], [0.02, 0.2]),
        ],
        "send_recv": [
            entry(2, 1, [1024, 1 << 20], [0.03, 0.5]),
            entry(2, 2, [1024, 1 << 20], [0.005, 0.05]),
        ],
    }
    (folder / f"collectives_{gpu}_{topology}.json").write_text(json.dumps(obj))
    return folder


def test_interpolates_in_log_size(tmp_path):
    c = Collectives.load("x100", "box", write(tmp_path))
    assert c.all_reduce_s(1024, 2) == pytest.approx(0.01e-3)
    assert c.all_reduce_s(4096, 2) == pytest.approx(0.02e-3)
    # halfway in log size between 1 KiB and 4 KiB is 2 KiB
    assert c.all_reduce_s(2048, 2) == pytest.approx(0.015e-3)
    frac = math.log(64 * 1024 / 4096) / math.log((1 << 20) / 4096)
    assert c.all_reduce_s(64 * 1024, 2) == pytest.approx((0.02 + frac * 0.08) * 1e-3)


def test_below_the_grid_is_the_latency_and_above_it_the_last_bandwidth(tmp_path):
    c = Collectives.load("x100", "box", write(tmp_path))
    assert c.all_reduce_s(10, 2) == pytest.approx(0.01e-3)
    assert c.all_reduce_s(0, 2) == 0.0
    per_byte = (0.1 - 0.02) / ((1 << 20) - 4096)
    big = 5 << 20
    assert c.all_reduce_s(big, 2) == pytest.approx((0.1 + (big - (1 << 20)) * per_byte) * 1e-3)
    with pytest.raises(ValueError, match="nbytes"):
        c.all_reduce_s(-1, 2)


def test_one_worker_costs_nothing_and_unmeasured_counts_are_named(tmp_path):
    c = Collectives.load("x100", "box", write(tmp_path))
    assert c.all_reduce_s(1 << 30, 1) == 0.0
    assert c.workers() == [2, 4]
    with pytest.raises(ValueError, match=r"over 8 workers was not measured.*\[2, 4\]"):
        c.all_reduce_s(1024, 8)


def test_placement_defaults_to_the_most_packed(tmp_path):
    c = Collectives.load("x100", "box", write(tmp_path))
    assert c.all_reduce_s(1 << 20, 4) == pytest.approx(0.2e-3)
    assert c.all_reduce_s(1 << 20, 4, devices_per_node=2) == pytest.approx(1.0e-3)
    assert c.send_recv_s(1 << 20) == pytest.approx(0.05e-3)
    assert c.send_recv_s(1 << 20, devices_per_node=1) == pytest.approx(0.5e-3)
    with pytest.raises(ValueError, match=r"devices_per_node: \[2, 4\]"):
        c.all_reduce_s(1024, 4, devices_per_node=1)


def test_unknown_gpu_or_topology_lists_what_exists(tmp_path):
    write(tmp_path, "x100", "box")
    write(tmp_path, "y200", "ring")
    assert topologies(tmp_path) == [("x100", "box"), ("y200", "ring")]
    with pytest.raises(ValueError, match=r"x100/box, y200/ring"):
        Collectives.load("x100", "ring", tmp_path)
    with pytest.raises(ValueError, match=r"'z300'"):
        Collectives.load("z300", "box", tmp_path)


def test_bad_entry_is_named(tmp_path):
    path = write(tmp_path) / "collectives_x100_box.json"
    obj = json.loads(path.read_text())
    obj["send_recv"][1]["bytes"] = [4096, 1024]
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"send_recv\[1\]"):
        Collectives.load("x100", "box", tmp_path)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
@pytest.mark.parametrize("topology", ["dgx", "pairwise_nvlink"])
def test_committed_files_load(gpu, topology):
    c = Collectives.load(gpu, topology)
    assert c.source.startswith(f"measured: NCCL {gpu} {topology}")
    assert 2 in c.workers()
    sizes = [2**i for i in range(11, 31)]
    for n in c.workers():
        times = [c.all_reduce_s(s, n) for s in sizes]
        assert all(b >= a for a, b in itertools.pairwise(times))  # fitted non-decreasing
        assert times[0] > 0
    assert 0 < c.send_recv_s(1 << 10) < c.send_recv_s(1 << 30)
    if (gpu, topology) == ("h100", "dgx"):
        assert c.workers() == [2, 4, 8]
