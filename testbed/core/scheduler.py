"""The token-budget scheduler (the model of vLLM V1), driven by a policy.

Each step hands every chosen request a number of new tokens so that its
``num_computed_tokens`` catches up with its prompt + output (+ draft) tokens,
within ``max_num_batched_tokens`` and ``max_num_seqs``. Running requests are
served first, then waiting ones in the policy's order. Chunked prefill, prefix
caching, mixed prefill/decode batches and speculative decoding all follow from
this one rule. When the KV cache has no room, the policy's victim is preempted
by recompute; a preemptive policy's best waiting request may also displace the
worst running one at the start of a step. No request is admitted in a step
that preempted.
"""

from __future__ import annotations

from array import array

from testbed.core.config import SchedulerConfig
from testbed.core.kv_cache import KVCacheManager, PrefixCacheStats, cdiv
from testbed.core.kv_connector import KVConnector
from testbed.core.outputs import ExecutorOutput, SchedulerOutput
from testbed.core.policy import Decision, Policy, overrides
from testbed.core.queue import create_waiting_queue
from testbed.core.request import SERVED, STAND_IN_TOKEN, Request, RequestStatus
from testbed.core.spec_stats import SpecDecodingStats

RUNNING = RequestStatus.RUNNING


def displacement_victim(
    policy: Policy,
    running,
    head: Request,
    now: float,
    max_num_seqs: int,
    free_blocks: int,
    block_size: int,
):
    """The running request that the waiting request ``head`` displaces under a
    preemptive ``policy`` before a step: the worst running one by ``(key,
    arrival_seq)``, when ``head`` ranks strictly before it and the batch is full
    or ``free_blocks`` cannot hold ``head``; else None. The one rule of both this
    scheduler and vLLM's ``PolicyScheduler``."""
    key = policy.key
    worst = max(running, key=lambda r: (key(r, now), r.arrival_seq))
    if (key(head, now), head.arrival_seq) >= (key(worst, now), worst.arrival_seq):
        return None
    if len(running) >= max_num_seqs or cdiv(head.num_tokens, block_size) > free_blocks:
        return worst
    return None


def reject(request: Request, reason: str, now: float) -> None:
    """Mark ``request`` refused at ``now`` with ``reason`` (never served), in any
    engine: this scheduler's, or vLLM's as ``mode=vllm`` records it."""
    request.status = RequestStatus.REJECTED
    request.reject_reason = request.finish_reason = reason
    request.finish_time = now


class Scheduler:
    """Chooses each step's batch; owns the waiting and running requests.

    Callers use only its declared surface (``SchedulerInterface``, and for the
    simulator's fast path ``FastPathScheduler``, in
    :mod:`testbed.core.scheduler_interface`); a test enforces it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        policy: Policy,
        connector: KVConnector | None = None,
    ):
        self.config = config
        self.kv = kv_cache
        self.policy = policy
        # KV from and to other instances (disaggregated prefill/decode); None: none.
        self.connector = connector
        self.sending: dict[str, Request] = {}  # finished, blocks kept until their KV is sent
        self.waiting = create_waiting_queue(policy)
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # waiting for KV from another instance
        self.ready: list[Request] = []  # KV arrived, holding blocks, not yet running
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        self._step_id = 0
        self._arrivals = 0
        self._finished_ids: list[str] = []  # for the executor, in the next output
        self._newly_finished: list[Request] = []  # returned by the next update
        # True while the last admission attempt stopped for want of KV blocks and
        # nothing has changed since that could unblock it (an arrival, a free, a
        # block made findable: the head may hit it and need fewer blocks).
        self.admission_blocked_on_kv = False
        self._registered_when_blocked = 0
        # This step's long_prefill_token_threshold (0: none; see schedule).
        self._long_prefill_threshold = 0
        # Hooks the policy leaves to the base class are skipped, not called.
        self.policy_admits = overrides(policy, "admit")
        self._has_cap = overrides(policy, "token_cap")
        self._has_draft_cap = overrides(policy, "draft_cap")
        self._has_on_step = overrides(policy, "on_step")
        # A stateful policy that must see every step one by one (no on_decode_steps).
        self.policy_sees_each_step = self._has_on_step and not overrides(policy, "on_decode_steps")
        policy.attach(self)

    @property
    def has_unreported_finishes(self) -> bool:
        """Requests finished (aborted, rejected) since the last update, which the
        next one reports."""
        return bool(self._newly_finished)

    @property
    def num_loading(self) -> int:
        """Requests waiting for KV from another instance."""
        return len(self.loading)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The KV-cache manager's prefix-cache queries and hits (in tokens)."""
        return self.kv.stats

    # --- the read-only view a policy gets ---
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def prefix_hit_tokens(self, request: Request) -> int:
        if request.num_computed_tokens:
            return request.num_computed_tokens
        return self.kv.get_computed_blocks(request)[1]

    # --- arrivals ---
    def add_request(self, request: Request, now: float) -> bool:
        """Queue a new request; False if it can never be served: then it is rejected
        at once, with its reason (and not reported again by the next update)."""
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        reason = self._never_fits(request)
        if reason:
            self.reject(request, reason, now)
            return False
        request.remote_kv_tokens = min(request.remote_kv_tokens, request.num_tokens - 1)
        request.max_num_tokens = self._stop_num_tokens(request)
        if request.output_token_ids and request.num_tokens >= request.max_num_tokens:
            # Arrived complete (its prefill instance produced all it may produce).
            request.status, request.finish_reason = RequestStatus.FINISHED_LENGTH, "length"
            request.finish_time = now
            self._newly_finished.append(request)
            return True
        self.requests[request.request_id] = request
        self.policy.on_arrival(request, now)
        self.waiting.add(request, now)
        self.admission_blocked_on_kv = False
        return True

    def _stop_num_tokens(self, request: Request) -> int:
        max_out = request.max_output_tokens
        limit = self.config.max_model_len
        return limit if max_out is None else min(limit, request.num_prompt_tokens + max_out)

    def _never_fits(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n < 1:
            return "empty prompt"
        if n > self.config.max_model_len:
            return f"prompt of {n} tokens exceeds max_model_len={self.config.max_model_len}"
        if request.request_id in self.requests:
            return f"duplicate request id {request.request_id!r}"
        need = self.kv.blocks_needed(
            self._stop_num_tokens(request) + self.config.num_lookahead_tokens
        )
        if need > self.kv.num_blocks:
            return f"needs {need} KV blocks but the cache has {self.kv.num_blocks}"
        return None

    def reject(self, request: Request, reason: str, now: float) -> None:
        """Refuse a request that never entered the queues (it is not reported again)."""
        reject(request, reason, now)

    def _reject(self, request: Request, reason: str, now: float) -> None:
        """Refuse a queued request: reported by the next update."""
        self.reject(request, reason, now)
        self._newly_finished.append(request)

    def abort_request(self, request_id: str, now: float) -> None:
        """Stop a request wherever it is (its blocks are freed)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status is RUNNING:
            self.running.remove(req)
        elif req in self.ready:
            self.ready.remove(req)
        elif self.loading.pop(request_id, None) is None:
            self.waiting.remove(req)
        self.kv.free(req)
        self.admission_blocked_on_kv = False
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_reason = "aborted"
        req.finish_time = now
        self._finished_ids.append(request_id)
        self._newly_finished.append(req)

    def advance_step_ids(self, num_steps: int) -> None:
        """Count steps applied outside :meth:`schedule` (the simulator's fast path)."""
        self._step_id += num_steps

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.loading or self.ready)

    # --- scheduling ---
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(step_id=self._step_id)
        self._step_id += 1
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        self.admission_blocked_on_kv = False
        cfg, policy = self.config, self.policy
        # As vLLM: the cap keeps a long prefill from starving the others, so it
        # applies only when there are others (running or queued at step start).
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        if threshold:
            others = len(self.running) + len(self.waiting) + len(self.ready) + len(self.loading)
            threshold = threshold if others > 1 else 0
        self._long_prefill_threshold = threshold
        if policy.reorder_running and len(self.running) > 1:
            self.running.sort(key=lambda r: (policy.key(r, now), r.arrival_seq))
        if policy.preemptive and self.running and self.waiting:
            self._displace_for_waiting(out, now)
        budget = self._schedule_running(out, cfg.max_num_batched_tokens, now)
        if not out.preempted_req_ids and (self.waiting or self.ready):
            self._schedule_waiting(out, budget, now)
        context = out.context_lens
        for req, n in zip(out.requests, out.num_scheduled_tokens, strict=True):
            context.append(req.num_computed_tokens)
            req.num_computed_tokens += n
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens_with_spec - num_computed
        cfg = self.config
        if cfg.enable_chunked_prefill:
            if 0 < self._long_prefill_threshold < n:
                n = self._long_prefill_threshold
            if self._has_cap:
                cap = self.policy.token_cap(req)
                if cap is not None and cap < n:
                    n = max(1, cap)
        return min(n, budget, cfg.max_model_len - num_computed)

    def _add_to_output(self, out: SchedulerOutput, req: Request, n: int, new_ids: list[int]):
        out.requests.append(req)
        out.num_scheduled_tokens.append(n)
        out.total_num_scheduled_tokens += n
        if new_ids:
            out.new_block_ids[req.request_id] = new_ids
        spec = req.spec_token_ids
        num_tokens = req.num_prompt_tokens + len(req.output_token_ids)
        if spec:
            # The budget may cut into the drafts: verify only those scheduled.
            num_spec = req.num_computed_tokens + n - num_tokens
            if num_spec < len(spec):
                del spec[max(0, num_spec) :]
            if spec:
                out.spec_token_ids[req.request_id] = list(spec)
        if req.num_computed_tokens >= num_tokens - 1:  # only the last token (+ drafts)
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        lookahead = self.config.num_lookahead_tokens
        allocate = self.kv.allocate_slots
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RUNNING:  # preempted earlier in this loop
                continue
            computed = req.num_computed_tokens
            n = (
                req.num_prompt_tokens
                + len(req.output_token_ids)
                + len(req.spec_token_ids)
                - computed
            )
            if n > 1:  # a plain decode (n == 1) needs no caps
                n = self._num_new_tokens(req, computed, budget)
            while (new_ids := allocate(req, n, (), lookahead)) is None:
                victim = self.policy.select_victim(self.running, now)
                budget += self._preempt(victim, out, now)
                if victim is req:
                    break
            if new_ids is not None:
                self._add_to_output(out, req, n, new_ids)
                budget -= n
        return budget

    def _preempt(self, victim: Request, out: SchedulerOutput, now: float) -> int:
        """Preempt by recompute; returns the tokens it had been given this step."""
        returned = 0
        if out.requests and victim in out.requests:
            i = next(i for i, r in enumerate(out.requests) if r is victim)
            out.requests.pop(i)
            returned = out.num_scheduled_tokens.pop(i)
            out.total_num_scheduled_tokens -= returned
            if victim.num_computed_tokens >= victim.num_tokens - 1:
                out.num_decode_tokens -= returned
            else:
                out.num_prefill_tokens -= returned
            out.new_block_ids.pop(victim.request_id, None)
            out.spec_token_ids.pop(victim.request_id, None)
            out.new_req_ids.discard(victim.request_id)
        if victim.status is RUNNING:
            self.running.remove(victim)
        self.kv.forget_uncomputed(victim)  # blocks registered for this step's tokens
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = ()
        victim.remote_kv_tokens = 0  # recompute locally
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        self.waiting.add(victim, now)
        return returned

    def _displace_for_waiting(self, out: SchedulerOutput, now: float) -> None:
        """A preemptive policy, at the start of the step: the best waiting request
        displaces the worst running one when the batch is full or the cache has no
        room for the newcomer. The victim gets nothing this step, and the step
        admits no one (as after any preemption)."""
        kv = self.kv
        worst = displacement_victim(
            self.policy,
            self.running,
            self.waiting.peek(now),
            now,
            self.config.max_num_seqs,
            kv.num_free_blocks,
            kv.block_size,
        )
        if worst is not None:
            self._preempt(worst, out, now)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg, policy = self.config, self.policy
        # Requests whose KV arrived hold their blocks already: they go first, or
        # a waiting request could block them while they block it.
        while self.ready and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.ready[0]
            n = self._admit(req, out, budget, now)
            if n is None:
                if self.running or self.loading:
                    return  # someone will free blocks
                self.ready.pop(0)  # nobody will: give its blocks back, recompute later
                self._preempt(req, out, now)
                return
            self.ready.pop(0)
            budget -= n
        taken: list[int] = []
        for pos, req in self.waiting.candidates(now):
            if len(self.running) >= cfg.max_num_seqs or budget <= 0:
                break
            if self.policy_admits:
                admission = policy.admit(req, now)
                if admission.decision is Decision.DEFER:
                    continue
                if admission.decision is Decision.REJECT:
                    taken.append(pos)
                    self.requests.pop(req.request_id)
                    self._reject(req, admission.reason or f"rejected by {policy.name}", now)
                    continue
            if self.connector is not None and req.num_computed_tokens == 0:
                remote = self.connector.get_num_new_matched_tokens(req, 0)
                req.remote_kv_tokens = min(remote, req.num_tokens - 1)
            if req.remote_kv_tokens and req.num_computed_tokens == 0:
                if not self._start_kv_load(req, out, now):
                    break
                taken.append(pos)
                continue
            n = self._admit(req, out, budget, now)
            if n == 0:
                break  # without chunked prefill, the prompt does not fit the budget
            if n is None:
                self.admission_blocked_on_kv = True
                self._registered_when_blocked = self.kv.num_registered
                break  # no room: later requests wait too (no head-of-line bypass)
            taken.append(pos)
            budget -= n
        if taken:
            self.waiting.remove_positions(taken)

    def _admit(self, req: Request, out: SchedulerOutput, budget: int, now: float) -> int | None:
        """Move a waiting request into the batch; the tokens it got, or None if no room."""
        cfg, kv = self.config, self.kv
        lookup = req.num_computed_tokens == 0  # else: its KV arrived from elsewhere
        hits, num_hit = kv.get_computed_blocks(req) if lookup else ((), 0)
        num_computed = req.num_computed_tokens + num_hit
        if not cfg.enable_chunked_prefill and req.num_tokens - num_computed > budget:
            return 0
        n = self._num_new_tokens(req, num_computed, budget)
        if kv.allocate_slots(req, n, hits, cfg.num_lookahead_tokens, cfg.reserve_full_isl) is None:
            return None
        if lookup:
            kv.record_admission(req.num_tokens, num_hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.num_computed_tokens = num_computed
        req.status = RUNNING
        self.running.append(req)
        # The executor (re)builds this request's state: give it the whole table.
        out.new_req_ids.add(req.request_id)
        self._add_to_output(out, req, n, kv.get_block_ids(req.request_id))
        return n

    def _start_kv_load(self, req: Request, out: SchedulerOutput, now: float) -> bool:
        """Give a request whose KV comes from another instance its blocks, and wait."""
        # Its blocks become findable once the KV has arrived (_finish_kv_load).
        if self.kv.allocate_slots(req, req.remote_kv_tokens, delay_cache_blocks=True) is None:
            return False
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.loading[req.request_id] = req
        blocks = self.kv.get_block_ids(req.request_id)
        out.kv_loads.append((req, blocks))
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, blocks, req.remote_kv_tokens)
        return True

    # --- after the step ---
    def update_from_output(
        self, out: SchedulerOutput, result: ExecutorOutput, now: float
    ) -> list[Request]:
        """Account a finished step: append sampled tokens, roll back rejected drafts,
        stop finished requests and free them, stamp times at ``now`` (the step's end).
        Returns the requests that finished (or were rejected) since the last update.
        """
        sampled = result.sampled_token_ids
        accepted = result.num_accepted_drafts
        drafts = result.draft_token_ids
        spec_k = self.config.num_speculative_tokens
        finished = self._newly_finished
        self._newly_finished = []
        for i, req in enumerate(out.requests):
            if req.status is not RUNNING:
                continue  # aborted during the step
            n_spec = len(req.spec_token_ids)
            samples = (
                req.num_computed_tokens
                >= req.num_prompt_tokens + len(req.output_token_ids) + n_spec
            )
            if samples:
                if sampled is not None:
                    tokens = sampled[i]
                elif n_spec:
                    n_ok = min(n_spec, (accepted or {}).get(req.request_id, 0))
                    tokens = [STAND_IN_TOKEN] * (1 + n_ok)
                else:
                    tokens = (STAND_IN_TOKEN,)
                if n_spec:
                    # Rejected drafts were computed for nothing: roll the count back.
                    req.num_computed_tokens -= n_spec + 1 - len(tokens)
                    req.num_draft_tokens += n_spec
                    req.num_accepted_tokens += len(tokens) - 1
                    self.spec_stats.observe(n_spec, len(tokens) - 1)
                    req.spec_token_ids = ()
            if samples:
                if self._append_tokens(req, tokens, now):
                    finished.append(req)
                elif spec_k:
                    self._take_drafts(req, drafts.get(req.request_id, ()) if drafts else ())
        if self.kv.num_registered != self._registered_when_blocked:
            # Blocks were made findable since the head found no room: it may hit
            # them and need fewer blocks at the next admission.
            self.admission_blocked_on_kv = False
        if result.finished_recving or result.finished_sending or result.failed_recving:
            self.update_connector_output(
                result.finished_sending or (),
                result.finished_recving or (),
                now,
                result.failed_recving or (),
            )
        if finished:
            self.retire(finished)
        if self._has_on_step:
            self.policy.on_step(out, finished, now)
        return finished

    def _take_drafts(self, req: Request, proposed) -> None:
        """Keep a request's proposed drafts for its next step, as many as the policy
        lets it verify, and count what the proposer could and did propose."""
        room = min(self.config.num_speculative_tokens, req.max_num_tokens - req.num_tokens - 1)
        if self._has_draft_cap:
            cap = self.policy.draft_cap(req)
            if cap is not None:
                room = min(room, max(0, cap))
        self.spec_stats.observe_proposal(room, min(len(proposed), room))
        req.spec_token_ids = list(proposed[:room]) if room > 0 and proposed else ()

    def _append_tokens(self, req: Request, tokens, now: float) -> bool:
        """Append sampled tokens; True if the request has finished."""
        params = req.sampling_params
        stop_at = req.max_num_tokens
        out_ids, times = req.output_token_ids, req.token_times
        if times is None:
            times = req.token_times = array("d")
        if req.first_token_time is None:
            req.first_token_time = now
        eos = None if params.ignore_eos else req.eos_token_id
        stops = params.stop_token_ids
        for tok in tokens:
            out_ids.append(tok)
            times.append(now)
            if tok == eos or (stops and tok in stops):
                req.status, req.finish_reason = RequestStatus.FINISHED_STOPPED, "stop"
            elif req.num_prompt_tokens + len(out_ids) >= stop_at:
                req.status, req.finish_reason = RequestStatus.FINISHED_LENGTH, "length"
            else:
                continue
            req.finish_time = now
            return True
        return False

    def retire(self, finished: list[Request]) -> None:
        """Free requests that have just finished (from a step or the fast path)."""
        # Rejected and aborted requests were taken out where that happened.
        done = {id(r) for r in finished if r.status in SERVED}
        if not done:
            return
        self.admission_blocked_on_kv = False
        self.running = [r for r in self.running if id(r) not in done]
        connector = self.connector
        for req in finished:
            if id(req) in done:
                if connector is not None:
                    blocks = self.kv.get_block_ids(req.request_id)
                    keep, params = connector.request_finished(req, blocks)
                    if keep:  # its KV goes on to another instance: blocks stay
                        req.kv_transfer_params = params
                        self.sending[req.request_id] = req
                    else:
                        self.kv.free(req)
                else:
                    self.kv.free(req)
                self.requests.pop(req.request_id, None)
                self._finished_ids.append(req.request_id)

    def update_connector_output(
        self, finished_sending, finished_recving, now: float, failed_recving=()
    ) -> None:
        """The data side finished sending the KV of the finished requests
        ``finished_sending`` (their blocks are freed), receiving that of
        ``finished_recving`` (they run next), or failed to receive that of
        ``failed_recving`` (they compute their prompts here). From an executor's
        output, or from a simulator's transfer as it ends."""
        if self.connector is not None:
            self.connector.update_connector_output(
                set(finished_sending), set(finished_recving) | set(failed_recving)
            )
        for rid in finished_recving:
            self._finish_kv_load(rid, now)
        for rid in failed_recving:
            req = self.loading.pop(rid, None)
            if req is None:  # aborted meanwhile
                continue
            self.kv.free(req)
            req.kv_recomputed_tokens += req.remote_kv_tokens
            req.remote_kv_tokens = req.num_computed_tokens = 0
            req.kv_transfer_failed = True
            req.status = RequestStatus.WAITING
            self.waiting.add(req, now)
            self.admission_blocked_on_kv = False
        for rid in finished_sending:
            req = self.sending.pop(rid, None)
            if req is not None:  # (a release after the send is a no-op)
                self.kv.free(req)
                self.admission_blocked_on_kv = False

    def _finish_kv_load(self, request_id: str, now: float) -> None:
        req = self.loading.pop(request_id)
        req.num_computed_tokens = req.remote_kv_tokens
        req.status = RequestStatus.WAITING
        self.kv.cache_blocks(req)
        self.ready.append(req)
