"""A research testbed for LLM-inference scheduling policies.

The control plane (``testbed.core``) is shared by the simulator (``testbed.sim``)
and the real engine (``testbed.engine``); see ``docs/architecture.md``.
"""

__version__ = "0.1.0"
