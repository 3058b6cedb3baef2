"""Cache-aware shortest job first.

The work a request costs is what the engine must compute: its prompt tokens
not already in the prefix cache, plus its output tokens. Ordering by that size
favours requests whose prefix is cached (the idea behind SGLang's
longest-prefix-match ordering and cache-aware job sizes in later work). The
cached part changes as the cache fills and evicts, so the key is dynamic; but a
request whose tokens are unknown (a length-only prompt without prefix hashes)
never hits, so those wait in one group ranked by their fixed size.
"""

from collections.abc import Hashable

from policies.sjf import SJF
from testbed.core.request import Request

NEVER_HITS = ("never hits",)  # a tuple: no request id (a str) equals it


class CacheAwareSJF(SJF):
    """Shortest (uncached prompt + output) first."""

    name = "cache_aware_sjf"
    dynamic_key = True

    def job_size(self, request: Request) -> float:
        cached = self.view.prefix_hit_tokens(request) if self.view is not None else 0
        return request.num_prompt_tokens - cached + super().job_size(request)

    def group_of(self, request: Request, now: float) -> Hashable:
        """One group of the requests that can never hit the cache (their key is fixed);
        every other request is a group of its own."""
        return NEVER_HITS if never_hits(request) else request.request_id

    def order_in_group(self, request: Request) -> float:
        if never_hits(request):
            return self.key(request, 0.0)  # fixed: SJF's key does not read now
        return 0.0  # alone in its group: no prefix lookup needed


def never_hits(request: Request) -> bool:
    """Its tokens are unknown (length only, no prefix hashes): no block can match."""
    return request.prompt_token_ids is None and request.prefix_hash_ids is None
