"""``python -m testbed.search [overrides]``: the deployment search, which is
``python run.py -m +experiment=deployment_search [overrides]`` (the entry point
sets up the environment, and Hydra the sweeper and launcher), e.g.

    python -m testbed.search trace=azure_code hydra.sweeper.budget=16 \
        'hydra.sweeper.slos=[tight:0.5:0.05@p99,loose:2:0.1@p99]' \
        hydra/launcher=joblib hydra.launcher.n_jobs=2
"""

import os
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "run.py"


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    command = [sys.executable, str(RUN), "-m", "+experiment=deployment_search", *argv]
    os.execv(sys.executable, command)  # the search runs as run.py's multirun


if __name__ == "__main__":
    main(sys.argv[1:])
