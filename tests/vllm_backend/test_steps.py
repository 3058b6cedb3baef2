"""The step record ``PolicyScheduler`` keeps of each vLLM step gives the row the
testbed's own scheduler would log for the same composition."""

from __future__ import annotations

from testbed.core.outputs import SchedulerOutput
from testbed.core.request import Request
from testbed.vllm_backend.steps import VllmStep, is_decode, merged


def _request(prompt: int, outputs: int, computed: int) -> Request:
    req = Request("r", num_prompt_tokens=prompt)
    req.output_token_ids = [0] * outputs
    req.num_computed_tokens = computed
    return req


def test_a_record_counts_what_the_testbeds_schedule_counts():
    # (prompt, outputs, context, new tokens): a first chunk, a last chunk, decodes
    rows = [(300, 0, 0, 128), (300, 0, 256, 44), (50, 7, 56, 1), (900, 40, 939, 1)]
    out = SchedulerOutput(step_id=0)
    step = VllmStep(schedule_start=0.0, schedule_end=0.0)
    for prompt, outputs, ctx, n in rows:
        req = _request(prompt, outputs, ctx + n)  # computed counts include the step's
        out.requests.append(req)
        out.num_scheduled_tokens.append(n)
        out.total_num_scheduled_tokens += n
        step.request_ids.append(req.request_id)
        step.num_tokens.append(n)
        step.contexts.append(ctx)
        step.decode.append(is_decode(ctx, prompt + outputs))
    assert step.features() == out.features()
    assert step.num_prefill_tokens == 128 + 44
    assert step.num_decode_tokens == 2


def test_a_request_decodes_once_only_its_last_token_is_left():
    assert is_decode(56, 57) and not is_decode(55, 57) and is_decode(0, 1)


def test_records_of_one_engine_step_merge_into_one_row():
    a = VllmStep(1.0, 1.1, request_ids=["a"], num_tokens=[5], contexts=[0], decode=[False])
    b = VllmStep(1.2, 1.3, request_ids=["b"], num_tokens=[1], contexts=[9], decode=[True])
    b.preempted_ids, b.kv_usage, b.num_waiting, b.num_running = ["c"], 0.5, 2, 1
    one = merged([a, b], start=1.0)
    assert one.request_ids == ["a", "b"] and one.preempted_ids == ["c"]
    assert (one.num_prefill_tokens, one.num_decode_tokens) == (5, 1)
    assert (one.kv_usage, one.num_waiting, one.num_running) == (0.5, 2, 1)
    assert merged([a], start=0.0) is a
    empty = merged([], start=3.0)
    assert empty.features() == (0, 0, 0.0, 0, 0) and empty.schedule_start == 3.0
