"""``mode=vllm``: a trace replayed on vLLM itself, with the run's policy inside its
scheduler, writes the run folder of the other modes. Skipped where the vLLM
environment is not set up (``python -m testbed.vllm_backend.install``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.errors import InputError
from testbed.job import run_from_config
from testbed.vllm_backend import install
from tests.sim.helpers import compose_cfg

needs_vllm = pytest.mark.skipif(
    not install.ready(), reason=f"the vLLM environment is not set up: {install.COMMAND}"
)

RUN = [
    "engine.block_size=32",
    "engine.max_model_len=512",
    "trace.num_requests=24",
    "trace.rate=8",
    "logging=disabled",
    "progress=false",
    "plots=false",
]
# Rejects prompts over 380 tokens (with the reason) and defers long ones.
POLICY = [
    "policy=custom",
    "policy._target_=tests.experiments.vllm_test_policies.DeferringSJF",
]


def test_vllm_needs_blocks_its_cpu_attention_takes(tmp_path):
    cfg = compose_cfg("mode=vllm", "engine.block_size=16", *RUN[1:])
    with pytest.raises(InputError, match=r"engine\.block_size=16: vLLM's CPU attention"):
        run_from_config(cfg, tmp_path / "run")


@needs_vllm
def test_a_vllm_run_writes_every_request_and_step_with_the_policys_decisions(tmp_path):
    vllm = run_from_config(compose_cfg("mode=vllm", *RUN, *POLICY), tmp_path / "vllm")
    sim = run_from_config(compose_cfg("mode=sim", *RUN, *POLICY), tmp_path / "sim")
    assert vllm["mode"] == "vllm" and vllm["vllm_version"].startswith(("0.32.", "0.34."))
    assert vllm["scheduler_ms_per_step"] > 0 and not vllm["partial"]
    assert vllm["threads"] >= 1
    only_vllm = {
        "machine",
        "vllm_version",
        "vllm_dtype",
        "scheduler_ms_per_step",
        "vllm_build_s",
        "vllm_warmup_s",
        "threads",
    }
    only_sim = {"sim_wall_s", "sim_requests_per_wall_s", "num_jumps", "num_jumped_steps"}
    only_sim |= {"latency_scale", "speed_trace"}
    assert set(vllm) - only_vllm == set(sim) - only_sim
    reqs = pd.read_csv(tmp_path / "vllm" / "requests.csv").set_index("request_id")
    sim_reqs = pd.read_csv(tmp_path / "sim" / "requests.csv").set_index("request_id")
    assert list(reqs.columns) == list(sim_reqs.columns) and len(reqs) == 24
    for f in ("steps.csv", "timeline.csv"):
        a, b = pd.read_csv(tmp_path / "vllm" / f), pd.read_csv(tmp_path / "sim" / f)
        assert list(a.columns) == list(b.columns)
    too_long = reqs.prompt_tokens > 512
    refused = reqs.prompt_tokens.between(381, 512)
    assert too_long.any() and refused.any(), "the trace must exercise both refusals"
    # vLLM refuses prompts past max_model_len as they come, with its own message ...
    assert (reqs.status[too_long] == "rejected").all()
    assert reqs.reason[too_long].str.startswith("vLLM refused it:").all()
    # ... and the policy inside vLLM's scheduler rejects the long ones, with its reason;
    # the simulator's scheduler makes the same decisions.
    assert (reqs.status[refused] == "rejected").all()
    assert (
        reqs.reason[refused] == reqs.prompt_tokens[refused].map("prompt of {} tokens".format)
    ).all()
    assert (sim_reqs.status[refused] == "rejected").all()
    served = reqs[reqs.status == "finished_length"]
    assert len(served) == (~too_long & ~refused).sum()
    want = (512 - served.prompt_tokens).clip(upper=sim_reqs.output_tokens[served.index])
    assert (served.output_tokens == want).all()
    assert (served.first_token_s >= served.first_scheduled_s).all()
    assert (served.first_scheduled_s >= served.arrival_s).all()
    # Every token the served requests computed is in the step log.
    steps = pd.read_csv(tmp_path / "vllm" / "steps.csv")
    computed = steps.num_prefill_tokens.sum() + steps.num_decode_tokens.sum()
    need = (served.prompt_tokens - served.cached_tokens + served.output_tokens - 1).sum()
    if steps.num_preempted.sum() == 0:
        assert computed == need
    else:
        assert computed > need
    assert steps.num_prefill_tokens.sum() >= (served.prompt_tokens - served.cached_tokens).sum()
    assert (steps.latency_s > 0).all() and steps.start_s.is_monotonic_increasing
    metrics = json.loads((tmp_path / "vllm" / "metrics.json").read_text())
    assert metrics["num_rejected"] == too_long.sum() + refused.sum()


@needs_vllm
def test_a_vllm_run_stopped_part_way_writes_what_it_measured(tmp_path):
    cfg = compose_cfg("mode=vllm", "mode.max_wall_s=1.5", *RUN[:2], "trace.num_requests=200")
    out = run_from_config(cfg, tmp_path / "run")
    assert out["partial"] and out["stop_reason"] == "stopped at max_wall_s=1.5"
    reqs = pd.read_csv(tmp_path / "run" / "requests.csv")
    assert len(reqs) == 200 and 0 < (reqs.status == "finished_length").sum() < 200
