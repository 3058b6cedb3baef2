"""Test-wide settings: W&B never leaves a temporary folder, plots draw off-screen."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


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
