"""``PolicyScheduler``: vLLM's V1 scheduler with a testbed policy's decisions.

Load it as vLLM's ``scheduler_cls``
(``testbed.vllm_backend.scheduler.PolicyScheduler``) with the policy spec (a
mapping ``policies.make_policy`` accepts) in
``VllmConfig.additional_config["testbed_policy"]``. It subclasses vLLM's
``Scheduler`` and delegates to it throughout; each hook sits where vLLM makes
the same choice (docs/plans/vllm_backend.md, section 1):

* the waiting-queue order: ``self.waiting`` is a :class:`PolicyQueue` over the
  testbed's own waiting queue;
* admission (admit, defer, reject with reason): ``_handle_blocked_waiting_request``;
  a rejected request is finished (aborted, with the reason) after the step;
* token caps: ``_reserve_prefill_lookahead`` (applied after vLLM's own caps);
* the preemption victim: vLLM's priority path is forced and each running
  request's ``priority`` holds its victim rank (the view keeps the original);
  ``_preempt_request`` checks that vLLM's pick is the policy's;
* a preemptive policy's displacement: before the step, as the testbed's
  scheduler does it (the victim is preempted before vLLM's running loop, and the
  waiting loop admits no one in that step);
* ``on_arrival`` in ``add_request``, ``on_step`` in ``update_from_output``,
  ``reorder_running`` before the step.

The clock is :meth:`PolicyScheduler.tb_now` (wall time; a replay overrides it).
Policies with a hook that has no place here (``support.refusal``), async
scheduling, KV transfer and vLLM's own cache-aware reordering are refused at
construction, with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import vllm
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from policies import make_policy
from testbed.core.outputs import SchedulerOutput as TestbedOutput
from testbed.core.policy import VICTIM_KEYS, VICTIM_SELECTORS, Decision, Policy, overrides
from testbed.core.scheduler import displacement_victim
from testbed.vllm_backend.queue import PolicyQueue
from testbed.vllm_backend.steps import STEP_LOG_KEY, VllmStep, is_decode
from testbed.vllm_backend.support import FORGET_KEY, POLICY_KEY, check_supported
from testbed.vllm_backend.views import RequestView

# The vLLM versions whose private methods the hooks were checked against.
SUPPORTED_VERSIONS = ("0.32.", "0.34.")


class PolicyView:
    """What the policy reads of the scheduler (``testbed.core.policy.SchedulerView``)."""

    def __init__(self, scheduler: PolicyScheduler) -> None:
        self.s = scheduler

    @property
    def running(self) -> Sequence[RequestView]:
        views = self.s.views
        return [views[r.request_id] for r in self.s.running]

    @property
    def num_waiting(self) -> int:
        return len(self.s.waiting)

    @property
    def kv_usage(self) -> float:
        return self.s.kv_cache_manager.usage

    def prefix_hit_tokens(self, request: RequestView) -> int:
        if request.num_computed_tokens:
            return request.num_computed_tokens
        kv, req = self.s.kv_cache_manager, request.req
        probe = getattr(kv, "get_num_cached_tokens", None)
        if probe is not None:
            return probe(req)
        # vLLM 0.32 has no side-effect-free probe: its lookup, without the references.
        if not kv.prefix_cache_lookup_enabled(req):
            return 0
        return kv.coordinator.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)[1]


class PolicyScheduler(Scheduler):
    """vLLM's scheduler deciding as the configured testbed policy decides."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        if not vllm.__version__.startswith(SUPPORTED_VERSIONS):
            raise ValueError(
                f"PolicyScheduler supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VERSIONS)}"
                f", not {vllm.__version__}: its hooks ride on private Scheduler methods"
            )
        spec = (vllm_config.additional_config or {}).get(POLICY_KEY)
        if spec is None:
            raise ValueError(
                f"PolicyScheduler needs additional_config[{POLICY_KEY!r}]: a policy "
                "spec such as {'name': 'sjf'}"
            )
        policy = make_policy(spec)
        check_supported(policy)
        sc = vllm_config.scheduler_config
        if sc.async_scheduling:
            raise ValueError(
                "PolicyScheduler: async scheduling is refused (the policy would rank "
                "requests whose last step is still in flight); pass --no-async-scheduling"
            )
        if vllm_config.kv_transfer_config is not None:
            raise ValueError(
                "PolicyScheduler: a KV connector is refused (its asynchronous loads "
                "bypass the policy's admission and order)"
            )
        super().__init__(vllm_config, *args, **kwargs)
        if getattr(self, "cache_aware_window", 0):
            raise ValueError(
                "PolicyScheduler: vLLM's cache-aware admission window is refused (it "
                "reorders the waiting queue itself)"
            )
        # vLLM's priority path picks the victim as max (priority, arrival) and
        # returns an already scheduled victim's tokens, as the testbed does.
        self.policy = SchedulingPolicy.PRIORITY
        self.tb_policy: Policy = policy
        self.views: dict[str, RequestView] = {}
        self._arrivals = 0
        self._now = 0.0
        self._in_schedule = False
        self._order: dict[str, int] = {}
        self._rejected: list[tuple[Request, str]] = []
        self._finished_views: list[RequestView] = []  # aborted or rejected, for on_step
        self.waiting = PolicyQueue(policy, self._view_of, lambda: self._now)
        self._has_admit = overrides(policy, "admit")
        self._has_cap = overrides(policy, "token_cap") and sc.enable_chunked_prefill
        self._has_on_step = overrides(policy, "on_step")
        builtin = not overrides(policy, "select_victim") and (
            policy._select is VICTIM_SELECTORS.get(policy.victim)
        )
        self._victim_order = VICTIM_KEYS[policy.victim] if builtin else None
        # vLLM keeps findable the blocks it cached at allocation for a victim that
        # was scheduled earlier in the same step, whose KV is then never written;
        # the testbed unfinds them. On: do as the testbed (see _forget_uncomputed).
        self._forget = bool((vllm_config.additional_config or {}).get(FORGET_KEY, False))
        # Each step's record (testbed.vllm_backend.steps), drained by its reader.
        self.step_log: list[VllmStep] | None = (
            [] if (vllm_config.additional_config or {}).get(STEP_LOG_KEY) else None
        )
        self._step: VllmStep | None = None
        policy.attach(PolicyView(self))

    def tb_now(self) -> float:
        """The policy's clock (``Request.arrival_time``'s domain)."""
        return time.time()

    def _view_of(self, request: Request) -> RequestView:
        return self.views[request.request_id]

    # --- arrivals ---
    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            self._now = now = self.tb_now()
            view = RequestView(request, self._arrivals)
            self._arrivals += 1
            self.views[request.request_id] = view
            self.tb_policy.on_arrival(view, now)
        super().add_request(request)

    # --- the step ---
    def schedule(self, *args, **kwargs):
        self._now = now = self.tb_now()
        policy, views = self.tb_policy, self.views
        if policy.reorder_running and len(self.running) > 1:
            key = policy.key
            self.running.sort(
                key=lambda r: (key(views[r.request_id], now), views[r.request_id].arrival_seq)
            )
        if policy.preemptive and self.running and self.waiting:
            self._displace_for_waiting(now)
        self._rank_victims(now)
        self._in_schedule = True
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._in_schedule = False
            self.waiting.close()
        if self._rejected:
            ids = [r.request_id for r, _ in self._rejected]
            self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        if self.step_log is not None:
            self._step = self._record_schedule(out, now)
        return out

    def _record_schedule(self, out, start: float) -> VllmStep:
        """The step's record as scheduling leaves it: its new and resumed requests,
        its victims and the KV it holds."""
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        return VllmStep(
            schedule_start=start,
            schedule_end=self.tb_now(),
            new_ids=[r.req_id for r in out.scheduled_new_reqs]
            + [r for r in cached.req_ids if r in resumed],
            preempted_ids=list(out.preempted_req_ids or ()),
            kv_usage=self.kv_cache_manager.usage,
        )

    def _displace_for_waiting(self, now: float) -> None:
        """A preemptive policy, before the step (as the testbed's scheduler): the best
        waiting request displaces the worst running one when the batch is full or
        the free blocks cannot hold the newcomer. The victim leaves ``running``
        before vLLM's running loop sees it, ``_preempt_request`` reports it in this
        step's ``preempted_req_ids``, and the waiting queue holds its requests back
        for the step (no admissions in a step that preempted)."""
        views = self.views
        # vLLM's pool keeps its null block out of the free count, as the testbed's
        # cache (one block smaller) has none.
        worst = displacement_victim(
            self.tb_policy,
            [views[r.request_id] for r in self.running],
            self.waiting.head(),
            now,
            self.scheduler_config.max_num_seqs,
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            self.block_size,
        )
        if worst is not None:
            self.running.remove(worst.req)
            self._preempt_request(worst.req, time.monotonic())  # outside the guard
            self.waiting.hold()

    def _rank_victims(self, now: float) -> None:
        """Write each running request's victim rank into ``priority`` (largest first out)."""
        running = self.running
        # The step's running order, in which the guard hands the policy its candidates.
        self._order = {r.request_id: i for i, r in enumerate(running)}
        if len(running) < 2:
            return
        views, policy = self.views, self.tb_policy
        cands = [views[r.request_id] for r in running]
        if self._victim_order is not None:
            order = self._victim_order
            cands.sort(key=lambda v: order(v, policy, now))
        else:  # a custom selector: rank by repeated elimination
            left, out = list(cands), []
            while left:
                victim = policy.select_victim(left, now)
                left.remove(victim)
                out.append(victim)
            cands = out[::-1]
        for rank, view in enumerate(cands):
            view.req.priority = rank

    def _preempt_request(self, request: Request, timestamp: float, *args, **kwargs) -> None:
        # vLLM's running loop picks its victims: check them. A displacement before
        # the step is the policy's own pick, and a victim with no step scheduled
        # has no uncomputed blocks to unfind.
        if self._in_schedule:
            views, order = self.views, self._order
            # The running requests as the testbed's would stand: the victim in its place.
            cands = [r for r in self.running if r is not request]
            cands.append(request)
            cands.sort(key=lambda r: order[r.request_id])
            cands = [views[r.request_id] for r in cands]
            want = self.tb_policy.select_victim(cands, self._now)
            if want.req is not request:
                raise AssertionError(
                    f"vLLM preempted {request.request_id} but policy "
                    f"{self.tb_policy.name!r} picks {want.request_id}"
                )
            if self._forget:
                self._forget_uncomputed(request)
        super()._preempt_request(request, timestamp, *args, **kwargs)

    def _forget_uncomputed(self, request: Request) -> None:
        """Unfind the blocks cached for this step's tokens of a victim (from the block
        holding its first uncomputed token on), as the testbed's KV manager does."""
        manager = self.kv_cache_manager
        pool = manager.block_pool
        for single in manager.coordinator.single_type_managers:
            blocks = single.req_to_blocks.get(request.request_id, ())
            start = request.num_computed_tokens // single.block_size
            cached = single.num_cached_block.get(request.request_id, 0)
            for block in blocks[start:cached]:
                pool._maybe_evict_cached_block(block)
            if cached > start:
                single.num_cached_block[request.request_id] = start

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        if not self._has_admit:
            return True
        policy = self.tb_policy
        admission = policy.admit(self.views[request.request_id], self._now)
        if admission.decision is Decision.ADMIT:
            return True
        if admission.decision is Decision.REJECT:
            self._rejected.append((request, admission.reason or f"rejected by {policy.name}"))
        return False  # vLLM skips it this step (DEFER), or it is finished after the step

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self._has_cap and n > 1:
            cap = self.tb_policy.token_cap(self.views[request.request_id])
            if cap is not None and cap < n:
                n = max(1, cap)
        return n

    # --- after the step ---
    def finish_requests(self, request_ids, finished_status):
        done = super().finish_requests(request_ids, finished_status)
        views = self.views
        self._finished_views.extend(views[r.request_id] for r in done if r.request_id in views)
        return done

    def update_from_output(self, scheduler_output, model_runner_output):
        self._now = now = self.tb_now()
        views = self.views
        step = None
        if self._has_on_step:
            step = TestbedOutput(step_id=0)
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                view = views[rid]
                step.requests.append(view)
                step.num_scheduled_tokens.append(n)
                step.context_lens.append(view.num_computed_tokens - n)
                step.total_num_scheduled_tokens += n
        record, self._step = self._step, None
        if record is not None:
            record.update_start = now
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                req = views[rid].req
                context = req.num_computed_tokens - n
                record.request_ids.append(rid)
                record.num_tokens.append(n)
                record.contexts.append(context)
                record.decode.append(is_decode(context, req.num_tokens))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        finished, self._finished_views = self._finished_views, []
        if self._rejected:
            for request, reason in self._rejected:
                eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
                eco.outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=FinishReason.ABORT,
                        stop_reason=reason,
                    )
                )
            self._rejected = []
        for rid in scheduler_output.num_scheduled_tokens:
            view = views.get(rid)
            if view is not None and view.req.is_finished():
                finished.append(view)
        if step is not None:
            self.tb_policy.on_step(step, finished, now)
        for view in finished:
            views.pop(view.request_id, None)
        if record is not None:
            record.num_waiting, record.num_running = len(self.waiting), len(self.running)
            record.update_end = self.tb_now()
            self.step_log.append(record)
        return outputs
