"""The Hydra callback that claims a single run's folder before Hydra writes into
it (``hydra.callbacks`` in ``conf/config.yaml``).

Hydra saves ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into
the run folder before the run starts; a run refused there because another run
holds the folder (:func:`testbed.report.rundir.claim`) would already have
overwritten the other run's record of its settings. ``on_run_start`` comes
before any of that, so the claim is made there and a refused run leaves the
folder as it found it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from testbed.errors import InputError
from testbed.report.rundir import claim


class ClaimRunDir(Callback):
    """Claims ``hydra.run.dir`` for this process (the run itself then finds the
    claim its own); exits 2 with one line where another run holds it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # as run_job does, for ${hydra:...}
        run_dir = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
        try:
            claim(run_dir, ahead=True)
        except InputError as e:
            print(f"Error: {e}", file=sys.stderr)
            sys.exit(2)
        except OSError as e:
            print(f"Error: run directory {run_dir}: cannot be written ({e})", file=sys.stderr)
            sys.exit(2)
