"""Builders: each object of a run from its resolved Hydra config, in one place.

The model (its shape for the simulator, its config and weights folder for the
engine), the hardware, the KV cache's size, the scheduler's and the real
engine's options, the latency model and the machine's speed, the trace and its
requests. The modes (``testbed.modes``) and the capacity search call these;
nothing here runs anything. No torch: a simulation never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from policies import policy_class
from policies.deciders import make_decider
from policies.routers import make_router
from testbed.config_schema import vllm_fields
from testbed.core import SchedulerConfig
from testbed.core.kv_faults import KVFaults
from testbed.core.routing import Decider, Router
from testbed.engine.args import EngineArgs
from testbed.engine.model_config import ModelConfig
from testbed.engine.spec_config import SpeculativeConfig, resolve_draft
from testbed.errors import InputError
from testbed.hardware import HardwareSpec
from testbed.models import (
    PROJECT_ROOT,
    ModelSpec,
    ResolvedModel,
    num_kv_blocks,
    resolve_model,
    same_folder,
)
from testbed.sim.acceptance import AcceptanceModel, acceptance_table_path
from testbed.sim.gpu_model import Parallelism, replica_memory
from testbed.sim.latency import LatencyModel
from testbed.sim.link import LinkSpec
from testbed.sim.predictor import make_latency_model
from testbed.sim.profile_model import ProfileModel
from testbed.sim.speed import SpeedTrace
from testbed.workload import RequestStream, to_requests
from traces import load_trace

if TYPE_CHECKING:
    import pandas as pd

    from testbed.core import Request


def in_project(path: str | Path) -> Path:
    """``path``, relative to the project where it is not absolute."""
    path = Path(path)
    return path if path.is_absolute() else PROJECT_ROOT / path


# --- the model and the machine ---


def run_model(cfg: DictConfig) -> ResolvedModel:
    """The run's model (``cfg.model``): its name, HF config and weights folder."""
    return resolved(cfg.model)


def model_spec(model: Mapping[str, Any]) -> ModelSpec:
    """The shape of a model config group entry (``cfg.model``)."""
    return resolved(model).spec()


def resolved(model: Mapping[str, Any]) -> ResolvedModel:
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=True)
    try:
        return resolve_model(model)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(f"model={model.get('name')}: {e}") from e


def hardware_spec(cfg: DictConfig) -> HardwareSpec:
    return HardwareSpec.from_config(cfg.hardware)


def parallelism(engine: Mapping[str, Any]) -> Parallelism:
    """How one replica spans GPUs (``engine.tensor_parallel_size`` x
    ``engine.pipeline_parallel_size``); bad values refused naming the field."""
    try:
        return Parallelism(engine["tensor_parallel_size"], engine["pipeline_parallel_size"])
    except ValueError as e:
        raise InputError(str(e)) from e


def kv_blocks(
    engine: Mapping[str, Any],
    spec: ModelSpec,
    hw: HardwareSpec,
    dtype: str,
    kv_cache_bytes: float | None,
) -> int:
    """The engine's KV blocks: as configured, else a fixed budget (``engine.kv_cache_bytes``,
    else the hardware's ``kv_cache_bytes``), else what the replica's GPUs leave, by
    the real engine's formula with the spec sheet's memory and activation peak
    (``activation_reserve_bytes``) per GPU and the model's weights, the KV heads
    replicated where a replica has more tensor-parallel ranks than KV heads."""
    if engine["num_kv_blocks"]:
        return int(engine["num_kv_blocks"])
    parallel = parallelism(engine)
    memory = replica_memory(spec, hw, dtype, engine["gpu_memory_utilization"], parallel)
    try:
        return num_kv_blocks(
            parallel.kv_spec(spec),
            dtype,
            engine["block_size"],
            engine["kv_cache_bytes"] or kv_cache_bytes,
            memory,
        )
    except ValueError as e:  # the replica is too small for the model
        raise InputError(
            f"hardware={hw.name} engine.tensor_parallel_size={parallel.tensor} "
            f"engine.pipeline_parallel_size={parallel.pipeline} "
            f"({parallel.num_gpus} GPU(s) a replica): {e}"
        ) from e


# --- the engine ---


def scheduler_config(engine: Mapping[str, Any], max_model_len: int) -> SchedulerConfig:
    """The scheduler's limits of the engine group (:meth:`SchedulerConfig.of`, as the
    real engine makes its own from :func:`engine_args`)."""
    return SchedulerConfig.of(engine, max_model_len, speculative_config(engine))


def acceptance_model(cfg: DictConfig, spec: ModelSpec) -> AcceptanceModel | None:
    """The simulator's acceptance model of ``engine.speculative`` (None: off): a
    table a real run measured (a path, or ``auto``: :func:`acceptance_table`) or
    one rate given by hand. Exactly one is required: how often drafts are
    accepted depends on the model, the draft and the workload, and a rate made up
    here would pass for a prediction."""
    speculative = speculative_config(cfg.engine)
    if speculative is None:
        return None
    options, k = cfg.engine.speculative, speculative.num_speculative_tokens
    table, rate = options.acceptance_table, options.acceptance_rate
    if table is not None and rate is not None:
        raise InputError(
            f"engine.speculative.acceptance_table={table}, acceptance_rate={rate}: give "
            "one (the table a real run measured, or one rate for every position)"
        )
    make_one = (
        "python run.py mode=real with this model, trace and engine.speculative writes "
        "one as spec_acceptance.csv in its run directory"
    )
    if table is None and rate is None:
        auto = acceptance_table(cfg, spec)
        shown = auto.relative_to(PROJECT_ROOT) if auto.is_relative_to(PROJECT_ROOT) else auto
        there = f"=auto (measured: {shown})" if auto.exists() else f"=auto once one is at {shown}"
        raise InputError(
            f"engine.speculative.method={speculative.method}: mode=sim needs an acceptance "
            "model, and has no default; give engine.speculative.acceptance_table=<a real "
            f"run's spec_acceptance.csv> ({make_one}), acceptance_table{there}, or "
            "acceptance_rate=<p> (each of k drafts accepted with p, given by hand)"
        )
    if table == "auto":
        path = acceptance_table(cfg, spec)
        if not path.exists():
            raise InputError(
                f"engine.speculative.acceptance_table=auto: no table at {path} ({make_one}; "
                "copy it there)"
            )
        return AcceptanceModel.from_csv(path, k)
    if table is not None:
        return AcceptanceModel.from_csv(Path(table).resolve(), k)
    return AcceptanceModel.constant(k, rate)


def acceptance_table(cfg: DictConfig, spec: ModelSpec) -> Path:
    """Where ``engine.speculative.acceptance_table=auto`` looks: beside the
    profiles, ``<hardware>/<model>.spec.<method>.csv``, a draft model's named after
    the draft as its profile is (``.spec.draft_model.<draft>.csv``)."""
    speculative = speculative_config(cfg.engine)
    draft = profiled_draft(cfg)
    return acceptance_table_path(
        in_project(cfg.profiles_dir),
        hardware_spec(cfg).name,
        spec.name,
        speculative.method,
        draft.name if draft is not None else None,
    )


def draft_model(cfg: DictConfig) -> ResolvedModel | None:
    """``engine.speculative``'s draft model (None: no draft model), found and checked
    against the run's model as the real engine checks it
    (:func:`~testbed.engine.spec_config.resolve_draft`). A run of either mode calls
    this before anything else (``job.prepare``), so a draft that is missing or
    cannot draft for the target is refused in one line, the same in both."""
    speculative = speculative_config(cfg.engine)
    if speculative is None or speculative.method != "draft_model":
        return None
    target = run_model(cfg)
    try:
        target_config = ModelConfig.of(target)
    except ValueError as e:
        raise InputError(f"model={target.name}: {e}") from e
    try:
        return resolve_draft(speculative, target_config, cfg.engine.max_model_len)
    except ValueError as e:
        raise InputError(str(e).replace("speculative_config.", "engine.speculative.")) from e


def draft_latency_model(cfg: DictConfig) -> LatencyModel | None:
    """The latency model of a draft model's passes (``engine.speculative.draft_profile``;
    None: no draft model, or its passes not modelled): the draft's profile, else its
    roofline, as the target's is chosen."""
    speculative = speculative_config(cfg.engine)
    where = cfg.engine.speculative.draft_profile
    if speculative is None or speculative.method != "draft_model" or where is None:
        return None
    if where != "auto":
        path = Path(where).resolve()
        if not path.exists():
            raise InputError(f"engine.speculative.draft_profile={where}: no such file")
        return ProfileModel(path)
    return _latency_model(cfg, profiled_draft(cfg).spec())


def profiled_draft(cfg: DictConfig) -> ResolvedModel | None:
    """The draft model as its profile and acceptance table name it (None: no draft
    model): the run's model where the draft is the target itself, cut to
    ``draft_num_layers`` (``<model>.first<N>``)."""
    draft = draft_model(cfg)
    if draft is None:
        return None
    target = run_model(cfg)
    if same_folder(draft.folder, target.folder) and draft.hf_config == target.hf_config:
        draft = target  # the target as its own draft: named as the run's model
    return draft.first_layers(cfg.engine.speculative.draft_num_layers)


def num_engines(cluster: Mapping[str, Any]) -> int:
    """The cluster's engine instances: its prefill and decode replicas where it is
    disaggregated, else its colocated ones."""
    if cluster["num_prefill"] > 0:
        return cluster["num_prefill"] + cluster["num_decode"]
    return cluster["num_replicas"]


def speculative_config(engine: Mapping[str, Any]) -> SpeculativeConfig | None:
    """``engine.speculative`` as vLLM's ``speculative_config`` (None: off)."""
    return SpeculativeConfig.of(vllm_fields(engine["speculative"]))


def policy_config(cfg: DictConfig) -> dict[str, Any]:
    """The policy group entry as ``policies.make_policy`` takes it."""
    return OmegaConf.to_container(cfg.policy, resolve=True)


def policy_name(cfg: DictConfig) -> str:
    """The run's policy as its labels name it: a bundled one by its group option,
    a custom one (``policy._target_``) by its class's ``name``."""
    if cfg.policy.get("_target_"):
        try:
            return policy_class(cfg.policy._target_).name
        except (ValueError, TypeError) as e:
            raise InputError(f"policy._target_={cfg.policy._target_}: {e}") from e
    return cfg.policy.name


def engine_args(cfg: DictConfig) -> EngineArgs:
    """The real engine's options: the engine group's own, by name (the two share
    vLLM's names; ``speculative`` becomes ``speculative_config``), the model's dtype,
    then what the hardware, mode and policy groups set."""
    e, hw = cfg.engine, cfg.hardware
    named = {f.name: e[f.name] for f in fields(EngineArgs) if f.name in e}
    named["kv_cache_bytes"] = e.kv_cache_bytes or hw.kv_cache_bytes  # as kv_blocks takes it
    named["dtype"] = named.get("dtype") or cfg.model.get("dtype")  # the model's, as mode=vllm
    return EngineArgs(
        **named,
        model=run_model(cfg).name,
        policy=policy_config(cfg),
        speculative_config=vllm_fields(e.speculative) if e.speculative.method else None,
        device=cfg.mode.get("device"),
        threads=hw.threads,
        cpus=OmegaConf.to_container(hw.cpus) if hw.cpus is not None else None,
        seed=cfg.seed,
    )


# --- the simulator's step latencies ---


def latency_model(cfg: DictConfig, spec: ModelSpec | None = None) -> LatencyModel:
    """The simulator's latency model for this config (``mode.latency_model``; auto: the
    profile of its hardware and model where one exists, else the GPU operator model
    where the hardware has measured operator times, else the roofline model)."""
    spec = spec or model_spec(cfg.model)
    return _latency_model(cfg, spec)


def _latency_model(cfg: DictConfig, spec: ModelSpec) -> LatencyModel:
    """:func:`make_latency_model` for ``spec`` on the run's hardware, replica shape and
    ``mode.latency_model`` choice; a model or split it cannot price is an InputError."""
    try:
        return make_latency_model(
            spec,
            hardware_spec(cfg),
            cfg.model.dtype,
            in_project(cfg.profiles_dir),
            parallelism(cfg.engine),
            cfg.mode.get("latency_model", "auto"),
        )
    except ValueError as e:
        raise InputError(str(e)) from e


def _cluster_policy(cfg: DictConfig, key: str, make):
    """``cluster.<key>`` made with its options (``cluster.<key>_args``); bad ones
    refused naming them."""
    name = cfg.cluster[key]
    args = OmegaConf.to_container(cfg.cluster[f"{key}_args"], resolve=True)
    try:
        return make(name, **args)
    except (TypeError, ValueError) as e:
        raise InputError(f"cluster.{key}={name} {args}: {e}") from e


def router(cfg: DictConfig) -> Router:
    """The cluster's router with its options (``cluster.router_args``)."""
    return _cluster_policy(cfg, "router", make_router)


def decider(cfg: DictConfig) -> Decider:
    """The disaggregated cluster's decider with its options (``cluster.decider_args``)."""
    return _cluster_policy(cfg, "decider", make_decider)


def pairing(cfg: DictConfig) -> Router:
    """The router that pairs a disaggregated request with a decode replica."""
    return _cluster_policy(cfg, "pairing", make_router)


def kv_faults(cfg: DictConfig) -> KVFaults:
    """The KV transfer faults the run injects (none by default), seeded by the run's seed."""
    c = cfg.cluster
    return KVFaults(c.kv_fault, c.kv_fault_rate, cfg.seed)


def link_spec(cfg: DictConfig) -> LinkSpec:
    """The KV link of a disaggregated cluster: its preset, with any field overridden."""
    c = cfg.cluster
    spec = LinkSpec.preset(c.link)
    if c.link_latency_s is not None or c.link_bandwidth_bytes_s is not None:
        spec = LinkSpec(
            f"{c.link} (overridden)",
            spec.latency_s if c.link_latency_s is None else c.link_latency_s,
            spec.bandwidth_bytes_s
            if c.link_bandwidth_bytes_s is None
            else c.link_bandwidth_bytes_s,
            spec.source,
        )
    return spec


def speed_trace(cfg: DictConfig) -> SpeedTrace | None:
    """The run's ``mode.speed_trace`` (a CSV; relative to the working directory), if any."""
    path = cfg.mode.speed_trace
    if not path:
        return None
    try:
        return SpeedTrace.from_csv(Path(path).resolve())
    except (ValueError, FileNotFoundError) as e:
        raise InputError(f"mode.speed_trace={path}: {e}") from e


def machine_speed(cfg: DictConfig, trace: SpeedTrace | None) -> SpeedTrace | None:
    """What the simulated steps are multiplied by: the speed trace times
    ``mode.latency_scale`` (a machine slower or faster than when profiled), the
    scale alone without a trace, or nothing."""
    scale = cfg.mode.latency_scale
    if trace is not None:
        return trace.scaled(scale) if scale != 1.0 else trace
    return SpeedTrace.constant(scale) if scale != 1.0 else None


# --- the workload ---


def trace_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k != "name" and v is not None}


def run_trace(cfg: DictConfig, rate: float | None = None) -> pd.DataFrame:
    """The run's trace, rescaled to ``rate`` req/s where given. A trace that cannot
    be loaded or holds no request is an :class:`InputError`."""
    options = trace_options(OmegaConf.to_container(cfg.trace, resolve=True))
    if rate is not None:
        options["rate"] = rate
    name = cfg.trace.name
    try:
        trace = load_trace(name, **options)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(f"trace={name}: {e}") from e
    if trace.empty:
        raise InputError(f"trace={name}: no requests to run (the trace as loaded is empty)")
    return trace


def load_requests(
    cfg: DictConfig, spec: ModelSpec, rate: float | None = None, stream: bool = False
) -> tuple[pd.DataFrame, list[Request] | RequestStream]:
    """The run's trace (:func:`run_trace`) and its requests, with token ids for
    the real engine; ``stream``: made as a simulation reaches them."""
    trace = run_trace(cfg, rate)
    if stream:
        return trace, RequestStream(trace)
    requests = to_requests(
        trace,
        with_tokens=cfg.mode.name in ("real", "vllm"),
        vocab_size=spec.vocab_size,
        seed=cfg.seed,
    )
    return trace, requests


def max_concurrency(cfg: DictConfig) -> int | None:
    """The clients of the run's closed-loop trace (``trace=concurrency``,
    :mod:`traces.closed_loop`), which each mode sends as they free; None where
    the trace has arrival times."""
    return cfg.trace.get("max_concurrency")
