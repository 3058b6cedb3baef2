"""The project's top-level packages do not shadow an installed distribution.

Python puts the project's root first on ``sys.path`` (``run.py``, ``python -m tests``),
so a top-level folder with an ``__init__.py`` wins over any installed package of the same
import name, and a dependency that imports that package gets ours. This happened: the
paged-attention kernels were a top-level ``kernels/``, and transformers 5.25 requires
Hugging Face's ``kernels`` distribution and imports it on ``import transformers``; every
model-loading test failed with "cannot import name 'CUDAProperties' from 'kernels'".
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top_level_packages() -> list[str]:
    # ``tests`` is left out: some distributions wrongly ship a top-level ``tests``, and
    # nothing we depend on imports one.
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_the_project_has_the_top_level_packages_it_packages():
    assert {"testbed", "policies", "traces", "experiments"} <= set(top_level_packages())


def test_no_top_level_package_shares_its_import_name_with_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in top_level_packages() if name in installed}
    assert not clashes, (
        f"top-level packages of {ROOT.name}/ shadow installed distributions (import name: "
        f"distributions): {clashes}; move or rename ours"
    )
