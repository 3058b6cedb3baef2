"""The discrete-event simulator: simpy replicas running the shared control plane.

Imports are lazy so that the latency models (``testbed.sim.latency``) load
without simpy, e.g. on a bare GPU machine that only profiles.
"""

from testbed.sim.latency import HardwareSpec, ProfileModel, RooflineModel, make_latency_model

__all__ = [
    "HardwareSpec",
    "ProfileModel",
    "RooflineModel",
    "SimExecutor",
    "Simulation",
    "make_latency_model",
]


def __getattr__(name: str):
    if name == "SimExecutor":
        from testbed.sim.executor import SimExecutor

        return SimExecutor
    if name == "Simulation":
        from testbed.sim.simulator import Simulation

        return Simulation
    raise AttributeError(f"module 'testbed.sim' has no attribute {name!r}")
