"""``mode=profile``: measure the real engine on this machine and write the
profile table the simulator reads (``profiles/<hardware>/<model>.csv``)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from testbed.build import engine_args, in_project, run_model
from testbed.engine.factory import engine_model
from testbed.profiling.fit_report import report_profile
from testbed.profiling.profiler import run_profile


def profile(cfg: DictConfig) -> dict[str, Any]:
    """Profile ``cfg``'s model on its hardware; where the table went and its fit."""
    model = engine_model(run_model(cfg), cfg.mode.num_layers)
    print(f"profiling {model[2]} on {cfg.hardware.name}: grid {cfg.mode.grid}")
    path = run_profile(
        engine_args(cfg),
        cfg.mode.grid,
        cfg.mode.repeats,
        cfg.mode.warmup,
        in_project(cfg.profiles_dir),
        cfg.hardware.name,
        model[2],
        model=model,
        replay_requests=cfg.mode.replay_requests,
        sparse_requests=cfg.mode.replay_sparse_requests,
        max_grid_s=cfg.mode.max_grid_s,
        reference_cpus=cfg.hardware.reference_cpus,
    )
    return {"mode": "profile", "profile": str(path), "fit_rel_error": report_profile(path)}
