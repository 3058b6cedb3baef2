"""Small factories for CPU-only control-plane tests (no model, no simulator).

``FakeExecutor`` is a data plane in miniature: it keeps a stand-in "KV" value
in each slot (a digest of the whole prefix up to that position, so that, as in
a transformer, the same token after a different prefix has different KV),
writes every scheduled token's value, and checks on every step that what a
request attends to (its context) is exactly its own prefix's KV. A
prefix-cache hit on the wrong block, a block table that drifts from the
manager's, or a computed count that runs ahead of what was written all fail
there. It "samples" a deterministic token per (request, position), so
a request's output does not depend on batching, and it can propose drafts.
"""

from __future__ import annotations

import random
import zlib

from policies import make_policy
from testbed.core import (
    EngineCore,
    ExecutorOutput,
    KVCacheManager,
    Policy,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from testbed.core.policy_check import ManualClock, run_arrivals, sorted_twin  # noqa: F401
from testbed.core.policy_check import outcomes as run_outcomes
from testbed.core.queue import GroupedQueue, groups_its_queue

VOCAB = 1000
EOS = VOCAB - 1


def true_token(request_id: str, position: int) -> int:
    """The token the fake model samples at ``position`` (never EOS)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % (VOCAB - 1)


def create_scheduler(
    policy="fcfs",
    num_blocks: int = 64,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    **config,
) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv, make_policy(policy))


def create_requests(
    n: int,
    prompt_len: int = 10,
    output_len: int = 4,
    prefix: list[int] | None = None,
    start: int = 0,
    seed: int = 0,
    **fields,
) -> list[Request]:
    """Requests with random prompts (sharing ``prefix`` when given) that stop at
    ``output_len`` tokens (the trace-replay convention: ignore_eos)."""
    rng = random.Random(seed)
    out = []
    for i in range(start, start + n):
        body = [rng.randrange(VOCAB - 1) for _ in range(prompt_len - len(prefix or []))]
        out.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=(prefix or []) + body,
                sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
                eos_token_id=EOS,
                **fields,
            )
        )
    return out


class FakeExecutor:
    """Checks the KV contents every step; samples ``true_token``; may propose drafts."""

    def __init__(
        self,
        kv: KVCacheManager,
        num_drafts: int = 0,
        draft_accuracy: float = 0.7,
        latency_s: float = 0.01,
        seed: int = 0,
    ) -> None:
        self.kv = kv
        self.contents: dict[int, list[int | None]] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_drafts = num_drafts
        self.draft_accuracy = draft_accuracy
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.steps: list[SchedulerOutput] = []

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        bs = self.kv.block_size
        return self.tables[rid][pos // bs], pos % bs

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        self.steps.append(so)
        for rid in so.finished_req_ids + so.preempted_req_ids:
            self.tables.pop(rid, None)
        recvd = set()
        for req, block_ids in so.kv_loads:  # a fake KV connector: the remote KV arrives
            self.tables[req.request_id] = list(block_ids)
            self._write(req, 0, req.remote_kv_tokens)
            recvd.add(req.request_id)
        for req in so.requests:
            rid = req.request_id
            if rid in so.new_req_ids:
                self.tables[rid] = list(so.new_block_ids.get(rid, []))
            else:
                self.tables[rid].extend(so.new_block_ids.get(rid, []))
            assert self.tables[rid] == self.kv.get_block_ids(rid), "block tables drifted"
        # Like the engine's layers: the whole step's KV is written before any
        # attention reads it, so a request may read blocks computed in this step.
        for i, req in enumerate(so.requests):
            ctx = so.context_len(i)
            self._write(req, ctx, ctx + so.num_scheduled_tokens[i])
        sampled = []
        for i, req in enumerate(so.requests):
            self._check_context(req, so.context_len(i))
            sampled.append(self._sample(req, so) if so.samples(i) else [])
        drafts = None
        if self.num_drafts:
            drafts = {r.request_id: self._propose(r, s) for r, s in zip(so.requests, sampled) if s}
        return ExecutorOutput(
            sampled_token_ids=sampled,
            latency_s=self.latency_s,
            draft_token_ids=drafts,
            finished_recving=recvd,
        )

    def _token_at(self, req: Request, pos: int) -> int:
        n_prompt = req.num_prompt_tokens
        if pos < n_prompt:
            return req.prompt_token_ids[pos]
        k = pos - n_prompt
        if k < len(req.output_token_ids):
            return req.output_token_ids[k]
        return req.spec_token_ids[k - len(req.output_token_ids)]

    def _kv_values(self, req: Request, end: int):
        """Like a transformer's, the KV at a position depends on the whole prefix."""
        digest = 0
        for pos in range(end):
            digest = zlib.crc32(self._token_at(req, pos).to_bytes(4, "little"), digest)
            yield pos, digest

    def _check_context(self, req: Request, ctx: int) -> None:
        """Check the context holds this request's KV (written now or before)."""
        empty = [None] * self.kv.block_size
        for pos, value in self._kv_values(req, ctx):
            b, s = self._slot(req.request_id, pos)
            got = self.contents.get(b, empty)[s]
            assert got == value, f"{req.request_id} pos {pos}: KV of another prefix"

    def _write(self, req: Request, start: int, end: int) -> None:
        for pos, value in self._kv_values(req, end):
            if pos >= start:
                b, s = self._slot(req.request_id, pos)
                self.contents.setdefault(b, [None] * self.kv.block_size)[s] = value

    def _sample(self, req: Request, so: SchedulerOutput) -> list[int]:
        """Verify drafts against the true tokens: accepted prefix + one more."""
        base = req.num_tokens  # position of the first new token
        out = []
        for k, d in enumerate(so.spec_token_ids.get(req.request_id, [])):
            t = true_token(req.request_id, base + k)
            out.append(t)
            if d != t:
                return out
        out.append(true_token(req.request_id, base + len(out)))
        return out

    def _propose(self, req: Request, sampled: list[int]) -> list[int]:
        base = req.num_tokens + len(sampled)
        return [
            true_token(req.request_id, base + k)
            if self.rng.random() < self.draft_accuracy
            else (true_token(req.request_id, base + k) + 1) % (VOCAB - 1)
            for k in range(self.num_drafts)
        ]


def create_engine(policy="fcfs", num_drafts: int = 0, **kwargs) -> tuple[EngineCore, FakeExecutor]:
    if num_drafts:
        kwargs.setdefault("num_speculative_tokens", num_drafts)
        kwargs.setdefault("num_lookahead_tokens", num_drafts)
    sched = create_scheduler(policy, **kwargs)
    ex = FakeExecutor(sched.kv, num_drafts=num_drafts)
    return EngineCore(sched, ex, clock=ManualClock()), ex


def run(engine: EngineCore, arrivals: list[tuple[float, Request]], max_steps: int = 10_000):
    """Replay ``(time, request)`` arrivals on the engine's manual clock; return the steps."""
    steps, done = run_arrivals(engine, arrivals, max_steps)
    assert done, "run did not finish in a bounded number of steps"
    return steps


def outcomes(policy: Policy, arrivals, cfg: dict, num_drafts: int = 0) -> list[tuple]:
    """Replay copies of ``arrivals`` under ``policy`` on the fake executor; what each
    request went through (:func:`testbed.core.policy_check.outcomes`)."""
    engine, _ = create_engine(policy, num_drafts=num_drafts, **cfg)
    assert isinstance(engine.scheduler.waiting, GroupedQueue) == groups_its_queue(policy)
    total_tokens = sum(r.num_prompt_tokens + r.sampling_params.max_tokens for _, r in arrivals)
    # MLFQ starving in a few steps can displace requests forever: compare how far both got.
    return run_outcomes(engine, arrivals, max_steps=20 * total_tokens + 100)[0]
