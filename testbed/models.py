"""Models as both modes see them: which model a config names (:func:`resolve_model`,
the one place a model is resolved), its shape (:class:`ModelSpec`, the one
parse of an HF ``config.json``'s shape fields) and the KV-cache size both modes
derive from it (:func:`num_kv_blocks`, from a fixed budget or :class:`GPUMemory`).

The simulator charges a step by the model's shape, and the real engine builds
the model from the same config (``testbed.engine.model_config.ModelConfig`` adds what
only its code needs); both size the KV cache with :func:`num_kv_blocks`, so
that the two modes can be given the same cache. Pure Python (no torch).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIGS = PROJECT_ROOT / "conf" / "model"


@dataclass(frozen=True)
class ResolvedModel:
    """A model as a config names it: its name, its HF config and where its
    weights are (``None``: seeded dummy weights of that shape)."""

    name: str
    hf_config: dict[str, Any]
    folder: Path | None
    source: str  # where the HF config came from, for error messages

    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.hf_config, name=self.name)

    def first_layers(self, n: int | None) -> ResolvedModel:
        """This model cut to its first ``n`` decoder layers (its weights' first ``n``
        layers, its own final norm and LM head), named ``<name>.first<n>``: a
        self-speculation draft, profiled and simulated like any model. ``None`` or
        every layer: the model itself."""
        total = int(self.hf_config["num_hidden_layers"])
        if n is None or n == total:
            return self
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= total:
            raise ValueError(f"{self.source}: num_layers={n!r} is not in 1..{total}")
        config = {**self.hf_config, "num_hidden_layers": n}
        return ResolvedModel(f"{self.name}.first{n}", config, self.folder, self.source)


def resolve_model(model: Mapping[str, Any] | str | Path) -> ResolvedModel:
    """The model of a model config group entry (``name`` with ``hf_config`` or
    ``path``), of a ``conf/model/`` name, or of an HF folder (``config.json`` and
    weights). A relative ``path`` is relative to the project.

    An entry's ``path`` wins over its ``hf_config``: ``model=llama3-8b
    model.path=<folder>`` loads that folder's config and weights, and the model is
    then named after the folder (its runs, profile and labels are that model's,
    not the shape's the entry described)."""
    if not isinstance(model, Mapping):
        path = Path(model)
        if path.is_dir() or (path.suffix == ".json" and path.exists()):
            folder = path if path.is_dir() else path.parent
            return ResolvedModel(folder.name, read_hf_config(folder), folder, str(folder))
        model = model_entry(str(model))
    name = model["name"]
    if model.get("path"):
        folder = Path(_env_interpolation(str(model["path"])))
        folder = folder if folder.is_absolute() else PROJECT_ROOT / folder
        if model.get("hf_config"):  # a path set over an entry that describes a shape
            name = folder.name
        return ResolvedModel(name, read_hf_config(folder), folder, str(folder / "config.json"))
    if model.get("hf_config"):
        return ResolvedModel(name, dict(model["hf_config"]), None, f"model={name}")
    raise ValueError(f"model {name!r} needs hf_config or path")


def model_entry(name: str) -> dict[str, Any]:
    """``conf/model/<name>.yaml`` read without Hydra (the engine's offline API)."""
    conf = MODEL_CONFIGS / f"{name}.yaml"
    if not conf.exists():
        known = ", ".join(sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml")))
        raise FileNotFoundError(
            f"model {name!r} is neither an HF folder nor a config in {MODEL_CONFIGS} "
            f"(known: {known})"
        )
    return yaml.safe_load(conf.read_text())


def same_folder(a: Path | None, b: Path | None) -> bool:
    """Whether two weights folders are one (None: dummy weights, never the same)."""
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def read_hf_config(folder: Path) -> dict[str, Any]:
    """An HF model folder's ``config.json`` (or that file itself)."""
    file = folder / "config.json" if folder.is_dir() else folder
    if not file.exists():
        raise FileNotFoundError(f"no config.json at {file} (expected an HF model folder)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: malformed JSON ({e})") from e


def _env_interpolation(text: str) -> str:
    """Resolve ``${oc.env:VAR,default}`` as Hydra would (the engine runs without it)."""
    return re.sub(
        r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*),([^}]*)\}",
        lambda m: os.environ.get(m.group(1), m.group(2)),
        text,
    )


def models_dir() -> Path:
    """Where shared model folders live: ``$TESTBED_MODELS_DIR`` or ``../shared/models``."""
    default = PROJECT_ROOT.parent / "shared" / "models"
    return Path(os.environ.get("TESTBED_MODELS_DIR", str(default)))


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


@dataclass(frozen=True, slots=True)
class GPUMemory:
    """What sizes a GPU's KV cache, the same four inputs in both modes. The
    simulator takes the memory from the hardware's spec sheet, the weights from
    the model's shape and the activation peak from the hardware entry
    (``activation_reserve_bytes``); the real engine takes the device's memory and
    measures the other two (``testbed.engine.factory.measure_gpu_memory``)."""

    memory_bytes: float
    memory_utilization: float  # the share of memory the engine may take (vLLM's)
    weight_bytes: float
    activation_peak_bytes: float  # the most a step's activations take at once

    @property
    def kv_cache_bytes(self) -> float:
        """What is left for the KV cache: memory x utilization - weights - activation peak."""
        return (
            self.memory_bytes * self.memory_utilization
            - self.weight_bytes
            - self.activation_peak_bytes
        )


def num_kv_blocks(
    spec: ModelSpec,
    dtype: str,
    block_size: int,
    kv_cache_bytes: float | None = None,
    memory: GPUMemory | None = None,
) -> int:
    """KV blocks that fit, in both modes: a fixed ``kv_cache_bytes`` budget when
    given (the CPU convention), else what ``memory`` leaves (the GPU convention,
    as vLLM's ``gpu_memory_utilization``)."""
    per_block = block_size * spec.kv_bytes_per_token(dtype)
    if kv_cache_bytes is None:
        if memory is None:
            raise ValueError("num_kv_blocks needs kv_cache_bytes or the GPU's memory")
        kv_cache_bytes = memory.kv_cache_bytes
    blocks = int(kv_cache_bytes // per_block)
    if blocks < 1:
        weights = spec.weight_bytes(dtype) if memory is None else memory.weight_bytes
        raise ValueError(
            f"no room for a KV cache: {kv_cache_bytes / 2**30:.2f} GiB left for {spec.name} "
            f"({weights / 2**30:.2f} GiB of {dtype} weights)"
        )
    return blocks
