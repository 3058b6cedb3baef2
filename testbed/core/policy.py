"""The policy API: every choice the scheduler makes that is a matter of policy.

A researcher subclasses :class:`Policy` in one short file under ``policies/``
and overrides only what the policy changes:

=====================  =====================================================
``key(request, now)``  the order of the waiting queue (lower is served first)
``admit(...)``         admit, defer or reject a waiting request
``select_victim(...)`` which running request to preempt when KV runs out
``token_cap(request)`` the most tokens a request may compute in one step
``on_step(...)``       sees each finished step (fair-share counters, aging...)
``on_arrival(...)``    sees each arriving request
``on_decode_steps``    sees many plain decode steps at once (simulator)
``group_of(...)``      optional: groups the key keeps in a fixed order (a cheap queue)
=====================  =====================================================

Three class attributes tell the scheduler how expensive the policy is, so that
the default path stays cheap: ``dynamic_key`` (the key changes while a request
waits, so the queue is re-sorted every step instead of kept sorted; a policy
whose key moves whole groups at once, such as a tenant's fair-share counter,
overrides ``group_of`` and ``order_in_group`` and the queue ranks only the
groups' heads),
``reorder_running`` (running requests are also served in key order, when the
token budget cannot cover them all) and ``preemptive`` (a waiting request that
ranks before a running one may displace it when the batch or the cache is full).

The scheduler holds the mechanism (budgets, blocks, preemption by recompute);
the policy never touches those directly, it only ranks and decides.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from testbed.core.request import Request

if TYPE_CHECKING:
    from testbed.core.outputs import SchedulerOutput


class Decision(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"  # stay in the queue; ask again next step
    REJECT = "reject"  # never serve; the reason goes to requests.csv


@dataclass(frozen=True, slots=True)
class Admission:
    decision: Decision
    reason: str = ""


ADMIT = Admission(Decision.ADMIT)


class SchedulerView(Protocol):
    """What a policy may read of the scheduler (read-only)."""

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    def prefix_hit_tokens(self, request: Request) -> int:
        """Prompt tokens the prefix cache would serve now (no side effects)."""
        ...


# --- preemption victims -----------------------------------------------------
# Each built-in victim rule as a sort key: the candidate with the largest is
# preempted first (``testbed.vllm_backend`` ranks vLLM's running list by the same).
VICTIM_KEYS: dict[str, Callable[[Request, Policy, float], tuple]] = {
    # the engines' default (vLLM, SGLang): the most recently arrived request
    "newest": lambda r, policy, now: (r.arrival_time, r.arrival_seq),
    # the request that loses the least work when recomputed
    "least_computed": lambda r, policy, now: (-r.num_computed_tokens, r.arrival_seq),
    # the request the policy itself ranks last (largest key)
    "lowest_rank": lambda r, policy, now: (policy.key(r, now), r.arrival_seq),
}


def _selector(name: str) -> Callable[[Sequence[Request], Policy, float], Request]:
    key = VICTIM_KEYS[name]

    def select(candidates: Sequence[Request], policy: Policy, now: float) -> Request:
        return max(candidates, key=lambda r: key(r, policy, now))

    select.__name__ = f"{name}_first"
    return select


newest_first = _selector("newest")
least_computed_first = _selector("least_computed")
lowest_rank_first = _selector("lowest_rank")
VICTIM_SELECTORS: dict[str, Callable[[Sequence[Request], Policy, float], Request]] = {
    "newest": newest_first,
    "least_computed": least_computed_first,
    "lowest_rank": lowest_rank_first,
}


class Policy:
    """Base class of scheduling policies; by itself, first-come first-served.

    ``victim`` picks the preemption victim: ``"newest"`` (default),
    ``"least_computed"`` or ``"lowest_rank"`` (the policy's own last-ranked).
    A preemptive policy evicts by rank only, and that is its default: another
    victim contradicts its displacement (the evicted request outranks the
    survivor, so it displaces it on return) and two requests can preempt each
    other forever.
    """

    name: ClassVar[str] = "base"
    dynamic_key: ClassVar[bool] = False
    reorder_running: ClassVar[bool] = False
    preemptive: ClassVar[bool] = False
    default_victim: ClassVar[str] = "newest"

    def __init__(self, victim: str | None = None) -> None:
        victim = victim or ("lowest_rank" if self.preemptive else self.default_victim)
        if victim not in VICTIM_SELECTORS:
            raise ValueError(f"unknown victim {victim!r}; choose from {sorted(VICTIM_SELECTORS)}")
        if self.preemptive and victim != "lowest_rank":
            raise ValueError(
                f"victim {victim!r}: {self.name} is preemptive and evicts by rank only "
                "(victim: lowest_rank); evicting a request that outranks the survivors "
                "lets the two displace each other forever"
            )
        self.victim = victim
        self._select = VICTIM_SELECTORS[victim]
        self.view: SchedulerView | None = None

    def attach(self, view: SchedulerView) -> None:
        """Called once by the scheduler that uses this policy."""
        self.view = view

    def key(self, request: Request, now: float) -> Any:
        """Rank of a request: lower is served first. Ties go to earlier arrivals."""
        return request.arrival_time

    def group_of(self, request: Request, now: float) -> Hashable | None:
        """With a dynamic key: the group whose waiting requests the key keeps in one
        fixed order (any hashable). Not overridden, the queue sorts every waiting
        request by ``key`` every step.

        The contract: at any time, two waiting requests ``a``, ``b`` of one group
        rank by ``key`` as they rank by :meth:`order_in_group` (ties to the earlier
        ``arrival_seq`` in both), and a request's group stays what ``group_of``
        said when it entered the queue until :meth:`regroup_at`. The queue keeps
        each group sorted as requests enter and calls ``key`` only on each group's
        head: a step costs the number of groups, not of waiting requests. VTC's
        groups are tenants (one counter per tenant); MLFQ's are levels.
        """
        return None

    def order_in_group(self, request: Request) -> Any:
        """The fixed order within a :meth:`group_of` group (default: arrival)."""
        return request.arrival_time

    def regroup_at(self, request: Request) -> float | None:
        """When a waiting request's group changes (None: never, the default). The
        queue asks :meth:`group_of` again at its first read after that time."""
        return None

    def admit(self, request: Request, now: float) -> Admission:
        """Decide on the head-of-queue candidate before it gets KV blocks.
        Overriding it costs the simulator's fast path while requests wait (an
        answer may change at any step, so every step is simulated)."""
        return ADMIT

    def select_victim(self, candidates: Sequence[Request], now: float) -> Request:
        """Which of the running ``candidates`` to preempt (recompute later)."""
        return self._select(candidates, self, now)

    def token_cap(self, request: Request) -> int | None:
        """The most tokens ``request`` may compute this step (None: no cap)."""
        return None

    def draft_cap(self, request: Request) -> int | None:
        """The most draft tokens ``request`` may verify in its next step (speculative
        decoding; None: the engine's ``num_speculative_tokens``, 0: none), e.g.
        fewer under load, where verification costs more than it saves."""
        return None

    def on_arrival(self, request: Request, now: float) -> None:
        """Sees each request when it enters the waiting queue for the first time."""

    def on_step(self, output: SchedulerOutput, finished: Sequence[Request], now: float) -> None:
        """Sees each step after its tokens are accounted (for stateful policies):
        ``output.requests[i].num_computed_tokens`` already counts the step's
        ``output.num_scheduled_tokens[i]`` tokens (less rejected drafts);
        ``output.context_len(i)`` is the count before the step. Overriding it
        without :meth:`on_decode_steps` turns the simulator's fast path off."""

    def on_decode_steps(
        self, requests: Sequence[Request], num_steps: int, finished: Sequence[Request], now: float
    ) -> None:
        """Sees ``num_steps`` steps at once in which each of ``requests`` decoded one
        token and nothing else happened but, in the last, ``finished`` finishing (the
        simulator's fast path). A policy that overrides :meth:`on_step` must override
        this too, else the fast path is off."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(victim={self.victim!r})"


def overrides(policy: Policy, hook: str) -> bool:
    """Whether ``policy``'s ``hook`` is its own rather than :class:`Policy`'s (a
    policy may bind a hook per instance, e.g. only when an option is on)."""
    return getattr(getattr(policy, hook), "__func__", None) is not getattr(Policy, hook)


# What a hook left unpaired costs the simulator, said once per policy class.
COSTS = {
    "on_step": (
        "overrides on_step but not on_decode_steps: the simulator cannot jump over "
        "plain decode steps and simulates every step (several times slower on long "
        "traces); override on_decode_steps(requests, num_steps, finished, now) to "
        "see many decode steps at once"
    ),
    "admit": (
        "overrides admit: while requests wait and the batch has room, the simulator "
        "simulates every step instead of jumping over plain decode steps (an "
        "admission answer may change at any step)"
    ),
}
_warned: set[tuple[type, str]] = set()


def costs_of(policy: Policy) -> list[str]:
    """The hooks of ``policy`` that cost the simulator its fast path (see COSTS)."""
    out = []
    if overrides(policy, "on_step") and not overrides(policy, "on_decode_steps"):
        out.append("on_step")
    if overrides(policy, "admit"):
        out.append("admit")
    return out


def warn_of_costs(policy: Policy) -> None:
    """Warn, once per policy class and hook, of what its hooks cost the simulator's
    fast path (see COSTS); the simulator calls it when it attaches the policy."""
    for hook in costs_of(policy):
        if (type(policy), hook) not in _warned:
            _warned.add((type(policy), hook))
            warnings.warn(
                f"policy {policy.name!r} ({type(policy).__name__}) {COSTS[hook]}",
                PolicyCostWarning,
                stacklevel=3,
            )


class PolicyCostWarning(UserWarning):
    """A policy's hooks make the simulator slower (results are the same)."""
