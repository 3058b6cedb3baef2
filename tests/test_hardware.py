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
        ("NVIDIA GH200 480GB", None),  # Grace Hopper: another memory
        ("NVIDIA H100 PCIe", "h100-pcie"),  # 2.0 TB/s, not the SXM part's 3.35
        ("NVIDIA H100 NVL", None),  # 94 GB, 3.9 TB/s
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),  # 1.6 TB/s
        ("NVIDIA A100-PCIE-40GB", None),  # a 250 W part without NVLink
        ("NVIDIA A100 80GB PCIe", None),  # 1.9 TB/s
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", None),  # half the L40S's tensor FLOP/s
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GeForce RTX 4090 D", None),  # fewer SMs
        ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
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
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"]
    names += ["NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S", "NVIDIA GeForce RTX 4090"]
    for name in names:
        assert spec_sheet(gpu_entry(name)).mem_bandwidth > 0.8e12


@pytest.mark.parametrize(
    "entry, link, one_way, per_node",
    [
        ("h100", "nvlink", 450e9, 8),  # NVLink 4: 900 GB/s both ways together
        ("h200", "nvlink", 450e9, 8),
        ("a100", "nvlink", 300e9, 8),  # NVLink 3: 600 GB/s
        ("a100-40gb", "nvlink", 300e9, 8),
        ("h100-pcie", "pcie", 64e9, 8),  # PCIe Gen5 x16: 128 GB/s
        ("l40s", "pcie", 32e9, 8),  # PCIe Gen4 x16: 64 GB/s
        ("rtx4090", "pcie", 32e9, 8),
        ("cpu", "none", 0.0, 1),
    ],
)
def test_each_entry_names_the_link_to_its_tensor_parallel_peers(entry, link, one_way, per_node):
    spec = spec_sheet(entry)
    assert (spec.interconnect, spec.interconnect_bandwidth, spec.gpus_per_node) == (
        link,
        one_way,
        per_node,
    )


def test_the_pcie_parts_roofline_sits_below_their_sxm_siblings():
    """Each new part's peaks against its sibling's (a swapped field shows here)."""
    assert spec_sheet("h100-pcie").peak_flops < spec_sheet("h100").peak_flops
    assert spec_sheet("h100-pcie").mem_bandwidth < spec_sheet("h100").mem_bandwidth
    assert spec_sheet("a100-40gb").peak_flops == spec_sheet("a100").peak_flops
    assert spec_sheet("a100-40gb").memory_bytes < spec_sheet("a100").memory_bytes
    assert spec_sheet("rtx4090").peak_flops < spec_sheet("l40s").peak_flops
    assert spec_sheet("rtx4090").mem_bandwidth > spec_sheet("l40s").mem_bandwidth


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"interconnect": "infiniband", "interconnect_bandwidth": 1e9}, "interconnect must be one"),
        ({"interconnect": "nvlink"}, "interconnect=nvlink with interconnect_bandwidth=0"),
        ({"interconnect_bandwidth": 1e9}, "interconnect=none with interconnect_bandwidth"),
        ({"interconnect": "pcie", "interconnect_bandwidth": -1.0}, "interconnect_bandwidth must"),
        ({"gpus_per_node": 0}, "gpus_per_node must be an integer >= 1"),
    ],
)
def test_a_bad_interconnect_is_refused_naming_the_entry_and_field(fields, message):
    with pytest.raises(ValueError, match=f"hardware mine: {message}"):
        HardwareSpec("mine", 1e12, 1e12, 1e9, **fields)


def test_an_interconnect_set_on_the_command_line_reaches_the_spec():
    cfg = compose_config(["hardware=l40s", "hardware.interconnect_bandwidth=16e9"])
    assert HardwareSpec.from_config(cfg.hardware).interconnect_bandwidth == 16e9


def test_an_unknown_entry_names_the_folder_and_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"no hardware config .*h300.*known: \['a100'"):
        spec_sheet("h300")
