"""The testbed's Hydra launchers, where Hydra looks for them (it makes launchers only
from the ``hydra_plugins`` package); their work is in ``testbed/launchers/``."""
