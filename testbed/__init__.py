"""A research testbed for LLM-inference scheduling policies.

The control plane (``testbed.core``) is shared by the simulator (``testbed.sim``)
and the real engine (``testbed.engine``); see ``docs/architecture.md``.
``from testbed import LLM, SamplingParams`` gives the offline API (torch is
imported only when ``LLM`` is first used).
"""

from testbed.core.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from testbed.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
