"""What every benchmark writes (a JSON file with where and when it was measured),
and the CPU attention route a benchmark names as ``cpu-torch``."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any
from unittest import mock

from experiments.manifest import cpu, git
from testbed.hardware import HardwareSpec, gpu_entry, spec_sheet


def write_results(out: str | Path, benchmark: str, rows: list[dict], **meta: Any) -> Path:
    """Write ``{"meta": ..., "rows": ...}`` to ``out`` and say so."""
    header = dict(
        benchmark=benchmark,
        date=time.strftime("%Y-%m-%d"),
        git_sha=git("rev-parse", "HEAD"),
        host=platform.node(),
        python=platform.python_version(),
        machine=platform.machine(),
        processor=cpu(),
        **meta,
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=header, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")
    return out


def kernel_route(backend: str):
    """Where ``backend`` is ``cpu-torch``, the CPU attention path with its C++ kernel
    turned off (the engine itself runs backend ``cpu``); any other, as it is."""
    if backend == "cpu-torch":
        return mock.patch.dict(os.environ, {"TESTBED_CPU_KERNEL": "torch"})
    return contextlib.nullcontext()


def gpu_sheet() -> tuple[str, HardwareSpec | None]:
    """This process's CUDA device by name, and its spec sheet where
    ``conf/hardware`` has an entry for it (the benchmarks' peaks)."""
    import torch

    name = torch.cuda.get_device_name()
    entry = gpu_entry(name)
    return name, spec_sheet(entry) if entry else None


def llama_shape(
    name: str,
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    max_len: int = 2048,
) -> dict[str, Any]:
    """A Llama of this shape with dummy weights, as ``LLM(model)`` takes it."""
    return {
        "name": name,
        "hf_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": max_len,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    }
