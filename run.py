"""The testbed's entry point (Hydra).

    python run.py policy=fcfs mode=sim                      # embedded defaults
    python run.py mode=sim policy=sjf trace=azure_conv hardware=h200 model=llama3-8b
    python run.py -m mode=sim policy=fcfs,sjf,vtc trace=azure_conv   # a sweep

On a fresh machine the first call sets up ``.venv`` (see testbed/bootstrap.py).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from testbed import bootstrap  # noqa: E402

bootstrap.ensure([str(ROOT / "run.py"), *sys.argv[1:]])

from testbed.report.rundir import unwritable_output_dir  # noqa: E402

if (problem := unwritable_output_dir(sys.argv[1:])) is not None:
    print(f"Error: {problem}", file=sys.stderr)
    sys.exit(2)

import hydra  # noqa: E402
from hydra.errors import CompactHydraException  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from testbed import config_schema  # noqa: E402

config_schema.register()  # the config groups' structured configs (testbed/config_schema.py)


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    from testbed.errors import InputError
    from testbed.job import run_from_config
    from testbed.signals import ended_by_interrupts

    with ended_by_interrupts():  # a run stopped by timeout or kill writes what it measured
        try:
            metrics = run_from_config(cfg)
        except InputError as e:  # the message alone; the traceback with HYDRA_FULL_ERROR=1
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            if in_sweep():  # the job fails (the sweep goes on), named without a traceback
                raise JobInputError(str(e)) from e
            print(f"Error: {e}", file=sys.stderr)
            sys.exit(2)
    # A number for Hydra's sweepers to optimise: the mean end-to-end latency.
    return metrics.get("e2e_s_mean", 0.0)


class JobInputError(CompactHydraException):
    """A sweep job's bad input: Hydra prints its message alone, as for its own
    config errors (report/sweep_callback.py records it as the job's reason)."""


def in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


if __name__ == "__main__":
    main()
