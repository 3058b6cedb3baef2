"""The control plane, shared by the simulator and the real engine.

Pure Python: this package imports neither torch nor simpy (a test enforces it),
so that every scheduling decision is made by the same code in both modes.
"""

from testbed.core.cluster import ClusterCore
from testbed.core.config import SchedulerConfig
from testbed.core.engine import EngineCore, StepResult, WallClock
from testbed.core.kv_cache import BlockPool, KVCacheBlock, KVCacheManager
from testbed.core.outputs import Executor, ExecutorOutput, SchedulerOutput
from testbed.core.policy import ADMIT, Admission, Decision, Policy, SchedulerView
from testbed.core.request import Request, RequestStatus, SamplingParams
from testbed.core.routing import Decider, ReplicaView, Router
from testbed.core.scheduler import Scheduler

__all__ = [
    "ADMIT",
    "Admission",
    "BlockPool",
    "ClusterCore",
    "Decider",
    "Decision",
    "EngineCore",
    "Executor",
    "ExecutorOutput",
    "KVCacheBlock",
    "KVCacheManager",
    "Policy",
    "ReplicaView",
    "Request",
    "RequestStatus",
    "Router",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerView",
    "StepResult",
    "WallClock",
]
