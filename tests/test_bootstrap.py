"""testbed/bootstrap.py: a run in a set-up environment installs nothing more, even
where a stray ``*.egg-info`` of the project sits in the checkout (on ``sys.path``
as the script's folder, it is found before the installed distribution)."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from testbed import bootstrap


def test_the_installed_project_is_found_past_a_stray_egg_info(tmp_path, monkeypatch):
    name = bootstrap._project_name()
    if not any(True for _ in importlib.metadata.distributions(name=name)):
        pytest.skip(f"the project ({name}) is not installed in this environment")
    if not bootstrap._project_installed():
        pytest.skip("this environment's install is of another checkout")
    stray = tmp_path / f"{name}.egg-info"
    stray.mkdir()
    (stray / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert importlib.metadata.distribution(name).version == "0.0.0"  # the stray one first
    assert bootstrap._project_installed()
