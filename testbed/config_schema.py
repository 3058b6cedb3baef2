"""The run config's schema: Hydra structured configs for the engine, mode, cluster,
hardware, model, policy and trace groups, and :func:`compose_config`, the one way to
compose a run's config outside ``run.py``.

Each group's options are typed dataclasses registered in Hydra's ConfigStore, so
a typo in an override (``engine.max_num_seq=8``) or a value of the wrong type
(``engine.block_size=big``) fails at start-up naming the key, and every field a
mode reads is declared here with its default. A bundled policy's options are its
class's constructor arguments, with the class's defaults: the group option is
derived from the class (``policy=sjf policy.aging_tokens_per_s=5``), so its
defaults live in one place.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from policies import REGISTRY, is_class_path, policy_class
from policies.deciders import DECIDERS
from policies.routers import ROUTERS
from testbed.core.kv_faults import FAULT_KINDS
from testbed.engine.spec_config import SpeculativeConfig
from testbed.errors import InputError
from testbed.hardware import HardwareSpec
from testbed.models import PROJECT_ROOT
from testbed.report.rundir import STEPS_FORMATS
from testbed.sim.link import LINK_PRESETS
from traces import TRACE_NAMES, loader_options, trace_loader

# --- engine and cluster ---


@dataclass
class SpeculativeOptions:
    """Speculative decoding (vLLM's ``speculative_config``; ``method: null`` is off).
    The first six fields are vLLM's (``testbed.engine.spec_config``); the rest are
    the simulator's: its acceptance model and the proposer's cost."""

    method: str | None = None  # ngram | draft_model
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: an HF folder or a conf/model name
    draft_num_layers: int | None = None  # draft_model: its first N layers only
    # mode=sim, one of the two (no default: only a real run measures acceptance): a
    # measured per-position table (a real run's spec_acceptance.csv), "auto" for the
    # one beside the profiles (profiles/<hardware>/<model>.spec.<method>.csv, a
    # draft model's .spec.draft_model.<draft>.csv); or one rate given by hand, each
    # draft token accepted with it (the ones before it accepted), every step drafting k.
    acceptance_rate: float | None = None
    acceptance_table: str | None = None
    # mode=sim: the proposer's time, per step it drafts in and per request it drafts
    # for (a real run measures both: metrics.json spec_propose_s_per_step, _per_request).
    propose_s_per_step: float = 0.0
    propose_s_per_request: float = 0.0
    # mode=sim, draft_model: the latency model of the draft's passes. auto: the
    # draft's profile beside the target's (profiles/<hardware>/<draft>.csv, a
    # draft cut to N layers named <model>.first<N>), else its roofline; or a
    # profile's path; null: no draft passes (propose_s_* alone).
    draft_profile: str | None = "auto"
    # Multiplies the draft's passes (a real run measures the draft's speed against its
    # profile: metrics.json spec_draft_speed_vs_profile).
    draft_latency_scale: float = 1.0


@dataclass
class EngineConfig:
    """One engine instance (names as in vLLM)."""

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap per step
    # Admit a request only when its whole prompt fits in free KV blocks (vLLM 0.34's
    # scheduler_reserve_full_isl); false: when its first chunk fits.
    reserve_full_isl: bool = True
    enable_prefix_caching: bool = True
    # None: derived, by one formula in both modes (testbed.models.num_kv_blocks): a
    # fixed kv_cache_bytes budget (this one, else the hardware's), else memory x
    # gpu_memory_utilization - weights - activation peak; the simulator takes the
    # memory and the peak from the hardware entry (memory_bytes,
    # activation_reserve_bytes), the real engine on CUDA the device's memory and the
    # peak measured after a warm-up pass at the largest step.
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: float | None = None  # a fixed KV budget; None: the hardware's or its memory
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    # The real engine's attention: auto (Triton on CUDA, else torch) | triton | torch.
    attention_backend: str = "auto"
    # GPUs a replica spans (vLLM's names): its layers' matrices split across
    # tensor_parallel_size ranks, its layers across pipeline_parallel_size stages.
    # The simulator prices both; the real engine runs one device per replica.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class ClusterConfig:
    """Replicas of the engine behind a router (policies/routers.py)."""

    num_replicas: int = 1
    # round_robin | random | least_outstanding | least_outstanding_tokens |
    # power_of_two | prefix_affinity | prefix_cache | least_kv_usage (policies/routers.py)
    router: str = "round_robin"
    router_args: dict[str, Any] = field(default_factory=dict)  # the router's options
    # Disaggregated prefill/decode (both modes): num_prefill prefill and num_decode
    # decode replicas instead of num_replicas colocated ones (0 and 0: colocated).
    # The router picks the prefill replica, the pairing (below) the decode one.
    num_prefill: int = 0
    num_decode: int = 0
    link: str = "nvlink"  # the KV link between them: nvlink | pcie | infiniband | cpu
    link_latency_s: float | None = None  # None: the preset's
    link_bandwidth_bytes_s: float | None = None  # None: the preset's
    # Which requests are disaggregated: always | never | uncached_prompt
    # (decider_args.threshold: uncached prompt tokens above which); policies/deciders.py.
    decider: str = "always"
    decider_args: dict[str, Any] = field(default_factory=dict)
    # The decode replica for a disaggregated request: any router (policies/routers.py).
    pairing: str = "least_kv_usage"
    pairing_args: dict[str, Any] = field(default_factory=dict)
    # The real engine's KV transport (torch.distributed): auto (gloo on a CPU, nccl
    # on GPUs) | gloo | nccl.
    kv_backend: str = "auto"
    # A KV receive not done within this many seconds has failed: the decode replica
    # computes the prompt itself and the prefill replica frees the blocks it kept.
    kv_transfer_timeout_s: float = 30.0
    # Injected faults (testbed/core/kv_faults.py): a fraction kv_fault_rate of the
    # transfers, chosen by request id and seed (the same in both modes), fails as
    # kv_fault: fail (the transfer errors) | hang (it never ends: the timeout).
    kv_fault: str = "fail"
    kv_fault_rate: float = 0.0


# --- modes ---


@dataclass
class SimMode:
    """Discrete-event simulation: steps last what the latency model predicts."""

    name: str = "sim"
    fast_forward: bool = True  # jump over plain decode steps (results identical to stepping)
    max_sim_time_s: float | None = None  # stop the simulated clock here (the run is partial)
    # Multiply every predicted step latency (a machine slower or faster than profiled).
    latency_scale: float = 1.0
    # A CSV of start_s,speed: each step starting then lasts speed x its prediction.
    speed_trace: str | None = None
    # Which model predicts step latencies: auto (the measured profile of the
    # hardware and model where one exists for a one-GPU replica, else the GPU
    # operator model where the hardware has measured operator times, else the
    # roofline) | profile | operators | roofline.
    latency_model: str = "auto"


@dataclass
class RealMode:
    """The real engine on the wall clock: requests are injected at their arrival times."""

    name: str = "real"
    device: str | None = None  # None: cuda when available, else cpu
    max_wall_s: float | None = None  # stop replaying after this many seconds (partial)
    # Sample the machine's speed while the engine waits for arrivals (one fixed decode
    # step, never beside a step): idle_probe.csv and idle_probe_s in metrics.json.
    idle_probe: bool = False


@dataclass
class VllmMode:
    """vLLM itself on the wall clock (its own environment, set up on first use), with
    the run's policy inside its scheduler; requests injected at their arrival times."""

    name: str = "vllm"
    max_wall_s: float | None = None  # stop replaying after this many seconds (partial)
    # Unfind a same-step victim's never-computed cached blocks, as the testbed's KV
    # manager does (vLLM 0.32/0.34 keep them findable); off: vLLM as it is.
    forget_uncomputed: bool = False
    # vLLM's OpenMP threads, one bound to each of the first usable cores
    # (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND); None: vLLM's choice (on a CPU,
    # a thread bound to each core of the first NUMA node).
    threads: int | None = None


@dataclass
class ProfileMode:
    """Measure the real engine's steps and write profiles/<hardware>/<model>.csv."""

    name: str = "profile"
    grid: str = "auto"  # auto (gpu on a GPU, else default) | default | gpu | quick
    repeats: int = 5
    warmup: int = 2
    device: str | None = None
    replay_requests: int = 80  # then every step of a short synthetic replay
    replay_sparse_requests: int = 12  # and a few at a low rate: small batches at every context
    max_grid_s: float | None = None  # start no grid point after this many seconds
    # Profile the model cut to its first N layers (a self-speculation draft's own
    # profile, <model>.first<N>.csv); None: the whole model.
    num_layers: int | None = None


# --- hardware and model ---


@dataclass
class HardwareConfig(HardwareSpec):
    """A hardware group entry: the device's spec (:class:`HardwareSpec`) and how
    the real engine runs on it."""

    name: str = MISSING
    peak_flops: float = MISSING
    mem_bandwidth: float = MISSING
    memory_bytes: float = MISSING
    kv_cache_bytes: float | None = None  # None: derived from memory_bytes
    # torch's intra-op threads (CPU); None: one per core that other processes leave
    # free, changing as they come and go (testbed/threads.py)
    threads: int | None = None
    cpus: list[int] | None = None  # cores the real engine is pinned to (Linux)
    # Cores for a reference probe beside real runs and profiles (testbed.profiling.reference_probe).
    reference_cpus: list[int] | None = None


@dataclass
class ModelEntry:
    """A model group entry: its HF config inline (dummy weights of that shape) or
    the folder of a checkpoint (``path``)."""

    name: str = MISSING
    dtype: str = "bfloat16"
    path: str | None = None
    hf_config: dict[str, Any] | None = None


# --- policies ---


def policy_node(name: str) -> type:
    """A bundled policy's group option: ``name`` and its constructor's arguments,
    typed and defaulted as the class declares them."""
    cls = policy_class(REGISTRY[name])
    hints = typing.get_type_hints(cls.__init__)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=name))]
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.default is inspect.Parameter.empty:
            raise TypeError(f"policy {name!r}: argument {param.name!r} needs a default")
        fields.append((param.name, hints.get(param.name, Any), field(default=param.default)))
    node = dataclasses.make_dataclass(f"{cls.__name__}Options", fields)
    node.__module__ = __name__
    return node


# The bundled policies' option classes, as attributes of this module so that a
# config holding one pickles (a run's config sent to another process).
POLICY_OPTIONS = {name: policy_node(name) for name in REGISTRY}
globals().update({node.__name__: node for node in POLICY_OPTIONS.values()})


# --- traces ---


@dataclass
class TraceOptions:
    """The options every trace takes (``traces.GENERIC_OPTIONS``: ``traces.load_trace``
    applies them after loading, in docs/traces.md's order), so that each works as
    ``trace.<option>=...`` on any trace; None leaves the trace as loaded."""

    name: str = MISSING
    window_start_s: float | None = None
    window_end_s: float | None = None
    num_requests: int | None = None
    sample: float | None = None  # a number of requests, or a fraction in (0, 1)
    rate: float | None = None  # req/s
    time_scale: float | None = None
    prompt_scale: float | None = None
    max_model_len: int | None = None
    num_tenants: int | None = None
    priority_classes: int | None = None
    seed: int = II("seed")  # the loader's where it takes one; also seeds sample and assignments
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None


_SCALARS = (int, float, str, bool)


def _option_type(hint: Any) -> Any:
    """A loader argument's type where OmegaConf can check it (a scalar, or a scalar
    or None), else Any (a dict of lengths, a list of tenants, a str or Path)."""
    if hint in _SCALARS:
        return hint
    args = typing.get_args(hint)
    if len(args) == 2 and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        if inner in _SCALARS:
            return inner | None
    return Any


def trace_kind(name: str) -> str:
    """The schema trace ``name`` shares with the traces of its loader: ``azure``,
    ``mooncake``, ``lengths``, ``servegen``, ``synthetic`` or ``csv``."""
    return trace_loader(name).__name__.removeprefix("load_").removesuffix("_trace")


def trace_node(name: str) -> type:
    """Trace ``name``'s group schema: :class:`TraceOptions` and its loader's own
    arguments (``traces.loader_options``), typed and defaulted as the loader
    declares them. An argument that is also a generic option keeps the generic
    field (None: the loader's default)."""
    loader = trace_loader(name)
    hints = typing.get_type_hints(loader)
    generic = {f.name for f in dataclasses.fields(TraceOptions)}
    fields: list[tuple[str, Any, Any]] = []
    for param in loader_options(name).values():
        if param.name in generic:
            continue
        default = MISSING if param.default is inspect.Parameter.empty else param.default
        fields.append((param.name, _option_type(hints.get(param.name)), field(default=default)))
    kind = trace_kind(name)
    node = dataclasses.make_dataclass(f"{kind.title()}TraceOptions", fields, bases=(TraceOptions,))
    node.__module__ = __name__
    return node


# Each loader's trace schema (conf/trace/<name>.yaml names it as base_<kind> in its
# defaults), as attributes of this module so that a config holding one pickles.
TRACE_OPTIONS = {trace_kind(name): trace_node(name) for name in TRACE_NAMES}
globals().update({node.__name__: node for node in TRACE_OPTIONS.values()})


# --- checks a type cannot express ---


def vllm_fields(speculative) -> dict[str, Any]:
    """``engine.speculative``'s fields that vLLM's ``speculative_config`` has."""
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    if isinstance(speculative, DictConfig):
        speculative = OmegaConf.to_container(speculative)
    return {k: v for k, v in speculative.items() if k in names}


# (group, field) -> (check, what is allowed); None passes where the field is optional.
def _positive(x) -> bool:
    return x is None or x > 0


def _at_least(n: float):
    return lambda x: x is None or x >= n


RANGES: dict[tuple[str, str], tuple[Any, str]] = {
    ("engine", "block_size"): (_at_least(1), "an integer >= 1"),
    ("engine", "max_num_batched_tokens"): (_at_least(1), "an integer >= 1"),
    ("engine", "max_num_seqs"): (_at_least(1), "an integer >= 1"),
    ("engine", "max_model_len"): (_at_least(1), "null or an integer >= 1"),
    ("engine", "long_prefill_token_threshold"): (_at_least(0), "an integer >= 0 (0: no cap)"),
    ("engine", "num_kv_blocks"): (_at_least(1), "null or an integer >= 1"),
    ("engine", "gpu_memory_utilization"): (lambda x: 0 < x <= 1, "in (0, 1]"),
    ("engine", "kv_cache_bytes"): (_positive, "null or > 0"),
    ("engine", "attention_backend"): (
        lambda x: x in ("auto", "triton", "cpu", "torch"),
        "auto, triton, cpu or torch",
    ),
    ("cluster", "num_replicas"): (_at_least(1), "an integer >= 1"),
    ("cluster", "router"): (
        lambda x: x in ROUTERS or is_class_path(x),
        f"one of {', '.join(sorted(ROUTERS))} or a module:Class path",
    ),
    ("cluster", "pairing"): (
        lambda x: x in ROUTERS or is_class_path(x),
        f"one of {', '.join(sorted(ROUTERS))} or a module:Class path",
    ),
    ("cluster", "num_prefill"): (_at_least(0), "an integer >= 0"),
    ("cluster", "num_decode"): (_at_least(0), "an integer >= 0"),
    ("cluster", "link"): (lambda x: x in LINK_PRESETS, f"one of {', '.join(sorted(LINK_PRESETS))}"),
    ("cluster", "link_latency_s"): (lambda x: x is None or x >= 0, "null or >= 0"),
    ("cluster", "link_bandwidth_bytes_s"): (_positive, "null or > 0"),
    ("cluster", "decider"): (
        lambda x: x in DECIDERS or is_class_path(x),
        f"one of {', '.join(sorted(DECIDERS))} or a module:Class path",
    ),
    ("cluster", "kv_transfer_timeout_s"): (_positive, "> 0"),
    ("cluster", "kv_backend"): (lambda x: x in ("auto", "gloo", "nccl"), "auto, gloo or nccl"),
    ("cluster", "kv_fault"): (lambda x: x in FAULT_KINDS, f"one of {', '.join(FAULT_KINDS)}"),
    ("cluster", "kv_fault_rate"): (lambda x: 0 <= x <= 1, "within [0, 1]"),
    ("mode", "latency_scale"): (_positive, "> 0"),
    ("mode", "max_sim_time_s"): (_positive, "null or > 0"),
    ("mode", "max_wall_s"): (_positive, "null or > 0"),
    ("mode", "repeats"): (_at_least(1), "an integer >= 1"),
    ("mode", "warmup"): (_at_least(0), "an integer >= 0"),
    ("mode", "threads"): (_at_least(1), "null or an integer >= 1"),
    ("hardware", "threads"): (_at_least(1), "null or an integer >= 1"),
    ("hardware", "kv_cache_bytes"): (_positive, "null or > 0"),
}
# Groups whose options are dataclasses: a key outside them (``+engine.x=1``, which
# Hydra lets through) is refused as a typo would be.
SCHEMA_GROUPS = ("engine", "cluster", "mode", "hardware", "model", "policy", "trace")


def validate(cfg: DictConfig) -> None:
    """Check what the types cannot: each field's range (:data:`RANGES`), keys added
    to a typed group with ``+``, and combinations no mode supports (``load`` is the
    capacity search's to check, ``testbed/capacity.py``). Raises an
    :class:`~testbed.errors.InputError` naming the key, its value and what is allowed."""
    for group in SCHEMA_GROUPS:
        node = cfg[group]
        declared = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(declared):
            known = {f.name for f in dataclasses.fields(declared)}
            if extra := sorted(set(node) - known):
                of = f"{group}={node.name}" if "name" in node else f"the {group} group"
                raise InputError(
                    f"{group}.{extra[0]}: no such option of {of} "
                    f"(its options: {', '.join(sorted(known - {'name'}))})"
                )
    for (group, key), (ok, allowed) in RANGES.items():
        if key in cfg[group] and not ok(cfg[group][key]):
            raise InputError(f"{group}.{key}={cfg[group][key]}: must be {allowed}")
    cluster = cfg.cluster
    if (cluster.num_prefill > 0) != (cluster.num_decode > 0):
        raise InputError(
            f"cluster.num_prefill={cluster.num_prefill}, cluster.num_decode="
            f"{cluster.num_decode}: disaggregation needs both >= 1 (or both 0: colocated)"
        )
    spec = cfg.engine.speculative
    for name in ("propose_s_per_step", "propose_s_per_request"):
        if spec[name] < 0:
            raise InputError(f"engine.speculative.{name}={spec[name]}: must be >= 0")
    if not spec.draft_latency_scale > 0:
        raise InputError(
            f"engine.speculative.draft_latency_scale={spec.draft_latency_scale}: must be > 0"
        )
    if spec.acceptance_rate is not None and not 0 <= spec.acceptance_rate <= 1:
        raise InputError(
            f"engine.speculative.acceptance_rate={spec.acceptance_rate}: must be in [0, 1]"
        )
    try:
        SpeculativeConfig.of(vllm_fields(spec))
    except ValueError as e:
        raise InputError(str(e).replace("speculative_config.", "engine.speculative.")) from e
    steps_format = cfg.get("outputs", {}).get("steps_format", "csv")
    if steps_format not in STEPS_FORMATS:
        raise InputError(
            f"outputs.steps_format={steps_format}: must be one of {', '.join(STEPS_FORMATS)}"
        )
    for group in ("trace", "policy"):
        if missing := sorted(OmegaConf.missing_keys(cfg[group])):
            raise InputError(f"{group}={cfg[group].name} needs {missing[0]}=<value>")


# --- registration and composition ---


def register() -> None:
    """Register the schema's group options and bases in Hydra's ConfigStore
    (idempotent); ``conf/`` names the bases in its options' defaults lists."""
    cs = ConfigStore.instance()
    cs.store(group="engine", name="default", node=EngineConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="mode", name="sim", node=SimMode)
    cs.store(group="mode", name="real", node=RealMode)
    cs.store(group="mode", name="vllm", node=VllmMode)
    cs.store(group="mode", name="profile", node=ProfileMode)
    cs.store(group="hardware", name="base_hardware", node=HardwareConfig)
    cs.store(group="model", name="base_model", node=ModelEntry)
    for name, node in POLICY_OPTIONS.items():
        cs.store(group="policy", name=name, node=node)
    for kind, node in TRACE_OPTIONS.items():
        cs.store(group="trace", name=f"base_{kind}", node=node)


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The run config ``python run.py <overrides>`` would get (without Hydra's
    ``hydra`` node): for tests, experiments and benchmarks."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))
