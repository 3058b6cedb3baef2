"""The run config's schema (testbed/config_schema.py): typos and wrong types fail at
start-up naming the key; each mode declares its own fields; a bundled policy's
options and defaults are its class's."""

from __future__ import annotations

import inspect
import os

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from policies import REGISTRY, make_policy, policy_class
from testbed.config_schema import compose_config, validate
from testbed.errors import InputError


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["engine.max_num_seq=8"], "engine.max_num_seq"),  # a typo
        (["engine.block_size=big"], "engine.block_size"),  # a wrong type
        (["cluster.num_replica=2"], "cluster.num_replica"),
        (["hardware.thread=1"], "hardware.thread"),
        (["model.dtpye=float32"], "model.dtpye"),
        (["mode.latency_scale=2", "mode=real"], "mode.latency_scale"),  # a sim-only field
        (["mode=real", "mode.idle_prob=true"], "mode.idle_prob"),
        (["policy=sjf", "policy.aging=3"], "policy.aging"),
        (["policy=fcfs", "policy.aging_tokens_per_s=3"], "policy.aging_tokens_per_s"),
    ],
)
def test_an_override_the_schema_does_not_have_fails_naming_its_key(overrides, key):
    with pytest.raises(ConfigCompositionException, match=key.replace(".", r"\.")):
        compose_config(overrides)


def test_each_mode_has_its_own_fields_with_their_defaults():
    sim = compose_config(["mode=sim"]).mode
    real = compose_config(["mode=real"]).mode
    profile = compose_config(["mode=profile"]).mode
    assert sim.latency_scale == 1.0 and sim.fast_forward and sim.speed_trace is None
    assert real.device is None and real.idle_probe is False and "latency_scale" not in real
    assert profile.grid == "auto" and profile.replay_sparse_requests == 12
    assert compose_config(["mode.latency_scale=2"]).mode.latency_scale == 2.0  # an int, as float


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_bundled_policys_options_are_its_constructors_arguments_and_defaults(name):
    cfg = OmegaConf.to_container(compose_config([f"policy={name}"]).policy)
    params = list(inspect.signature(policy_class(REGISTRY[name]).__init__).parameters.values())
    assert cfg == {"name": name, **{p.name: p.default for p in params[1:]}}
    assert type(make_policy(cfg)).__name__ == policy_class(REGISTRY[name]).__name__


def test_a_policy_option_set_on_the_command_line_reaches_the_policy():
    cfg = compose_config(["policy=mlfq", "policy.starvation_s=2", "policy.num_levels=3"])
    policy = make_policy(OmegaConf.to_container(cfg.policy))
    assert policy.starvation_s == 2.0 and len(policy.quanta) == 3


def test_hardware_and_model_entries_fill_their_schema():
    cfg = compose_config(["hardware=cpu1", "model=llama3-8b"])
    assert cfg.hardware.name == "cpu1" and cfg.hardware.threads == 1
    assert cfg.hardware.cpus is None and cfg.hardware.reference_cpus is None  # declared, unset
    assert cfg.model.hf_config.num_hidden_layers == 32 and cfg.model.path is None
    h200 = compose_config(["hardware=h200"]).hardware
    assert h200.threads is None and h200.kv_cache_bytes is None


def test_a_composed_config_pickles_with_its_policy_options():
    # A run's config is sent to other processes (a spawned probe, a launcher's workers).
    import pickle

    cfg = compose_config(["policy=vtc", "policy.output_weight=3", "hardware.cpus=[0]"])
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.policy.output_weight == 3.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["engine.block_size=0"], r"engine\.block_size=0: must be an integer >= 1"),
        (
            ["engine.gpu_memory_utilization=1.5"],
            r"gpu_memory_utilization=1\.5: must be in \(0, 1\]",
        ),
        (["cluster.router=nope"], r"cluster\.router=nope: must be one of least_kv_usage"),
        (["mode.latency_scale=0"], r"mode\.latency_scale=0\.0: must be > 0"),
        (["+engine.max_num_seq=4"], r"engine\.max_num_seq: no such option of the engine group"),
        (["+policy.foo=1"], r"policy\.foo: no such option of policy=fcfs"),
        (
            ["mode=real", "cluster=disagg", "cluster.num_decode=0"],
            r"cluster\.num_prefill=1, cluster\.num_decode=0: disaggregation needs both",
        ),
        (["trace=csv"], r"trace=csv needs trace\.path=<value>"),
        (["policy=custom"], r"policy=custom needs policy\._target_=<value>"),
    ],
)
def test_validate_names_the_key_its_value_and_what_is_allowed(overrides, message):
    with pytest.raises(InputError, match=message):
        validate(compose_config(overrides))


def test_a_custom_policy_may_take_arguments_the_schema_does_not_know():
    validate(compose_config(["policy=custom", "policy._target_=a.B", "+policy.weight=2"]))


def test_run_py_prints_an_input_error_alone_and_exits_2(tmp_path):
    import subprocess
    import sys

    from testbed.models import PROJECT_ROOT

    cmd = [sys.executable, str(PROJECT_ROOT / "run.py"), "engine.block_size=0"]
    cmd += ["logging=disabled", f"hydra.run.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**env, "TESTBED_NO_BOOTSTRAP": "1"}
    )
    assert res.returncode == 2
    assert res.stderr.strip() == "Error: engine.block_size=0: must be an integer >= 1"
    full = subprocess.run(
        cmd, capture_output=True, text=True,
        env={**env, "TESTBED_NO_BOOTSTRAP": "1", "HYDRA_FULL_ERROR": "1"},
    )  # fmt: skip
    assert "Traceback" in full.stderr and "InputError" in full.stderr


@pytest.mark.parametrize("reserve", [True, False])
def test_the_engines_scheduler_options_reach_both_modes_schedulers(reserve):
    """``engine.reserve_full_isl`` (vLLM 0.34's default: on) and its siblings build
    the same SchedulerConfig for the simulator and for the real engine."""
    from testbed.build import engine_args, scheduler_config

    overrides = [f"engine.reserve_full_isl={reserve}", "engine.long_prefill_token_threshold=64"]
    sim = scheduler_config(compose_config(["mode=sim", *overrides]).engine, 4096)
    real = engine_args(compose_config(["mode=real", *overrides]))
    assert sim.reserve_full_isl is reserve and real.reserve_full_isl is reserve
    assert sim.long_prefill_token_threshold == real.long_prefill_token_threshold == 64
    assert compose_config([]).engine.reserve_full_isl is True
