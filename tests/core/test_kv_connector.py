"""The scheduler with a KV connector (disaggregated prefill/decode, control plane
only): a producer keeps a finished request's blocks until its KV is sent; a
consumer loads a request's prompt KV before running it, and recomputes it when
the transfer fails or the request is preempted after it."""

from __future__ import annotations

from policies import make_policy
from testbed.core import ExecutorOutput, KVCacheManager, RequestStatus, Scheduler, SchedulerConfig
from testbed.core.kv_connector import PDConnector, PDMetadata
from tests.factories import create_requests


def scheduler(role: str, num_blocks: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    kv = KVCacheManager(num_blocks, 4, True)
    return Scheduler(cfg, kv, make_policy("fcfs"), PDConnector(role, instance=3))


def step(s: Scheduler, now: float, **result):
    so = s.schedule(now)
    out = ExecutorOutput(latency_s=0.01, **result)
    return so, s.update_from_output(so, out, now + 0.01)


def test_a_producer_keeps_a_finished_requests_blocks_until_its_kv_is_sent():
    s = scheduler("producer")
    (r,) = create_requests(1, prompt_len=10, output_len=1)
    r.kv_transfer_params = {"do_remote_decode": True}
    s.add_request(r, 0.0)
    so, finished = step(s, 0.0)
    assert finished == [r] and r.status is RequestStatus.FINISHED_LENGTH
    blocks = r.kv_transfer_params["remote_block_ids"]
    assert len(blocks) == 3 and s.kv.num_free_blocks == 32 - 3  # still held
    assert r.kv_transfer_params == {
        "do_remote_prefill": True, "remote_instance": 3, "remote_request_id": "r0",
        "remote_block_ids": blocks, "num_tokens": 10,
    }  # fmt: skip
    assert list(s.sending) == ["r0"] and not s.has_unfinished_requests()
    step(s, 1.0, finished_sending={"r0"})  # from the data side's output
    assert s.kv.num_free_blocks == 32 and not s.sending
    # A request without the params is freed at once.
    (q,) = create_requests(1, prompt_len=10, output_len=1, start=1)
    s.add_request(q, 2.0)
    step(s, 2.0)
    assert s.kv.num_free_blocks == 32 and not s.sending


def remote(prompt_len=10, output_len=4, start=0):
    (r,) = create_requests(1, prompt_len=prompt_len, output_len=output_len, start=start)
    r.kv_transfer_params = {
        "do_remote_prefill": True, "remote_instance": 3, "remote_request_id": f"p{start}",
        "remote_block_ids": [7, 8, 9],
    }  # fmt: skip
    return r


def test_a_consumer_loads_the_prompts_kv_then_computes_only_its_last_token():
    s = scheduler("consumer")
    r = remote()
    s.add_request(r, 0.0)
    so, _ = step(s, 0.0)
    assert not so.requests and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = so.kv_connector_metadata.loads
    assert isinstance(so.kv_connector_metadata, PDMetadata)
    assert (load.request_id, load.num_tokens, load.remote_instance) == ("r0", 9, 3)
    assert (load.remote_request_id, load.remote_block_ids) == ("p0", [7, 8, 9])
    assert load.block_ids == s.kv.get_block_ids("r0") and len(load.block_ids) == 3
    so, _ = step(s, 0.5)  # nothing arrived yet: nothing runs
    assert not so.requests and so.kv_connector_metadata is None
    # Its blocks hold no KV yet: nobody finds them in the prefix cache.
    assert s.kv.get_computed_blocks(r)[1] == 0
    s.update_connector_output((), {"r0"}, 1.0)  # the simulator's way: as the transfer ends
    assert s.kv.get_computed_blocks(r)[1] == 8  # arrived: findable
    so, _ = step(s, 1.0)
    assert so.num_scheduled_tokens == [1] and so.context_lens == [9]  # the last prompt token
    for t in range(2, 6):
        step(s, float(t))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 4
    assert not r.kv_transfer_failed


def test_a_failed_transfer_recomputes_the_prompt_and_says_so():
    s = scheduler("consumer")
    r = remote()
    s.add_request(r, 0.0)
    step(s, 0.0)
    step(s, 1.0, failed_recving={"r0"})
    assert r.kv_transfer_failed and r.status is RequestStatus.WAITING
    assert s.kv.num_free_blocks == 32  # its blocks went back
    so, _ = step(s, 2.0)
    assert so.num_scheduled_tokens == [10] and so.context_lens == [0]  # the whole prompt
    assert so.kv_connector_metadata is None  # not asked again


def test_a_request_preempted_after_its_kv_arrived_recomputes_here():
    s = scheduler("consumer", num_blocks=4)  # room for one request of 10 + 4 tokens
    r = remote(output_len=6)
    s.add_request(r, 0.0)
    step(s, 0.0)
    s.update_connector_output((), {"r0"}, 0.5)
    step(s, 0.5)
    s._preempt(r, s.schedule(1.0), 1.0)
    assert r.status is RequestStatus.PREEMPTED and r.remote_kv_tokens == 0
    so, _ = step(s, 2.0)
    # Not asked for again: computed here (its prompt's full blocks still cached).
    assert so.kv_connector_metadata is None and not so.kv_loads
    assert so.context_lens == [8] and so.num_scheduled_tokens == [3]
