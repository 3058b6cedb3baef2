"""Per-request and per-step records, and the metrics computed from them."""

from testbed.metrics.result import RunResult
from testbed.metrics.steplog import StepLog

__all__ = ["RunResult", "StepLog"]
