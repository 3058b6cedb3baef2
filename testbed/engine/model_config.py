"""The real engine's model configuration, read from an HF ``config.json``.

Covers the Llama family as transformers defines it: Llama 2/3, Mistral,
Qwen2/2.5 (biases on q, k and v) and Qwen3 (RMSNorm on each head of q and k),
with grouped-query attention, RoPE and its ``linear`` and ``llama3`` scalings,
RMSNorm, SwiGLU and tied or untied embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.models import ModelSpec, ResolvedModel, moe_experts_field, resolve_model

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config") -> ModelConfig:
        cfg = dict(cfg)
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if (experts := moe_experts_field(cfg)) is not None:  # before a default arch makes it dense
            raise InputError(
                f"{source}: {cfg.get('model_type') or arch} is a mixture-of-experts model "
                f"({experts}={cfg[experts]}); this engine runs dense models only: MoE models "
                "are simulated only (mode=sim)"
            )
        kind = SUPPORTED.get(arch)
        if kind is None:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED)}"
            )
        shape = ModelSpec.from_hf_config(cfg, name=source)  # the fields both modes read
        try:
            rope = dict(cfg.get("rope_parameters") or {})
            scaling = cfg.get("rope_scaling") or None
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = rope
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            if scaling is not None:
                scaling = dict(scaling)
                kind_of = scaling.get("rope_type", scaling.get("type", "default"))
                if kind_of not in ROPE_TYPES:
                    raise ValueError(
                        f"{source}: RoPE scaling {kind_of!r} is not supported; "
                        f"supported: {', '.join(ROPE_TYPES)}"
                    )
                scaling["rope_type"] = kind_of
                if kind_of == "default":
                    scaling = None
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
            return cls(
                model_type=kind,
                vocab_size=shape.vocab_size,
                hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_layers=shape.num_layers,
                num_heads=shape.num_heads,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=shape.max_position_embeddings,
                tie_word_embeddings=shape.tie_word_embeddings,
                # Qwen2 always has q/k/v biases; Llama-style configs say so themselves.
                qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=kind == "qwen3",
                eos_token_ids=tuple(int(e) for e in eos),
                bos_token_id=cfg.get("bos_token_id"),
                sliding_window=cfg.get("sliding_window")
                if cfg.get("use_sliding_window", kind == "mistral")
                else None,
                raw=cfg,
            )
        except KeyError as e:
            raise ValueError(f"{source}: config lacks field {e.args[0]!r}") from e

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """The config of an HF model folder (or of its ``config.json``)."""
        model = resolve_model(Path(path))
        return cls.from_hf(model.hf_config, source=model.source)

    @classmethod
    def of(cls, model: ResolvedModel) -> ModelConfig:
        return cls.from_hf(model.hf_config, source=model.source)

    @property
    def max_model_len(self) -> int:
        """Longest sequence the model handles exactly (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings
