"""``VllmEngine``: vLLM's own engine, driven as ``testbed.engine.replay`` drives ours.

It runs vLLM's V1 ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core, its scheduler and the model runner are here), with
:class:`~testbed.vllm_backend.scheduler.PolicyScheduler` as the scheduler and its
step record on. Each step's composition, preemptions, KV usage and queues come
from that record; each request's tokens from vLLM's outputs, stamped on the
run's clock when the step returns them, as the testbed's engine stamps its own.
Requests vLLM refuses as they are added are rejected with vLLM's message.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

from vllm import EngineArgs, SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.llm_engine import LLMEngine

from testbed.core import Request, RequestStatus, StepResult, WallClock
from testbed.core.scheduler import reject
from testbed.vllm_backend.steps import STEP_LOG_KEY, merged

SCHEDULER_CLS = "testbed.vllm_backend.scheduler.PolicyScheduler"

# vLLM's finish reasons as the testbed's statuses.
STATUS = {
    "length": RequestStatus.FINISHED_LENGTH,
    "stop": RequestStatus.FINISHED_STOPPED,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class VllmEngine:
    """An engine with ``clock``, ``add_request``, ``has_unfinished_requests`` and
    ``step`` (the surface :func:`~testbed.engine.replay.replay` uses)."""

    def __init__(self, engine_args: Mapping[str, Any], clock: WallClock) -> None:
        """``engine_args``: vLLM ``EngineArgs`` fields; the scheduler class, its step
        record and in-process execution are added here."""
        extra = dict(engine_args.get("additional_config") or {}, **{STEP_LOG_KEY: True})
        args = EngineArgs(
            **{**engine_args, "additional_config": extra},
            scheduler_cls=SCHEDULER_CLS,
            skip_tokenizer_init=True,
            async_scheduling=False,
            disable_log_stats=True,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.clock = clock
        self.scheduler.tb_now = clock  # the policy's clock is the run's (arrival times)
        self.requests: dict[str, Request] = {}
        self._num_steps = 0
        self._arrivals = 0
        self.schedule_s = 0.0  # the scheduler's own time, schedule() and update, summed

    # --- requests ---
    def add_request(self, req: Request) -> bool:
        """Queue ``req`` in vLLM; False (with ``req.reject_reason``) if vLLM refused it."""
        now = self.clock()
        p = req.sampling_params
        max_out = req.max_output_tokens
        extras = {
            "tenant": req.tenant,
            "ttft_slo_s": req.ttft_slo_s,
            "tpot_slo_s": req.tpot_slo_s,
            "target_output_tokens": req.target_output_tokens,
            "predicted_output_tokens": req.predicted_output_tokens,
        }
        params = SamplingParams(
            max_tokens=max_out,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            stop_token_ids=list(p.stop_token_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"testbed": {k: v for k, v in extras.items() if v is not None}},
        )
        if req.prompt_token_ids is None:
            return self._reject(req, "vLLM needs prompt token ids", now)
        try:
            self.engine.add_request(
                req.request_id,
                {"prompt_token_ids": list(req.prompt_token_ids)},
                params,
                arrival_time=req.arrival_time,
                priority=req.priority,
            )
        except Exception as e:  # vLLM's input checks (VLLMValidationError, ValueError)
            return self._reject(req, f"vLLM refused it: {e}", now)
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        req.max_num_tokens = req.num_prompt_tokens + (max_out or 0)
        self.requests[req.request_id] = req
        return True

    @staticmethod
    def _reject(req: Request, reason: str, now: float) -> bool:
        reject(req, reason, now)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    # --- the step ---
    def step(self) -> StepResult:
        """One ``LLMEngine.step()``: its outputs stamped, its record as a step row."""
        start = self.clock()
        outputs = self.engine.step()
        now = self.clock()
        log = self.scheduler.step_log
        records, log[:] = list(log), []
        record = merged(records, start)
        for rid in record.preempted_ids:
            if (req := self._request(rid)) is not None:
                req.num_preemptions += 1
                req.status = RequestStatus.PREEMPTED
        for rid, n, ctx in zip(record.request_ids, record.num_tokens, record.contexts):
            req = self._request(rid)
            if req is None:
                continue
            if req.first_scheduled_time is None:
                req.first_scheduled_time = record.schedule_start
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = ctx + n
        finished = [req for out in outputs if (req := self._take(out, now)) is not None]
        for r in records:
            self.schedule_s += (r.schedule_end - r.schedule_start) + (r.update_end - r.update_start)
        self._num_steps += 1
        num_reqs, _, pairs, kv, max_kv = record.features()
        return StepResult(
            step_id=self._num_steps - 1,
            start_s=start,
            latency_s=self.clock() - start,  # until the next step can start, as ours
            num_reqs=num_reqs,
            num_prefill_tokens=record.num_prefill_tokens,
            num_decode_tokens=record.num_decode_tokens,
            num_preempted=len(record.preempted_ids),
            kv_usage=record.kv_usage,
            num_waiting=record.num_waiting,
            num_running=record.num_running,
            kv_tokens=kv,
            attn_pairs=pairs,
            max_kv=max_kv,
            finished=finished,
        )

    def _request(self, rid: str) -> Request | None:
        """The testbed request of a vLLM request id (vLLM may suffix the caller's)."""
        req = self.requests.get(rid)
        if req is None and "-" in rid:
            req = self.requests.get(rid.rsplit("-", 1)[0])
        return req

    def _take(self, out, now: float) -> Request | None:
        """Stamp one request output's new tokens; the request if it finished."""
        req = self.requests.get(out.request_id)
        if req is None:
            return None
        completion = out.outputs[0] if out.outputs else None
        tokens = list(completion.token_ids) if completion is not None else []
        if tokens:
            if req.token_times is None:
                req.token_times = array("d")
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_token_ids.extend(tokens)
            req.token_times.extend([now] * len(tokens))
        if req.num_cached_tokens < 0 and out.num_cached_tokens is not None:
            req.num_cached_tokens = out.num_cached_tokens
        if not out.finished:
            return None
        reason = completion.finish_reason if completion is not None else "abort"
        stop = completion.stop_reason if completion is not None else None
        del self.requests[req.request_id]
        if reason == "abort" and isinstance(stop, str):  # refused by the policy
            reject(req, stop, now)
        else:
            req.status = STATUS.get(reason, RequestStatus.FINISHED_ABORTED)
            req.finish_reason = "aborted" if reason == "abort" else reason
            req.finish_time = now
        return req

    def reset_prefix_cache(self) -> None:
        """Forget cached blocks (after a warm-up, so the run starts cold)."""
        self.engine.reset_prefix_cache()
