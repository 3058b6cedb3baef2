"""The control plane imports neither torch nor simpy: both modes run the same code."""

import subprocess
import sys


def test_core_and_policies_import_no_data_plane():
    code = (
        "import sys, testbed.core, policies\n"
        "from policies import REGISTRY, make_policy\n"
        "[make_policy(n) for n in REGISTRY]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'simpy', 'numpy', 'triton', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
