"""The discrete-event simulator: simpy replicas running the shared control plane."""

from testbed.sim.executor import SimExecutor
from testbed.sim.latency import HardwareSpec, ProfileModel, RooflineModel, make_latency_model
from testbed.sim.simulator import Simulation

__all__ = [
    "HardwareSpec",
    "ProfileModel",
    "RooflineModel",
    "SimExecutor",
    "Simulation",
    "make_latency_model",
]
