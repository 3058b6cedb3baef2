"""The deployment search's Hydra sweeper (``testbed/search/sweeper.py``), where
Hydra's plugin scan finds it: Hydra instantiates sweepers only from classes
under ``hydra_plugins`` that the scan registered, not from any ``_target_``."""

from testbed.search.sweeper import DeploymentSearchSweeper as _Sweeper
from testbed.search.sweeper import register_config


class DeploymentSearchSweeper(_Sweeper):
    """``hydra/sweeper=deployment_search``: see ``testbed.search.sweeper``."""


register_config()
