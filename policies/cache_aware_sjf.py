"""Cache-aware shortest job first.

The work a request costs is what the engine must compute: its prompt tokens
not already in the prefix cache, plus its output tokens. Ordering by that size
favours requests whose prefix is cached (the idea behind SGLang's
longest-prefix-match ordering and cache-aware job sizes in later work). The
cached part changes as the cache fills and evicts, so the key is dynamic.
"""

from policies.sjf import SJF
from testbed.core.request import Request


class CacheAwareSJF(SJF):
    """Shortest (uncached prompt + output) first."""

    name = "cache_aware_sjf"
    dynamic_key = True

    def job_size(self, request: Request) -> float:
        cached = self.view.prefix_hit_tokens(request) if self.view is not None else 0
        return request.num_prompt_tokens - cached + super().job_size(request)
