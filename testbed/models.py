"""Model shapes (from an HF ``config.json``) and the KV-cache size both modes derive.

The simulator charges a step by the model's shape, and the real engine builds
the model from the same config; both size the KV cache with
:func:`num_kv_blocks`, so that the two modes can be given the same cache.
Pure Python (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer of the Llama family."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """Read the fields every Llama / Mistral / Qwen2 / Qwen3 config has."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                name=name or config.get("_name_or_path") or config.get("model_type", "model"),
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            )
        except KeyError as e:
            raise ValueError(f"model config {name or ''} lacks field {e.args[0]!r}") from e

    @classmethod
    def from_path(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_hf_config(json.loads(file.read_text()), name=path.name)

    # --- sizes ---
    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.params_per_layer + embed + head + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through (all layers and the LM head)."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def num_kv_blocks(
    spec: ModelSpec,
    dtype: str,
    block_size: int,
    memory_bytes: float,
    memory_utilization: float = 0.9,
    activation_reserve_bytes: float = 0.0,
    kv_cache_bytes: float | None = None,
) -> int:
    """KV blocks that fit: a fixed ``kv_cache_bytes`` budget when given (the CPU
    convention), else the device memory share left after weights and activations
    (the GPU convention, as vLLM's ``gpu_memory_utilization``)."""
    per_block = block_size * spec.kv_bytes_per_token(dtype)
    if kv_cache_bytes is None:
        kv_cache_bytes = (
            memory_bytes * memory_utilization - spec.weight_bytes(dtype) - activation_reserve_bytes
        )
    blocks = int(kv_cache_bytes // per_block)
    if blocks < 1:
        raise ValueError(
            f"no room for a KV cache: {kv_cache_bytes / 2**30:.2f} GiB left for {spec.name} "
            f"({spec.weight_bytes(dtype) / 2**30:.2f} GiB of {dtype} weights)"
        )
    return blocks
