"""The Ray launcher's progress display: jobs print sparse lines instead of their
own bars (Ray would stream each update as a line) and the driver shows one bar
over the sweep's jobs, only on a terminal and only where the jobs asked for bars."""

from __future__ import annotations

import io

import pytest
from omegaconf import OmegaConf

pytest.importorskip("ray", reason="hydra/launcher=ray needs the extra: pip install -e '.[ray]'")
pytest.importorskip(
    "hydra_plugins.hydra_ray_launcher",
    reason="hydra/launcher=ray needs the extra: pip install -e '.[ray]'",
)

from testbed.launchers import ray_launcher
from testbed.launchers.ray_task import without_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _jobs(progress: bool) -> list[ray_launcher.Job]:
    return [
        ray_launcher.Job(n, [], OmegaConf.create({"progress": progress}), None) for n in range(3)
    ]


def test_a_job_on_a_worker_prints_lines_instead_of_its_bar():
    config = OmegaConf.create({"progress": True, "policy": "fcfs"})
    OmegaConf.set_readonly(config, True)  # as Hydra hands a job its config
    without_bar(config)
    assert config.progress == "lines" and config.policy == "fcfs"
    off = OmegaConf.create({"progress": False})  # progress=false stays off
    without_bar(off)
    assert off.progress is False
    quiet = OmegaConf.create({"policy": "fcfs"})  # a config without the key is left alone
    without_bar(quiet)
    assert "progress" not in quiet


def test_the_driver_shows_a_bar_over_jobs_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(ray_launcher.sys, "stderr", terminal)
    bar = ray_launcher.sweep_bar(_jobs(progress=True))
    assert bar is not None and bar.total == 3
    bar.update(3)
    bar.close()
    assert "3/3" in terminal.getvalue() and "job" in terminal.getvalue()
    assert ray_launcher.sweep_bar(_jobs(progress=False)) is None  # progress=false: none


def test_no_bar_where_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(ray_launcher.sys, "stderr", io.StringIO())
    assert ray_launcher.sweep_bar(_jobs(progress=True)) is None
