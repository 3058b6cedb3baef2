"""The scheduler's and the KV-cache manager's declared surfaces (as vLLM V1's
``SchedulerInterface``): what code outside them may use.

* :class:`SchedulerInterface`: what an engine core, a cluster's transports and
  a run's reports use of a scheduler;
* :class:`FastPathScheduler`: what the simulator's fast path (``fast_forward``
  and the simulator's replicas) uses besides, since it applies plain decode
  steps in the scheduler's stead;
* :class:`EngineProcessScheduler`: what a real engine process's loop and its
  KV connector's data side use besides: the legs whose KV it keeps;
* :class:`KVCacheInterface`: what the scheduler and the fast path use of the
  KV-cache manager. Its blocks are opaque handles: the scheduler passes the
  prefix hits it is given back to :meth:`KVCacheInterface.allocate_slots`,
  and the fast path only counts a request's blocks.

``tests/core/test_scheduler_interface.py`` scans the engine core, the fast
path, both cluster cores, the simulator and the simulation mode for any other
scheduler or manager attribute they read, and the scheduler for any other
attribute of the manager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Protocol

from testbed.core.config import SchedulerConfig
from testbed.core.kv_cache import KVCacheBlock, PrefixCacheStats
from testbed.core.outputs import ExecutorOutput, SchedulerOutput
from testbed.core.policy import Policy, SchedulerView
from testbed.core.request import Request
from testbed.core.spec_stats import SpecDecodingStats


class KVCacheInterface(Protocol):
    """Paged KV slots with a prefix cache, as the scheduler and the fast path use them."""

    @property
    def block_size(self) -> int: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        ...

    @property
    def num_registered(self) -> int:
        """Blocks made findable so far (only grows)."""
        ...

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache queries and hits over admitted requests, in tokens."""
        ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    @property
    def block_tables(self) -> Mapping[str, Sequence[KVCacheBlock]]:
        """Each request's blocks, by request id (read-only)."""
        ...

    def get_block_ids(self, request_id: str) -> list[int]: ...

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]: ...

    def record_admission(self, num_tokens: int, num_hit_tokens: int) -> None: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None: ...

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None: ...

    def forget_uncomputed(self, request: Request) -> None: ...

    def free(self, request: Request) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def record_events(self) -> None: ...

    def take_events(self) -> list[tuple[bool, int]]: ...

    @property
    def has_events(self) -> bool: ...


class SchedulerInterface(SchedulerView, Protocol):
    """A scheduler, as an engine core, a cluster's transports and reports use it
    (besides the read-only view a policy gets: ``running``, ``num_waiting``,
    ``kv_usage``, ``prefix_hit_tokens``)."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request, by id (read-only)."""
        ...

    @property
    def num_loading(self) -> int:
        """Requests waiting for KV from another instance (the executor moves it)."""
        ...

    @property
    def spec_stats(self) -> SpecDecodingStats: ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats: ...

    def add_request(self, request: Request, now: float) -> bool:
        """Queue a new request; False if it was rejected at once."""
        ...

    def reject(self, request: Request, reason: str, now: float) -> None:
        """Refuse a request that never entered the queues."""
        ...

    def abort_request(self, request_id: str, now: float) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def schedule(self, now: float) -> SchedulerOutput: ...

    def update_from_output(
        self, out: SchedulerOutput, result: ExecutorOutput, now: float
    ) -> list[Request]:
        """Account a finished step; the requests that finished since the last update."""
        ...

    def update_connector_output(
        self, finished_sending, finished_recving, now: float, failed_recving=()
    ) -> None:
        """KV transfers that ended (outside a step's output, e.g. a simulated link)."""
        ...


class FastPathScheduler(SchedulerInterface, Protocol):
    """What the simulator's fast path reads and calls besides: it checks that the
    next steps are plain decodes (nothing waits that could be admitted, nothing
    moves KV) and applies them to the running requests and their blocks."""

    @property
    def waiting(self) -> Sized: ...

    @property
    def loading(self) -> Sized: ...

    @property
    def ready(self) -> Sized: ...

    @property
    def kv(self) -> KVCacheInterface: ...

    @property
    def has_unreported_finishes(self) -> bool: ...

    @property
    def admission_blocked_on_kv(self) -> bool: ...

    @property
    def policy_admits(self) -> bool: ...

    @property
    def policy_sees_each_step(self) -> bool: ...

    def retire(self, finished: list[Request]) -> None:
        """Free requests that have just finished."""
        ...

    def advance_step_ids(self, num_steps: int) -> None:
        """Count steps applied outside ``schedule``."""
        ...


class EngineProcessScheduler(FastPathScheduler, Protocol):
    """What an engine process (``testbed/engine/worker.py``) uses besides: whether
    anything is runnable (``running``, ``waiting``, ``ready``, ``loading``) and
    the prefill legs whose KV it keeps until sent (its connector's data side)."""

    @property
    def sending(self) -> Sized: ...
