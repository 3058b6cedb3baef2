"""The test command: ``python -m tests`` (sets itself up on a fresh machine).

Arguments go to pytest, e.g. ``python -m tests -k scheduler``;
``python -m tests --quick`` runs the everyday subset (no integration or slow tests),
spread over this machine's cores (pytest-xdist, one worker per core, each on its
share of torch's threads) unless the arguments say ``-n`` (``-n 0``: one process,
as ``--pdb`` needs) or ``-p no:xdist``. The whole suite runs in one process: its
integration tests compare a run's speed with a profile's minutes apart, which
another worker's load beside them would skew.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import bootstrap  # noqa: E402

bootstrap.ensure(["-m", "tests", *sys.argv[1:]], with_dev=True)

import os  # noqa: E402

import pytest  # noqa: E402


def _workers(args: list[str]) -> list[str]:
    """``-n <cores>`` for ``--quick`` when xdist is importable, there is more than one
    core and the arguments choose nothing themselves; else nothing (one process)."""
    if "--quick" not in args:
        return []
    if any(a == "no:xdist" or a.startswith(("-n", "--numprocesses")) for a in args):
        return []
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    from testbed.host import usable_cores

    cores = usable_cores()
    return ["-n", str(cores)] if cores > 1 else []


os.chdir(ROOT)
args = sys.argv[1:]
sys.exit(pytest.main([*_workers(args), *args]))
