"""testbed/hardware.py: which conf/hardware entry describes a GPU by its name, and
that entry read without Hydra (the GPU check and the benchmarks on a bare machine)."""

from __future__ import annotations

import pytest

from testbed.config_schema import compose_config
from testbed.hardware import HARDWARE_CONFIGS, HardwareSpec, gpu_entry, spec_sheet


@pytest.mark.parametrize(
    "name, entry",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", None),  # 4.8 TB/s too, but another power limit and memory
        ("NVIDIA H100 PCIe", None),  # 2.0 TB/s, not the SXM part's 3.35
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-SXM4-40GB", None),  # 1.6 TB/s
        ("Tesla T4", None),
    ],
)
def test_a_gpu_is_described_only_by_the_entry_of_its_own_part(name, entry):
    assert gpu_entry(name) == entry


@pytest.mark.parametrize("entry", sorted(p.stem for p in HARDWARE_CONFIGS.glob("*.yaml")))
def test_the_spec_sheet_read_without_hydra_is_the_one_a_run_composes(entry):
    composed = HardwareSpec.from_config(compose_config([f"hardware={entry}"]).hardware)
    assert spec_sheet(entry) == composed


def test_every_gpu_entry_has_a_config():
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
        assert spec_sheet(gpu_entry(name)).mem_bandwidth > 1e12


def test_an_unknown_entry_names_the_folder_and_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"no hardware config .*h300.*known: \['a100'"):
        spec_sheet("h300")
