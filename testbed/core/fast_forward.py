"""The simulator's fast path: many plain decode steps applied at once.

Between two events (an arrival, a completion, an admission, a preemption), a
busy engine mostly repeats the same step: every running request decodes one
token. :func:`decode_horizon` says for how many steps that is guaranteed to
hold; :func:`advance_decode` applies them in one go. The result is the same as
stepping one at a time (a test proves it): the same tokens, the same
timestamps, the same KV usage per step; only which free block a request gets
may differ, which nothing observable depends on.

Only a data plane that samples stand-in tokens (the simulator) may use this.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from testbed.core.policy import Policy
from testbed.core.request import Request
from testbed.core.scheduler import STAND_IN_TOKEN, Scheduler


def _is_plain_decode(req: Request) -> bool:
    params = req.sampling_params
    return (
        req.num_computed_tokens == req.num_tokens - 1
        and not req.spec_token_ids
        and (params.ignore_eos or req.eos_token_id != STAND_IN_TOKEN)
        and STAND_IN_TOKEN not in params.stop_token_ids
    )


def _new_blocks(reqs: Sequence[Request], have: Sequence[int], bs: int, k: int) -> int:
    """Blocks the requests need to compute ``k`` more tokens each."""
    total = 0
    for req, n in zip(reqs, have, strict=True):
        total += max(0, -(-(req.num_computed_tokens + k) // bs) - n)
    return total


def decode_horizon(sched: Scheduler, max_steps: int) -> int:
    """How many next steps are certainly plain decodes of every running request,
    with no admission, preemption or completion (0 when not certain)."""
    running, cfg, policy = sched.running, sched.config, sched.policy
    if max_steps <= 0 or not running or sched.loading or sched.ready or sched._newly_finished:
        return 0
    if cfg.num_lookahead_tokens or len(running) > cfg.max_num_batched_tokens:
        return 0
    cls = type(policy)
    if cls.on_step is not Policy.on_step and cls.on_decode_steps is Policy.on_decode_steps:
        return 0  # a stateful policy that must see every step
    if sched.waiting and (
        policy.preemptive
        or (
            len(running) < cfg.max_num_seqs
            # The head stays blocked only if it failed on KV room (which only
            # shrinks while requests decode) and its rank and admission are fixed.
            and (policy.dynamic_key or sched._has_admit or not sched.admission_blocked_on_kv)
        )
    ):
        return 0
    horizon = max_steps
    for req in running:
        if not _is_plain_decode(req):
            return 0
        horizon = min(horizon, req.max_num_tokens - req.num_tokens - 1)
    if horizon <= 0:
        return 0
    kv = sched.kv
    bs, free = kv.block_size, kv.num_free_blocks
    have = [len(kv.req_to_blocks[r.request_id]) for r in running]
    if _new_blocks(running, have, bs, horizon) <= free:
        return horizon
    lo, hi = 0, horizon  # the largest k whose blocks fit: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _new_blocks(running, have, bs, mid) <= free:
            lo = mid
        else:
            hi = mid
    return lo


def advance_decode(sched: Scheduler, end_times: Sequence[float]) -> list[int]:
    """Apply ``len(end_times)`` plain decode steps ending at these times (within the
    horizon). Returns the number of blocks in use during each step."""
    k = len(end_times)
    kv = sched.kv
    bs = kv.block_size
    used = kv.num_blocks - kv.num_free_blocks
    grow = [0] * (k + 1)
    for req in sched.running:
        c = req.num_computed_tokens
        # Step j computes the token at position c + j - 1, so needs c + j slots.
        j = len(kv.req_to_blocks[req.request_id]) * bs - c + 1
        while j <= k:
            grow[j] += 1
            j += bs
        if kv.allocate_slots(req, k) is None:
            raise AssertionError("advance_decode went past decode_horizon")
        req.num_computed_tokens = c + k
        if req.first_token_time is None:  # its last prompt token was left for this step
            req.first_token_time = end_times[0]
        req.output_token_ids.extend(repeat(STAND_IN_TOKEN, k))
        req.token_times.extend(end_times)
        kv.cache_blocks(req)
    sched.policy.on_decode_steps(sched.running, k, end_times[-1])
    sched.advance_step_ids(k)
    out = []
    for j in range(1, k + 1):
        used += grow[j]
        out.append(used)
    return out
