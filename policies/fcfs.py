"""First come, first served.

The default of vLLM, SGLang and TGI: the waiting queue in arrival order, the
newest running request preempted first when the KV cache runs out.
"""

from testbed.core.policy import Policy


class FCFS(Policy):
    """Serve requests in arrival order."""

    name = "fcfs"
