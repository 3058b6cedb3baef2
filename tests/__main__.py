"""The test command: ``python -m tests`` (sets itself up on a fresh machine).

Arguments go to pytest, e.g. ``python -m tests -k scheduler``;
``python -m tests --quick`` runs the everyday subset (no integration or slow tests).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import bootstrap  # noqa: E402

bootstrap.ensure(["-m", "tests", *sys.argv[1:]], with_dev=True)

import os  # noqa: E402

import pytest  # noqa: E402

os.chdir(ROOT)
sys.exit(pytest.main(sys.argv[1:]))
