"""The simulator's fast path: many plain decode steps applied at once.

Between two events (an arrival, an admission, a preemption), a busy engine
mostly repeats the same step: every running request decodes one token (and in
the last such step some may finish). :func:`decode_horizon` says for how many
steps that is guaranteed to hold; :func:`advance_decode` applies them in one
go. The result is the same as stepping one at a time (a test proves it): the
same tokens, the same timestamps, the same KV usage per step; only which free
block a request gets may differ, which nothing observable depends on.

Only a data plane that samples stand-in tokens (the simulator) may use this. It
uses only the scheduler's and the KV-cache manager's declared surfaces
(:class:`FastPathScheduler`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from testbed.core.request import STAND_IN_TOKEN, Request, RequestStatus
from testbed.core.scheduler_interface import FastPathScheduler

FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH


def _new_blocks(reqs: Sequence[Request], have: Sequence[int], bs: int, k: int) -> int:
    """Blocks the requests need to compute ``k`` more tokens each."""
    total = 0
    for req, n in zip(reqs, have, strict=True):
        total += max(0, -(-(req.num_computed_tokens + k) // bs) - n)
    return total


def decode_horizon(sched: FastPathScheduler, max_steps: int) -> int:
    """How many next steps are certainly plain decodes of every running request,
    with no admission or preemption, and completions only in the last (0 when not
    certain)."""
    running, cfg, policy = sched.running, sched.config, sched.policy
    if (
        max_steps <= 0
        or not running
        or sched.loading
        or sched.ready
        or sched.has_unreported_finishes
    ):
        return 0
    if (
        cfg.num_speculative_tokens  # every step verifies drafts and counts proposals
        or cfg.num_lookahead_tokens  # the jump's block count leaves lookahead slots out
        or len(running) > cfg.max_num_batched_tokens
    ):
        return 0
    if sched.policy_sees_each_step:
        return 0
    if sched.waiting and (
        policy.preemptive
        or (
            len(running) < cfg.max_num_seqs
            # The head stays blocked only if it failed on KV room (which only
            # shrinks while requests decode) and its rank and admission are fixed.
            and (policy.dynamic_key or sched.policy_admits or not sched.admission_blocked_on_kv)
        )
    ):
        return 0
    horizon = max_steps
    for req in running:
        # A plain decode: only the last sampled token is uncomputed, no drafts, and
        # the stand-in token cannot stop it.
        num_tokens = req.num_prompt_tokens + len(req.output_token_ids)
        params = req.sampling_params
        if (
            req.num_computed_tokens != num_tokens - 1
            or req.spec_token_ids
            or (req.eos_token_id == STAND_IN_TOKEN and not params.ignore_eos)
            or (params.stop_token_ids and STAND_IN_TOKEN in params.stop_token_ids)
        ):
            return 0
        left = req.max_num_tokens - num_tokens  # steps until its last token
        if left < horizon:
            horizon = left
    if horizon <= 0:
        return 0
    kv = sched.kv
    bs, free = kv.block_size, kv.num_free_blocks
    if len(running) * (horizon // bs + 1) <= free:
        return horizon  # even a new block each per block_size steps fits
    blocks_of = kv.block_tables
    have = [len(blocks_of[r.request_id]) for r in running]
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


def decode_usage(sched: FastPathScheduler, k: int) -> list[int]:
    """The number of blocks in use during each of the next ``k`` plain decode steps
    (within the horizon), without taking any."""
    kv = sched.kv
    bs = kv.block_size
    used = kv.num_blocks - kv.num_free_blocks
    grow = [0] * (k + 1)
    blocks_of = kv.block_tables
    for req in sched.running:
        # Step j computes the token at position c + j - 1, so needs c + j slots.
        j = len(blocks_of[req.request_id]) * bs - req.num_computed_tokens + 1
        while j <= k:
            grow[j] += 1
            j += bs
    out = []
    for j in range(1, k + 1):
        used += grow[j]
        out.append(used)
    return out


def advance_decode(
    sched: FastPathScheduler, end_times: Sequence[float], usage: list[int] | None = None
) -> tuple[list[int], list[Request]]:
    """Apply ``len(end_times)`` plain decode steps ending at these times (within the
    horizon). Returns the number of blocks in use during each step (``usage``: what
    :func:`decode_usage` said of them, if it was asked already), and the requests
    that finished in the last."""
    k = len(end_times)
    usage = decode_usage(sched, k) if usage is None else usage[:k]
    kv = sched.kv
    bs = kv.block_size
    blocks_of = kv.block_tables
    stand_ins = [STAND_IN_TOKEN] * k
    now = end_times[-1]
    finished = []
    running = sched.running
    for req in running:
        c = req.num_computed_tokens
        if len(blocks_of[req.request_id]) * bs < c + k and kv.allocate_slots(req, k) is None:
            raise AssertionError("advance_decode went past decode_horizon")
        req.num_computed_tokens = c + k
        if req.first_token_time is None:  # its last prompt token was left for this step
            req.first_token_time = end_times[0]
        out_ids = req.output_token_ids
        out_ids.extend(stand_ins)
        if req.token_times is None:
            req.token_times = array("d", end_times)
        else:
            req.token_times.extend(end_times)
        if (c + k) // bs > c // bs:  # a block filled up: it may become findable
            kv.cache_blocks(req)
        if req.num_prompt_tokens + len(out_ids) >= req.max_num_tokens:
            req.status, req.finish_reason, req.finish_time = FINISHED_LENGTH, "length", now
            finished.append(req)
    if finished:
        sched.retire(finished)
    sched.policy.on_decode_steps(running, k, finished, now)
    sched.advance_step_ids(k)
    return usage, finished
