"""A check for policy authors: a policy that groups its waiting queue
(:meth:`~testbed.core.policy.Policy.group_of`) must schedule exactly as the
same policy sorting the whole queue by ``key`` every step.

In a policy's own tests::

    from testbed.core.policy_check import check_grouping

    def test_my_policy_groups_as_it_ranks():
        check_grouping(lambda: MyPolicy(weight=2.0))

The check replays a seeded workload (or the given arrivals) through two
engines with a stand-in data plane, one with the policy and one with its
:func:`sorted_twin`, and fails naming the first request whose schedule
differs: the grouping contract (``group_of``, ``order_in_group``,
``regroup_at``) then does not hold for that policy.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence

from testbed.core.config import SchedulerConfig
from testbed.core.engine import EngineCore, StepResult
from testbed.core.outputs import ExecutorOutput, SchedulerOutput
from testbed.core.policy import Policy
from testbed.core.queue import groups_its_queue
from testbed.core.request import Request, SamplingParams


def sorted_twin(policy: Policy) -> Policy:
    """A copy of ``policy`` with its queue groups off: its queue sorts every waiting
    request by ``key`` every step. Make it before the policy runs (a policy keeps
    state)."""
    twin = copy.deepcopy(policy)
    twin.__class__ = type(
        f"Sorted{type(policy).__name__}", (type(policy),), {"group_of": Policy.group_of}
    )
    return twin


class _StandInExecutor:
    """Every step lasts a fixed time plus a time per token; tokens are stand-ins."""

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        return ExecutorOutput(latency_s=0.01 + 1e-5 * so.total_num_scheduled_tokens)


class ManualClock:
    """A clock that stands where it is set (``clock.t``)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def run_arrivals(
    engine: EngineCore, arrivals: Sequence[tuple[float, Request]], max_steps: int
) -> tuple[list[StepResult], bool]:
    """Replay ``(time, request)`` arrivals on ``engine``, whose clock is a
    :class:`ManualClock` that each step moves on by the step's latency; the steps,
    and whether every request was added and finished within ``max_steps``."""
    clock = engine.clock
    pending = sorted(arrivals, key=lambda a: a[0])
    steps: list[StepResult] = []
    while pending or engine.has_unfinished_requests():
        if len(steps) >= max_steps:
            return steps, False
        if pending and not engine.has_unfinished_requests():
            clock.t = max(clock.t, pending[0][0])
        while pending and pending[0][0] <= clock.t:
            t, req = pending.pop(0)
            req.arrival_time = t
            engine.add_request(req)
        res = engine.step()
        clock.t = res.start_s + res.latency_s
        steps.append(res)
    return steps, True


def workload(
    num_requests: int = 200, num_tenants: int = 4, rate: float = 40.0, seed: int = 0
) -> list[tuple[float, Request]]:
    """Seeded arrivals that keep a queue waiting: Poisson at ``rate`` req/s, skewed
    tenants, three priority classes, prompts of 8-400 and outputs of 1-120 tokens."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(rate)
        out.append(
            (
                t,
                Request(
                    request_id=f"r{i}",
                    num_prompt_tokens=rng.randint(8, 400),
                    sampling_params=SamplingParams(max_tokens=rng.randint(1, 120), ignore_eos=True),
                    tenant=f"t{min(int(rng.expovariate(1.0)), num_tenants - 1)}",
                    priority=rng.randrange(3),
                ),
            )
        )
    return out


def outcomes(
    engine: EngineCore, arrivals: Sequence[tuple[float, Request]], max_steps: int
) -> tuple[list[tuple], int]:
    """Replay copies of ``arrivals`` on ``engine`` (on a :class:`ManualClock`): what
    each request went through (id, status, first scheduled, finished, preemptions,
    output tokens), and the most requests that waited at once. A run that does
    not finish within ``max_steps`` says how far it got."""
    arrivals = copy.deepcopy(list(arrivals))
    steps, _ = run_arrivals(engine, arrivals, max_steps)
    seen = [
        (r.request_id, r.status.name, r.first_scheduled_time, r.finish_time, r.num_preemptions,
         tuple(r.output_token_ids))
        for _, r in arrivals
    ]  # fmt: skip
    return seen, max((res.num_waiting for res in steps), default=0)


def stand_in_engine(
    policy: Policy,
    num_blocks: int = 120,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 4096,
) -> EngineCore:
    """An engine with a stand-in data plane on a :class:`ManualClock`; by default
    its cache is small enough that :func:`workload` queues and preempts."""
    return EngineCore.build(
        _StandInExecutor(),
        policy,
        num_blocks,
        block_size,
        clock=ManualClock(),
        config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        ),
    )


def check_grouping(
    make_policy: Callable[[], Policy],
    arrivals: Sequence[tuple[float, Request]] | None = None,
    max_steps: int = 100_000,
    **engine_options: int,
) -> None:
    """Fail (``AssertionError``) where the policy ``make_policy()`` makes schedules
    otherwise than its :func:`sorted_twin` on ``arrivals`` (default:
    :func:`workload`), where it does not group its queue at all, or where the
    arrivals never queue (the check would mean nothing). Both run on a
    :func:`stand_in_engine` (``engine_options`` change its defaults). Runs that do
    not finish within ``max_steps`` compare how far they got."""
    arrivals = workload() if arrivals is None else arrivals
    policy = make_policy()
    grouped, most_waiting = outcomes(stand_in_engine(policy, **engine_options), arrivals, max_steps)
    if not groups_its_queue(policy):
        raise AssertionError(
            f"{type(policy).__name__} does not group its waiting queue (it needs "
            "dynamic_key = True and its own group_of): nothing to check"
        )
    if most_waiting < 2:
        raise AssertionError(
            "the arrivals kept never more than one request waiting: grouping cannot have "
            "mattered; give arrivals that queue (more of them, closer together)"
        )
    twin_engine = stand_in_engine(sorted_twin(make_policy()), **engine_options)
    twin, _ = outcomes(twin_engine, arrivals, max_steps)
    for a, b in zip(grouped, twin, strict=True):
        if a != b:
            fields = ("request", "status", "first scheduled", "finished", "preemptions", "tokens")
            differ = ", ".join(
                f"{f} {x} (grouped) vs {y} (sorted)"
                for f, x, y in zip(fields, a, b, strict=True)
                if x != y
            )
            raise AssertionError(
                f"request {a[0]}: {differ}. The grouped queue ranks otherwise than sorting "
                "by key: check that order_in_group orders each group as key does, and that "
                "a request's group changes only at regroup_at"
            )
