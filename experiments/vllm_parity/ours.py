"""Our side of the comparison: ``testbed.core``'s scheduler on the very stream,
clock and tokens that the replay tool gives vLLM's.

The clock is the tool's: one scheduler step per iteration; a request joins
right before the first step whose index reaches its ``arrival_step``; an empty
system jumps to the next arrival. The data plane is faked the same way: after
a step, every request whose tokens are all computed samples one token, the
tool's ``TokenFactory.output_token`` (so output blocks hash alike on both
sides), and a request mid-prefill samples nothing. The per-step CSV has the
tool's columns.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.vllm_parity.reference import Settings, tool_module
from policies import make_policy
from testbed.core import (
    ExecutorOutput,
    KVCacheManager,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

COLUMNS = [
    "step",
    "num_running",
    "num_waiting",
    "num_scheduled_reqs",
    "total_scheduled_tokens",
    "kv_usage",
    "arrived",
    "scheduled",
    "admitted",
    "resumed",
    "preempted",
    "finished",
]


@dataclass(frozen=True)
class OurRun:
    steps_csv: Path
    ms_per_step: float  # schedule + update per step, as the tool measures vLLM's
    unfinished: int


def build(settings: Settings, max_model_len: int) -> Scheduler:
    policy = make_policy(settings.policy_spec())
    config = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        reserve_full_isl=settings.reserve_full_isl,
    )
    # vLLM's first block is its null block: it schedules into the other N - 1.
    kv = KVCacheManager(
        settings.num_gpu_blocks - 1,
        settings.block_size,
        enable_prefix_caching=settings.enable_prefix_caching,
    )
    return Scheduler(config, kv, policy)


def run_ours(stream: Path, settings: Settings, out_dir: Path) -> OurRun:
    tool = tool_module()
    reqs = tool.load_requests(str(stream), settings.step_time_s)
    extras = _request_data(stream)
    longest = max(r.prompt_tokens + r.output_tokens for r in reqs)
    max_model_len = settings.max_model_len or max(longest, settings.max_num_batched_tokens)
    room = (settings.num_gpu_blocks - 1) * settings.block_size
    if room < min(longest, max_model_len):
        # vLLM refuses to start when max_model_len does not fit its KV cache;
        # replayed, it would wait on such a request forever, and we reject it.
        raise ValueError(
            f"{stream}: the longest request ({longest} tokens) does not fit "
            f"{settings.num_gpu_blocks - 1} usable blocks of {settings.block_size} tokens; "
            "give more --num-gpu-blocks or a shorter --max-model-len"
        )
    tokens = tool.TokenFactory(settings.block_size, settings.seed)
    output_token = tool.TokenFactory.output_token
    sched = build(settings, max_model_len)
    index: dict[str, int] = {}
    made: dict[str, Request] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ours_steps.csv"
    n, pi, step, steps, busy, stalled = len(reqs), 0, 0, 0, 0.0, 0
    admitted_once: set[str] = set()
    with open(path, "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(COLUMNS)
        while True:
            arrived = []
            while pi < n and reqs[pi].arrival_step <= step:
                r = reqs[pi]
                arrival = float(r.arrival_s if r.arrival_s is not None else r.arrival_step)
                req = Request(
                    r.rid,
                    prompt_token_ids=tokens.prompt(r),
                    sampling_params=SamplingParams(
                        max_tokens=r.output_tokens, ignore_eos=True, temperature=0.0
                    ),
                    arrival_time=arrival,
                    **extras.get(r.rid, {}),
                )
                index[r.rid] = r.idx
                made[r.rid] = req
                sched.add_request(req, float(step))
                arrived.append(r.rid)
                pi += 1
            if not sched.has_unfinished_requests():
                if pi >= n:
                    break
                step = reqs[pi].arrival_step
                continue
            t0 = time.perf_counter()
            out = sched.schedule(float(step))
            sampled = [
                [output_token(index[req.request_id], len(req.output_token_ids))]
                if req.num_computed_tokens >= req.num_tokens
                else []
                for req in out.requests
            ]
            finished = sched.update_from_output(
                out, ExecutorOutput(sampled_token_ids=sampled), float(step)
            )
            busy += time.perf_counter() - t0
            first, resumed = [], []
            for req, before in zip(out.requests, out.context_lens, strict=True):
                if req.request_id in out.new_req_ids:
                    rid = req.request_id
                    (resumed if rid in admitted_once else first).append(f"{rid}:{before}")
                    admitted_once.add(rid)
            rows.writerow(
                [
                    step,
                    len(sched.running),
                    sched.num_waiting,
                    len(out.requests),
                    out.total_num_scheduled_tokens,
                    f"{sched.kv_usage:.4f}",
                    ";".join(arrived),
                    ";".join(
                        f"{r.request_id}:{k}"
                        for r, k in zip(out.requests, out.num_scheduled_tokens, strict=True)
                    ),
                    ";".join(first),
                    ";".join(resumed),
                    ";".join(sorted(out.preempted_req_ids)),
                    ";".join(r.request_id for r in finished),
                ]
            )
            step += 1
            steps += 1
            # As the tool: a request that can never get its blocks stalls both sides.
            stalled = 0 if out.total_num_scheduled_tokens or arrived else stalled + 1
            if stalled > 1000:
                break
    unfinished = sum(1 for r in made.values() if not r.is_finished) + (n - pi)
    return OurRun(path, 1000 * busy / max(steps, 1), unfinished)


# Stream columns that go to our Request as they go to vLLM's (vllm_shim.py).
REQUEST_COLUMNS = {
    "priority": int,
    "tenant": str,
    "ttft_slo_s": float,
    "tpot_slo_s": float,
    "target_output_tokens": int,
    "predicted_output_tokens": int,
}


def _request_data(stream: Path) -> dict[str, dict]:
    """Per request id, the stream's per-request fields (priority, tenant, SLOs...)."""
    with open(stream, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for i, row in enumerate(rows):
        data = {}
        for name, kind in REQUEST_COLUMNS.items():
            value = row.get(name)
            if value in (None, ""):
                continue
            try:
                data[name] = kind(value)
            except ValueError as e:
                raise ValueError(f"{stream}: row {i + 1}, {name}: {e}") from e
        if data:
            out[(row.get("request_id") or str(i)).strip()] = data
    return out
