"""What builds one real engine instance (names as in vLLM). Pure Python: a
simulation builds these from its config without importing torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.errors import InputError

CPU_KV_CACHE_BYTES = 512 * 2**20  # a CPU engine's KV cache unless kv_cache_bytes says


@dataclass
class EngineArgs:
    """Everything that builds one real engine instance (names as in vLLM)."""

    model: str
    policy: Any = "fcfs"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    reserve_full_isl: bool = True
    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": 4, ...}
    # (testbed.engine.spec_config.SpeculativeConfig); None: no speculation.
    speculative_config: Any = None
    # vLLM's kv_transfer_config for disaggregated prefill/decode: {"kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", "kv_rank": this instance's index};
    # None: no KV connector.
    kv_transfer_config: Any = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None  # on CPU, 512 MiB unless set
    gpu_memory_utilization: float = 0.9
    device: str | None = None  # default: cuda when available
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # auto | triton | cpu | torch
    # torch's intra-op threads on CPU; default: one per core that other processes
    # leave free (testbed/threads.py), at most torch's default (one per core)
    threads: int | None = None
    cpus: Sequence[int] | None = None  # cores the process is pinned to (Linux); default: any
    seed: int = 0
    # GPUs a replica spans (vLLM's names); this engine runs each on one device.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # An InputError (a ValueError): run.py prints it alone where a config set it.
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise InputError(
                    f"{name}={getattr(self, name)}: this engine runs each replica on one "
                    "device; tensor and pipeline parallelism are simulated only (mode=sim)"
                )
