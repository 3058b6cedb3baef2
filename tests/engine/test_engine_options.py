"""The engine's options made into each mode's scheduler by one conversion, and
its KV cache sized by one formula in both modes (testbed/build.py,
testbed/engine/factory.py, SchedulerConfig.of, testbed.models.num_kv_blocks)."""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch

from policies import make_policy
from testbed.build import engine_args, hardware_spec, kv_blocks, model_spec, scheduler_config
from testbed.config_schema import EngineConfig, compose_config
from testbed.core import EngineCore, SchedulerConfig
from testbed.core.kv_connector import PDConnector
from testbed.engine.args import CPU_KV_CACHE_BYTES, EngineArgs
from testbed.engine.device import pick_dtype
from testbed.engine.factory import (
    build_engine,
    engine_kv_blocks,
    largest_step,
    measure_gpu_memory,
    run_largest_step,
)
from testbed.errors import InputError
from testbed.models import GPUMemory, ModelSpec, num_kv_blocks

CUDA = torch.device("cuda")  # a device as the factory sees it: nothing runs on it here
# Every option the engine group and EngineArgs share, away from its default.
OPTIONS = [
    "engine.block_size=8",
    "engine.max_num_batched_tokens=256",
    "engine.max_num_seqs=5",
    "engine.max_model_len=200",
    "engine.enable_chunked_prefill=false",
    "engine.long_prefill_token_threshold=32",
    "engine.reserve_full_isl=false",
    "engine.enable_prefix_caching=false",
    "engine.num_kv_blocks=40",
    "engine.gpu_memory_utilization=0.5",
    "engine.kv_cache_bytes=1e6",
    "engine.attention_backend=torch",
]
# Options the real engine takes only at their default (it refuses others; tested below).
DEFAULT_ONLY = {"tensor_parallel_size", "pipeline_parallel_size"}


def test_engine_args_carry_every_option_the_engine_group_names_alike():
    cfg = compose_config(["mode=real", *OPTIONS])
    args, defaults = engine_args(cfg), EngineArgs(model="any")
    shared = {f.name for f in fields(EngineArgs)} & {f.name for f in fields(EngineConfig)}
    assert shared >= DEFAULT_ONLY
    shared -= DEFAULT_ONLY
    assert len(shared) == len(OPTIONS)
    for name in shared:
        assert getattr(args, name) == cfg.engine[name] != getattr(defaults, name), name


@pytest.mark.parametrize("model,dtype", [("dummy-llama", "float32"), ("qwen3-0.6b", "bfloat16")])
def test_the_real_engine_runs_in_the_models_dtype(model, dtype):
    assert engine_args(compose_config(["mode=real", f"model={model}"])).dtype == dtype


def test_a_named_dtype_is_kept_on_a_cpu_and_an_unknown_one_refused():
    cpu = torch.device("cpu")
    assert pick_dtype(None, cpu) == torch.float32
    assert pick_dtype("auto", CUDA) == torch.bfloat16
    assert pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert pick_dtype("float32", CUDA) == torch.float32
    with pytest.raises(InputError, match="dtype='bf32'"):
        pick_dtype("bf32", cpu)


@pytest.mark.parametrize("name", sorted(DEFAULT_ONLY))
def test_the_real_engine_refuses_parallelism_it_only_simulates(name):
    message = (
        f"{name}=2: this engine runs each replica on one device; tensor and pipeline "
        "parallelism are simulated only \\(mode=sim\\)"
    )
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="any", **{name: 2})
    # the engine group's option reaches the engine (by name) and is refused there
    with pytest.raises(InputError, match=message):
        engine_args(compose_config(["mode=real", f"engine.{name}=2"]))
    assert getattr(engine_args(compose_config(["mode=real"])), name) == 1


def test_run_py_refuses_a_tensor_parallel_real_run_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from testbed.models import PROJECT_ROOT

    cmd = [sys.executable, str(PROJECT_ROOT / "run.py"), "mode=real"]
    cmd += ["engine.tensor_parallel_size=2", "trace.num_requests=2"]
    cmd += ["logging=disabled", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**env, "TESTBED_NO_BOOTSTRAP": "1"}
    )
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "Error: tensor_parallel_size=2: this engine runs each replica on one device; "
        "tensor and pipeline parallelism are simulated only (mode=sim)"
    )
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_one_engine_config_makes_the_same_scheduler_in_both_modes():
    spec = [
        "engine.speculative.method=draft_model",
        "engine.speculative.model=dummy-llama",
        "engine.speculative.draft_num_layers=2",
    ]
    cfg = compose_config(["mode=real", "model=dummy-llama", *OPTIONS, *spec])
    sim = scheduler_config(cfg.engine, cfg.engine.max_model_len)
    assert sim == SchedulerConfig(
        max_num_batched_tokens=256,
        max_num_seqs=5,
        max_model_len=200,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=32,
        num_speculative_tokens=3,
        num_lookahead_tokens=3,  # a draft model's drafts take KV slots
        reserve_full_isl=False,
    )
    engine, _, _ = build_engine(replace(engine_args(cfg), device="cpu"))
    assert engine.scheduler.config == sim
    kv = engine.scheduler.kv
    assert (kv.num_blocks, kv.block_size, kv.enable_prefix_caching) == (40, 8, False)


def test_an_engines_options_without_a_scheduler_option_are_refused_naming_it():
    engine = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "enable_chunked_prefill": True}
    with pytest.raises(KeyError, match="long_prefill_token_threshold"):
        SchedulerConfig.of(engine, 100)
    args = vars(EngineArgs(model="any"))
    args = SimpleNamespace(**{k: v for k, v in args.items() if k != "reserve_full_isl"})
    with pytest.raises(AttributeError, match="reserve_full_isl"):
        SchedulerConfig.of(args, 100)


def test_engine_core_build_takes_a_made_config_and_connector():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)
    connector = PDConnector("consumer", 1)
    fcfs = make_policy("fcfs")
    engine = EngineCore.build(None, fcfs, 10, 4, config=config, connector=connector)
    assert engine.scheduler.config is config and engine.scheduler.connector is connector
    assert engine.scheduler.kv.num_blocks == 10 and engine.scheduler.kv.block_size == 4
    assert EngineCore.build(None, fcfs, 10).scheduler.config == SchedulerConfig()


# --- the KV cache's size ---


def llama3_on_h100():
    cfg = compose_config(["mode=real", "model=llama3-8b", "hardware=h100"])
    return cfg, model_spec(cfg.model), hardware_spec(cfg)


def test_a_gpu_engine_sizes_its_cache_by_the_simulators_formula_from_what_it_measured():
    cfg, spec, hw = llama3_on_h100()
    args = engine_args(cfg)
    # Measuring what the simulator's hardware entry says, it gets the simulator's cache.
    same = GPUMemory(
        hw.memory_bytes, 0.9, spec.weight_bytes("bfloat16"), hw.activation_reserve_bytes
    )
    blocks = engine_kv_blocks(args, spec, "bfloat16", CUDA, lambda: same)
    assert blocks == kv_blocks(cfg.engine, spec, hw, "bfloat16", cfg.hardware.kv_cache_bytes)
    # Each input is what it measured: the device's memory, the weights and the peak.
    per_block = 16 * spec.kv_bytes_per_token("bfloat16")  # 2 MiB
    measured = GPUMemory(85e9, 0.9, 16.5e9, 1.25e9)
    got = engine_kv_blocks(args, spec, "bfloat16", CUDA, lambda: measured)
    assert got == int((85e9 * 0.9 - 16.5e9 - 1.25e9) // per_block)
    peakier = replace(
        measured, activation_peak_bytes=measured.activation_peak_bytes + 64 * per_block
    )
    assert engine_kv_blocks(args, spec, "bfloat16", CUDA, lambda: peakier) == got - 64


def test_a_fixed_budget_or_block_count_needs_no_measurement():
    cfg, spec, _ = llama3_on_h100()
    args, per_block = engine_args(cfg), 16 * spec.kv_bytes_per_token("bfloat16")

    def measure() -> GPUMemory:
        raise AssertionError("measured where nothing needed it")

    assert engine_kv_blocks(replace(args, num_kv_blocks=7), spec, "bfloat16", CUDA, measure) == 7
    budget = replace(args, kv_cache_bytes=10 * per_block)
    assert engine_kv_blocks(budget, spec, "bfloat16", CUDA, measure) == 10
    cpu = torch.device("cpu")
    assert engine_kv_blocks(args, spec, "bfloat16", cpu, measure) == CPU_KV_CACHE_BYTES // per_block


def test_the_warm_up_step_is_the_largest_a_scheduler_may_make():
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=4096)
    lens = largest_step(config)  # 255 decodes beside the prompt chunk that fills the budget
    assert len(lens) == 256 and sum(lens) == 2048 and lens[0] == 2048 - 255 and set(lens[1:]) == {1}
    verifying = largest_step(replace(config, num_speculative_tokens=3))
    assert len(verifying) == 256 and sum(verifying) == 2048 and min(verifying) == 4
    assert largest_step(SchedulerConfig(2048, 4, 300)) == [300] * 4  # none past max_model_len
    assert largest_step(SchedulerConfig(100, 256, 4096)) == [1] * 100  # one token each at most


def test_the_warm_up_pass_runs_at_the_largest_step_into_a_cache_of_its_own():
    _, executor, _ = build_engine(EngineArgs("dummy-llama", device="cpu", num_kv_blocks=8))
    config = SchedulerConfig(
        max_num_batched_tokens=300, max_num_seqs=8, max_model_len=256, num_speculative_tokens=2
    )
    cache = run_largest_step(executor.model, executor.backend, executor.device, config, 16)
    blocks = sum(-(-n // 16) for n in largest_step(config))
    assert cache == blocks * executor.kv_cache_bytes // 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_cache_is_what_the_measured_peak_leaves(monkeypatch):
    from testbed.core import Request, SamplingParams
    from testbed.engine import factory

    measured: list[GPUMemory] = []

    def measure(*args, **kwargs) -> GPUMemory:
        measured.append(measure_gpu_memory(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(factory, "measure_gpu_memory", measure)
    args = EngineArgs("dummy-llama", device="cuda", gpu_memory_utilization=0.1)
    engine, executor, cfg = build_engine(args)
    (memory,) = measured
    total = torch.cuda.get_device_properties(executor.device).total_memory
    weights = sum(p.numel() * p.element_size() for p in executor.model.parameters())
    assert memory.memory_bytes == total and memory.memory_utilization == 0.1
    assert memory.weight_bytes >= weights  # with whatever else the process holds
    sampled_logits = engine.scheduler.config.max_num_seqs * cfg.vocab_size * 4  # float32
    assert sampled_logits < memory.activation_peak_bytes < 2**30
    spec = ModelSpec.from_hf_config(cfg.raw)
    blocks = num_kv_blocks(spec, "bfloat16", args.block_size, memory=memory)
    assert engine.scheduler.kv.num_blocks == blocks
    assert memory.kv_cache_bytes - executor.kv_cache_bytes < executor.kv_cache_bytes / blocks
    # The engine's steps stay within its share of the card.
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
    for i in range(20):
        prompt = [7] * 100 * (i + 1)
        engine.add_request(Request(f"r{i}", prompt_token_ids=prompt, sampling_params=sampling))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated(executor.device) <= 0.1 * total
    # A smaller largest step leaves a smaller peak.
    small = replace(engine.scheduler.config, max_num_batched_tokens=64, max_num_seqs=4)
    less = measure_gpu_memory(executor.model, executor.backend, executor.device, small, 16, 0.1)
    assert less.activation_peak_bytes < memory.activation_peak_bytes
