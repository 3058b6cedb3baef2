"""``python -m experiments.vllm_parity``: see :mod:`experiments.vllm_parity.cli`."""

import sys

from experiments.vllm_parity.cli import main

if __name__ == "__main__":
    sys.exit(main())
