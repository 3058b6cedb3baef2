"""The GPU step-latency model built from measured operator times: a replica of
``tensor_parallel_size x pipeline_parallel_size`` GPUs running one step.

A step's time is the sum, over its decoder layers, of the layer's operators on
one tensor-parallel rank (linear layers from measured operator tables or the
curve fitted to them, :mod:`testbed.sim.operators`; attention from published
kernel measurements, :mod:`testbed.sim.attention_kernel`; two all-reduces per
layer, as vLLM's custom all-reduce below 8 MiB on NVLink, else from measured
NCCL times, :mod:`testbed.sim.collectives`), plus the
embedding, the LM head and its logits gather, the hand-over between pipeline
stages, and the engine's CPU overheads per step and per request (the hardware
entry's ``step_overhead_s`` and ``request_overhead_s``).

Pipeline parallelism runs one batch at a time: a step passes through every
stage in turn, so each stage idles while the others work (the bubble). vLLM
keeps several batches in flight instead, so pipelined throughput is
under-predicted by up to the number of stages.

MoE layers: a token activates ``k`` of ``E`` experts; with uniformly routed
tokens a step of ``T`` tokens touches ``E (1 - (1 - k/E)^T)`` distinct experts
on average and reads each one's weights once. The experts take the longer of
their computation (a GEMM of ``T k`` rows, fitted curve) and vLLM's fused MoE
kernel reading the touched experts' weights (a fixed cost plus the bytes at a
share of the bandwidth, from published kernel benchmarks).
Experts are split across tensor-parallel ranks as vLLM's default does (each
rank holds a slice of every expert), not placed whole (expert parallelism).

GPUs without measured tables take a sibling's (:data:`BASE_GPU`), each
operator scaled by the ratio of the two spec sheets' rooflines for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from testbed.hardware import HardwareSpec, spec_sheet
from testbed.models import DTYPE_BYTES, GPUMemory, ModelSpec
from testbed.sim.attention_kernel import AttentionKernel
from testbed.sim.collectives import RING_LATENCY_S, Collectives, ring_share
from testbed.sim.operators import LayerShape, OperatorTimes, gpus

# A GPU priced with another's measured operator tables (the same die, or the
# nearest architecture measured), each operator scaled by the rooflines' ratio.
BASE_GPU = {
    "h200": "h100",
    "h100-pcie": "h100",
    "a100-40gb": "a100",
    "l40s": "a100",
    "rtx4090": "a100",
}
# Measured NCCL tables: (GPU, topology) by hardware entry (NVSwitch nodes).
COLLECTIVES = {"h100": ("h100", "dgx"), "h200": ("h100", "dgx"), "a100": ("a100", "dgx")}
# vLLM's own all-reduce over NVLink, inside CUDA graphs, for messages below 8 MiB
# (its custom kernel, or symmetric-memory all-reduce where that takes over): a
# fixed cost by ranks plus about 8 us per MiB, from published kernel benchmarks on
# H100 (SGLang PR #2904, vLLM PRs #24111 and #42324; docs/gpu_latency_sources.md).
# Vidur's NCCL tables, measured outside graphs, take the larger messages.
CUSTOM_ALL_REDUCE_S = {2: 6e-6, 4: 7e-6, 8: 9e-6}
CUSTOM_ALL_REDUCE_S_PER_BYTE = 8e-6 / 2**20
CUSTOM_ALL_REDUCE_MAX_BYTES = 8 * 2**20
# vLLM's fused MoE kernel (routing, both expert GEMMs, activation, sum) at decode
# batches: a fixed cost by GPU plus the touched experts' weights read at this share
# of the HBM bandwidth, from published benchmark_moe.py times (vLLM PR #24700 on
# H100, #19049 on A100; docs/gpu_latency_sources.md). Large batches are priced by
# their GEMMs' FLOPs instead, whichever is longer.
MOE_KERNEL_FIXED_S = {"h100": 25e-6, "a100": 55e-6}
MOE_BANDWIDTH_SHARE = 0.85
ATTENTION_SIDE_OPS = ("qkv", "o", "input_norm", "post_norm", "rope", "add")


def operator_gpu(hw_name: str) -> str | None:
    """The GPU whose measured operator tables price ``hw_name``, or None."""
    have = set(gpus())
    if hw_name in have:
        return hw_name
    base = BASE_GPU.get(hw_name)
    return base if base in have else None


@dataclass(frozen=True)
class Parallelism:
    """How one replica spans GPUs (vLLM's names)."""

    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name, value in (
            ("tensor_parallel_size", self.tensor),
            ("pipeline_parallel_size", self.pipeline),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine.{name} must be an integer >= 1, got {value!r}")

    @property
    def num_gpus(self) -> int:
        return self.tensor * self.pipeline

    def check(self, model: ModelSpec) -> None:
        """Refuse a split the model's shape does not allow (as vLLM does)."""
        tp, pp = self.tensor, self.pipeline
        if model.num_heads % tp:
            raise ValueError(
                f"engine.tensor_parallel_size={tp}: {model.name} has {model.num_heads} "
                "attention heads, not divisible by it"
            )
        kv = model.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"engine.tensor_parallel_size={tp}: {model.name}'s {kv} KV heads can be "
                "neither split nor replicated evenly across that many ranks"
            )
        if pp > model.num_layers:
            raise ValueError(
                f"engine.pipeline_parallel_size={pp}: {model.name} has only "
                f"{model.num_layers} layers"
            )

    def kv_spec(self, model: ModelSpec) -> ModelSpec:
        """The model as its KV cache sees it across the replica: KV heads are
        replicated where there are more ranks than KV heads (vLLM's rule)."""
        return replace(model, num_kv_heads=max(model.num_kv_heads, self.tensor))


def replica_memory(
    model: ModelSpec, hw: HardwareSpec, dtype: str, utilization: float, parallel: Parallelism
) -> GPUMemory:
    """What a replica's GPUs hold together: every GPU's memory, the model's weights
    once (split across ranks and stages), an activation peak per GPU."""
    g = parallel.num_gpus
    return GPUMemory(
        hw.memory_bytes * g, utilization, model.weight_bytes(dtype), hw.activation_reserve_bytes * g
    )


class Collective:
    """All-reduce and point-to-point times of a replica's GPUs: measured NCCL
    tables where the hardware has them, else a ring over the spec sheet's link."""

    def __init__(self, hw: HardwareSpec) -> None:
        self.hw = hw
        entry = COLLECTIVES.get(hw.name)
        self.measured = Collectives.load(*entry) if entry else None
        self.custom = hw.interconnect == "nvlink"
        if self.measured is not None:
            self.source = self.measured.source
        elif hw.interconnect_bandwidth > 0:
            self.source = (
                f"analytic ring over {hw.interconnect} at {hw.interconnect_bandwidth / 1e9:g} GB/s "
                f"({hw.name} spec sheet) + {RING_LATENCY_S * 1e6:g} us"
            )
        else:
            self.source = f"none: {hw.name} has no interconnect"
        if self.custom:
            self.source += (
                "; all-reduces below 8 MiB as vLLM's custom all-reduce over NVLink "
                "(published H100 kernel benchmarks)"
            )

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        if n == 1:
            return 0.0
        if self.custom and n in CUSTOM_ALL_REDUCE_S and nbytes < CUSTOM_ALL_REDUCE_MAX_BYTES:
            return CUSTOM_ALL_REDUCE_S[n] + nbytes * CUSTOM_ALL_REDUCE_S_PER_BYTE
        if self.measured is not None:
            return self.measured.all_reduce_s(nbytes, n)
        return RING_LATENCY_S + ring_share(n) * nbytes / self._bandwidth(n)

    def send_recv_s(self, nbytes: float) -> float:
        if self.measured is not None:
            return self.measured.send_recv_s(nbytes)
        return RING_LATENCY_S + nbytes / self._bandwidth(2)

    def _bandwidth(self, n: int) -> float:
        if self.hw.interconnect_bandwidth <= 0:
            raise ValueError(
                f"hardware {self.hw.name}: a replica of {n} GPUs needs an interconnect "
                "(interconnect_bandwidth is 0)"
            )
        return self.hw.interconnect_bandwidth


class GPUStepModel:
    """Step latency of a replica on GPUs from measured operator times (see the module)."""

    kind = "operators"

    def __init__(
        self,
        model: ModelSpec,
        hw: HardwareSpec,
        dtype: str,
        parallel: Parallelism | None = None,
        *,
        ops: OperatorTimes | None = None,
        attention: AttentionKernel | None = None,
        collective: Collective | None = None,
    ) -> None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        self.model, self.hw, self.dtype = model, hw, dtype
        self.parallel = parallel = parallel or Parallelism()
        parallel.check(model)
        self.bytes = DTYPE_BYTES[dtype]
        gpu = operator_gpu(hw.name) if ops is None else hw.name
        if gpu is None:
            raise ValueError(
                f"hardware {hw.name}: no measured operator times (have: {sorted(gpus())}; "
                f"siblings: {sorted(BASE_GPU)})"
            )
        if ops is None:
            ops = OperatorTimes.load(gpu)
        self.ops = ops
        self.base = hw if gpu == hw.name else spec_sheet(gpu)
        tp = parallel.tensor
        self.tp = tp
        dense_width = model.intermediate_size or model.moe_intermediate_size
        self.layer = self.ops.layer(
            LayerShape(
                model.hidden_size,
                dense_width,
                model.num_heads,
                model.num_kv_heads,
                model.head_dim,
            ),
            tp,
        )
        if attention is None:
            attention = AttentionKernel(hw.name)
        self.attention = attention
        self.collective = collective or Collective(hw)
        self.heads = model.num_heads // tp
        self.kv_heads = max(1, model.num_kv_heads // tp)
        self._fixed: dict[tuple[int, int], float] = {}
        self._by_tokens: dict[int, float] = {}
        self._by_reqs: dict[int, float] = {}
        self.sources = self._sources(gpu)
        self.source = f"GPU operator model of {hw.name}, TP{tp} PP{parallel.pipeline}: " + (
            "; ".join(f"{k}: {v}" for k, v in self.sources.items())
        )

    def _sources(self, gpu: str) -> dict[str, str]:
        m, hw = self.model, self.hw
        fitted = f"fitted curve over {gpu}'s measured GEMMs"
        linear = self.layer.source if not m.is_moe else f"{self.layer.source} (attention side)"
        out = {"linear": linear, "lm_head": fitted, "attention": self.attention.source}
        if m.is_moe:
            out["moe"] = (
                "vLLM fused MoE kernel: published benchmark_moe fixed cost + touched experts at "
                f"{MOE_BANDWIDTH_SHARE:.0%} of bandwidth, or {fitted}; expected distinct "
                "experts under uniform routing"
            )
        if self.parallel.num_gpus > 1:
            out["collectives"] = self.collective.source
        if self.parallel.pipeline > 1:
            out["pipeline"] = "one batch in flight: stages in turn, point-to-point hand-over"
        if gpu != hw.name:
            out["transfer"] = f"{gpu}'s operators scaled by the {hw.name}/{gpu} roofline ratio"
        out["overheads"] = f"{hw.name} entry: step_overhead_s, request_overhead_s ({hw.source})"
        return out

    # --- the roofline ratio that carries a sibling's times over ---

    def _ratio(self, flops: float, nbytes: float) -> float:
        if self.base is self.hw:
            return 1.0
        here = max(flops / self.hw.peak_flops, nbytes / self.hw.mem_bandwidth)
        there = max(flops / self.base.peak_flops, nbytes / self.base.mem_bandwidth)
        return here / there

    def _gemm_s(self, m: float, k: float, n: float) -> float:
        if m <= 0:
            return 0.0
        b = self.bytes
        t = self.ops.gemm_s(int(np.ceil(m)), int(k), int(n), b)
        return t * self._ratio(2 * m * k * n, (k * n + m * k + m * n) * b)

    def _elementwise_s(self, rows: float, width: int, kind: str) -> float:
        if rows <= 0:
            return 0.0
        t = self.ops.elementwise_s(int(np.ceil(rows)), int(width), kind)
        return t * self._ratio(0.0, 2 * rows * width * self.bytes)

    @cached_property
    def _op_shapes(self) -> dict[str, tuple[int, int]]:
        """(k, n) of each linear op on one rank, for the roofline ratio."""
        m, tp = self.model, self.tp
        h, d = m.hidden_size, m.head_dim
        width = m.intermediate_size or m.moe_intermediate_size
        return {
            "qkv": (h, (m.num_heads + 2 * m.num_kv_heads) * d // tp),
            "o": (m.num_heads * d // tp, h),
            "mlp_up": (h, 2 * width // tp),
            "mlp_down": (width // tp, h),
        }

    def _layer_ops(self, tokens: int) -> dict[str, float]:
        """One layer's measured (or fitted) operators on one rank, carried to this GPU."""
        times = self.layer.seconds(tokens)
        if self.base is self.hw:
            return times
        h = self.model.hidden_size
        out = {}
        for op, t in times.items():
            if op in self._op_shapes:
                k, n = self._op_shapes[op]
                ratio = self._ratio(2 * tokens * k * n, (k * n + tokens * (k + n)) * self.bytes)
            else:
                ratio = self._ratio(0.0, 2 * tokens * h * self.bytes)
            out[op] = t * ratio
        return out

    # --- a step ---

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a step's tokens activate (uniform routing)."""
        e, k = self.model.num_experts, self.model.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def _moe_mlp_s(self, tokens: int) -> float:
        """One MoE layer's MLP on one rank: the router's GEMM, the fused experts
        kernel (reading the touched experts, or computing ``tokens x top-k`` rows,
        whichever is longer) and the shared experts."""
        m, tp = self.model, self.tp
        h, k = m.hidden_size, m.num_experts_per_tok
        width = m.moe_intermediate_size // tp
        rows = tokens * k
        compute = self._gemm_s(rows, h, 2 * width) + self._gemm_s(rows, width, h)
        compute += self._elementwise_s(rows, width, "act")
        touched = self.experts_touched(tokens) * 3 * h * width * self.bytes
        read = self._moe_fixed_s + touched / (MOE_BANDWIDTH_SHARE * self.hw.mem_bandwidth)
        shared = m.shared_expert_intermediate_size // tp
        shared_s = 0.0
        if shared:
            shared_s = self._gemm_s(tokens, h, 2 * shared) + self._gemm_s(tokens, shared, h)
            shared_s += self._elementwise_s(tokens, shared, "act")
        return self._gemm_s(tokens, h, m.num_experts) + max(compute, read) + shared_s

    @cached_property
    def _moe_fixed_s(self) -> float:
        return MOE_KERNEL_FIXED_S[
            self.base.name if self.base.name in MOE_KERNEL_FIXED_S else "h100"
        ]

    def fixed_s(self, num_reqs: int, num_tokens: int) -> float:
        """Everything of a step but attention: it depends on its requests and tokens only."""
        key = (num_reqs, num_tokens)
        hit = self._fixed.get(key)
        if hit is None:
            by_tokens = self._by_tokens.get(num_tokens)
            if by_tokens is None:
                by_tokens = self._by_tokens[num_tokens] = sum(self.token_parts(num_tokens).values())
            by_reqs = self._by_reqs.get(num_reqs)
            if by_reqs is None:
                by_reqs = self._by_reqs[num_reqs] = sum(self.request_parts(num_reqs).values())
            hit = self._fixed[key] = by_tokens + by_reqs
        return hit

    def fixed_parts(self, num_reqs: int, num_tokens: int) -> dict[str, float]:
        """Seconds of each part of a step but attention: ``cpu`` (the engine's
        overheads) and ``lm_head`` (with its gather), by its requests
        (:meth:`request_parts`); ``embedding``, ``layers`` (linear and elementwise
        operators, MoE experts), ``all_reduce`` (two per layer) and ``pipeline``
        (the hand-overs between stages), by its tokens (:meth:`token_parts`)."""
        return self.request_parts(num_reqs) | self.token_parts(num_tokens)

    def request_parts(self, num_reqs: int) -> dict[str, float]:
        """The parts of a step that its number of requests sets."""
        m, hw, tp = self.model, self.hw, self.tp
        logits = max(num_reqs, 1)
        head = self._gemm_s(logits, m.hidden_size, m.vocab_size // tp)
        if tp > 1:  # the ranks' logits slices gathered for sampling
            head += self.collective.all_reduce_s(logits * m.vocab_size // tp * self.bytes, tp)
        return {"cpu": hw.step_overhead_s + hw.request_overhead_s * num_reqs, "lm_head": head}

    def token_parts(self, num_tokens: int) -> dict[str, float]:
        """The parts of a step that its number of tokens sets."""
        m, tp, pp = self.model, self.tp, self.parallel.pipeline
        t = max(num_tokens, 1)
        ops = self._layer_ops(t)
        if m.is_moe:
            side = sum(ops[op] for op in ATTENTION_SIDE_OPS)
            layers = (m.num_layers - m.num_moe_layers) * sum(ops.values())
            layers += m.num_moe_layers * (side + self._moe_mlp_s(t))
        else:
            layers = m.num_layers * sum(ops.values())
        hidden_bytes = t * m.hidden_size * self.bytes
        reduce = 0.0
        if tp > 1:  # after attention and after the MLP, every layer
            reduce = 2 * m.num_layers * self.collective.all_reduce_s(hidden_bytes, tp)
        return {
            "embedding": self.layer.emb_s(t) * self._ratio(0.0, 2 * hidden_bytes),
            "layers": layers,
            "all_reduce": reduce,
            "pipeline": (pp - 1) * self.collective.send_recv_s(2 * hidden_bytes) if pp > 1 else 0.0,
        }

    def breakdown(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> dict[str, float]:
        """Seconds of each part of one step (:meth:`fixed_parts` and ``attention``)."""
        parts = self.fixed_parts(num_reqs, num_tokens)
        parts["attention"] = self._attention(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return parts

    def _attention(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        """Every layer's attention (a number, or an array where the inputs are)."""
        arrays = any(isinstance(x, np.ndarray) and x.ndim for x in (attn_pairs, kv_tokens, max_kv))
        layer = self._shaped.many if arrays else self._shaped.one
        return self.model.num_layers * layer(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)

    @cached_property
    def _shaped(self):
        """The attention kernel bound to this model's shape on one rank."""
        return self.attention.shaped(
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.model.head_dim,
            dtype_bytes=self.bytes,
            peak_flops=self.hw.peak_flops,
            mem_bandwidth=self.hw.mem_bandwidth,
        )

    def predict(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        fixed = self._fixed.get((num_reqs, num_tokens))
        if fixed is None:
            fixed = self.fixed_s(num_reqs, num_tokens)
        layer = self._shaped.one(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return float(fixed + self.model.num_layers * layer)

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        fixed = self.fixed_s(num_reqs, num_tokens)
        layer = self._shaped.many(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return fixed + self.model.num_layers * layer

    def verification_s(self, num_spec_reqs):
        """Nothing: verified drafts are tokens like any others to this model."""
        return 0.0 * num_spec_reqs
