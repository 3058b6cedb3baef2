"""A testbed policy inside vLLM's scheduler (``testbed.vllm_backend``) schedules
every step as the testbed's scheduler does under that policy (a preemptive one's
displacements included), and by itself changes nothing of vLLM's own schedule.

Runs where the replay tool and its venv exist (``experiments/vllm_parity/
reference.py`` says how to build the venv); skipped, with that command, elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from experiments.vllm_parity import reference
from experiments.vllm_parity.cli import run_pair
from experiments.vllm_parity.compare import compare, read_steps
from experiments.vllm_parity.matrix import MIXED as MATRIX_MIXED
from experiments.vllm_parity.reference import POLICY_CLASS, Settings, run_vllm
from experiments.vllm_parity.streams import StreamSpec, write_stream
from testbed.core.scheduler import Scheduler


def needs_vllm():
    why = reference.missing()
    if why:
        pytest.skip(why)


# Tenants, priorities, TTFT deadlines and shared prefixes, on a cache that preempts.
MIXED = StreamSpec(
    n=100,
    rate=2.0,
    prompt=(20, 400),
    output=(4, 60),
    share_frac=0.6,
    priority_classes=3,
    num_tenants=3,
    ttft_slo_s=(5.0, 40.0),
    seed=7,
)
TIGHT = Settings(num_gpu_blocks=48)
TEST_POLICIES = "tests.experiments.vllm_test_policies"


def preemptions(steps_csv) -> int:
    return sum(
        len(list(filter(None, r["preempted"].split(";")))) for r in read_steps(steps_csv).values()
    )


def test_fcfs_through_the_class_is_stock_vllm_and_the_testbed(tmp_path):
    needs_vllm()
    stream = write_stream(MIXED, tmp_path / "stream.csv")
    result, _, theirs = run_pair(
        stream, Settings(num_gpu_blocks=48, vllm_class=POLICY_CLASS), tmp_path / "class"
    )
    assert result.same, result.summary()
    assert preemptions(theirs.steps_csv) > 0, "the case was meant to preempt"
    stock = run_vllm(stream, TIGHT, tmp_path / "stock")
    against_stock = compare(theirs.steps_csv, stock.steps_csv)
    assert against_stock.same, against_stock.summary()


@pytest.mark.parametrize(
    "policy, args",
    [
        ("vtc", "{}"),
        ("edf", '{"reject_late": true}'),
        ("sjf", '{"victim": "least_computed"}'),
        (f"{TEST_POLICIES}:CappedFCFS", "{}"),  # token_cap
        (f"{TEST_POLICIES}:DeferringSJF", "{}"),  # admit: defer and reject
        (f"{TEST_POLICIES}:FirstRunningVictim", "{}"),  # a custom select_victim
    ],
)
def test_a_policy_in_vllm_schedules_every_step_as_the_testbed(policy, args, tmp_path):
    needs_vllm()
    stream = write_stream(MIXED, tmp_path / "stream.csv")
    settings = Settings(num_gpu_blocks=48, policy=policy, policy_args=args, vllm_class=POLICY_CLASS)
    result, ours, theirs = run_pair(stream, settings, tmp_path)
    assert result.same, result.summary()
    assert result.identical == result.steps_vllm > 0 and ours.unfinished == 0
    # The policy did decide: vLLM's own FCFS schedules the stream otherwise.
    stock = run_vllm(stream, TIGHT, tmp_path / "stock")
    assert not compare(theirs.steps_csv, stock.steps_csv).same
    if args.startswith('{"reject') or "Deferring" in policy:  # rejected: finished, never admitted
        steps = read_steps(theirs.steps_csv).values()
        admitted = {x.split(":")[0] for r in steps for x in r["admitted"].split(";") if x}
        finished = {x for r in steps for x in r["finished"].split(";") if x}
        assert finished - admitted, "the case was meant to reject requests"
    if "Capped" in policy:
        steps = read_steps(theirs.steps_csv).values()
        assert any(x.endswith(":48") for r in steps for x in r["scheduled"].split(";"))


@pytest.mark.parametrize(
    "policy, args, spec",
    [
        # Short prompts, long outputs: a newcomer has less work left than a long decode.
        ("srpt", "{}", replace(MIXED, prompt=(10, 100), output=(4, 300))),
        ("mlfq", "{}", MIXED),
        ("mlfq", '{"starvation_s": 20.0}', MIXED),
    ],
)
def test_a_preemptive_policy_in_vllm_displaces_before_the_step_as_the_testbed(
    policy, args, spec, tmp_path, monkeypatch
):
    """srpt and mlfq: a waiting request displaces a running one at the start of the
    step (in vLLM: before its running loop); every step as the testbed's."""
    needs_vllm()
    displaced = []
    displace = Scheduler._displace_for_waiting

    def counted(self, out, now):
        before = len(out.preempted_req_ids)
        displace(self, out, now)
        displaced.extend(out.preempted_req_ids[before:])

    monkeypatch.setattr(Scheduler, "_displace_for_waiting", counted)
    stream = write_stream(spec, tmp_path / "stream.csv")
    settings = Settings(num_gpu_blocks=48, policy=policy, policy_args=args, vllm_class=POLICY_CLASS)
    result, ours, theirs = run_pair(stream, settings, tmp_path)
    assert result.same, result.summary()
    assert result.identical == result.steps_vllm > 0 and ours.unfinished == 0
    assert displaced, "the case was meant to displace running requests"
    assert preemptions(theirs.steps_csv) >= len(displaced)


def test_a_same_step_victims_blocks_stay_findable_in_vllm_unless_the_class_forgets(tmp_path):
    """vLLM caches a request's full blocks when it allocates them; a victim preempted
    after its scheduling in the same step leaves them findable though their KV is
    never written, where our KV manager unfinds them. The first divergence is a
    resume that hits more in vLLM; with forget_uncomputed the class does as ours."""
    needs_vllm()
    stream = write_stream(replace(MATRIX_MIXED, n=1300), tmp_path / "stream.csv")
    settings = Settings(
        num_gpu_blocks=128, long_prefill_token_threshold=64, policy="sjf", vllm_class=POLICY_CLASS
    )
    result, _, _ = run_pair(stream, settings, tmp_path / "kept")
    assert not result.same and "resumed" in result.first_fields
    ours, theirs = result.rows
    hit = {r.split(":")[0]: int(r.split(":")[1]) for r in ours["resumed"].split(";") if r}
    more = [
        r for r in theirs["resumed"].split(";") if r and int(r.split(":")[1]) > hit[r.split(":")[0]]
    ]
    assert more, (ours["resumed"], theirs["resumed"])
    forgot, _, _ = run_pair(stream, replace(settings, forget_uncomputed=True), tmp_path / "forgot")
    assert forgot.same, forgot.summary()
