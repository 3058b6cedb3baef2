"""Test-wide settings: W&B never leaves a temporary folder, plots draw off-screen."""

from __future__ import annotations

import os

import pytest

from testbed.host import usable_cores

os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_configure(config):
    """A worker of ``-n N`` takes 1/N of the cores for torch's threads (and for the runs
    it starts), so that N workers do not each spin a thread per core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        import torch

        torch.set_num_threads(share)


@pytest.fixture(autouse=True, scope="session")
def _wandb_in_tmp(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    for var in (
        "WANDB_DIR",
        "WANDB_CACHE_DIR",
        "WANDB_CONFIG_DIR",
        "WANDB_DATA_DIR",
        "WANDB_ARTIFACT_DIR",
    ):
        os.environ[var] = str(root / var.lower())
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    yield


@pytest.fixture(autouse=True)
def _restore_cores_and_threads():
    """A test that runs the engine with ``hardware.cpus`` or ``threads`` pins this
    process and sets torch's threads; the next test gets them back as they were."""
    import torch

    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    yield
    if cores is not None and os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# Tests that run whole real runs, profiles, experiments or the Triton interpreter,
# by path: left out of the everyday loop, ``python -m tests --quick`` (which also
# leaves out tests marked slow).
INTEGRATION = (
    "tests/experiments/",
    "tests/engine/test_profiler.py",
    "tests/engine/test_real_runs.py",
    "tests/engine/test_cluster.py",
    "tests/engine/test_reference_probe.py",
    "tests/kernels/test_triton_interpreter.py",
    "tests/kernels/test_compile.py",
    "tests/vllm_backend/test_mode_vllm.py",
)


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the everyday subset: no integration tests (whole runs, profiles, experiments, "
        "the Triton interpreter) and none marked slow",
    )


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)
    if config.getoption("--quick"):
        kept = [i for i in items if not i.get_closest_marker("integration")]
        kept = [i for i in kept if not i.get_closest_marker("slow")]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
