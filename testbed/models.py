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


# The field by which each family's HF config counts its routed experts.
MOE_EXPERTS_FIELDS = (
    "num_local_experts",  # Mixtral (each expert intermediate_size wide)
    "num_experts",  # Qwen2-MoE, Qwen3-MoE (each moe_intermediate_size wide)
    "n_routed_experts",  # DeepSeek-MoE (each moe_intermediate_size wide)
)


def moe_experts_field(config: Mapping[str, Any]) -> str | None:
    """The field of an HF config that gives it routed experts (None: a dense model)."""
    return next((key for key in MOE_EXPERTS_FIELDS if config.get(key)), None)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer of the Llama family, dense or
    mixture-of-experts (MoE: each MLP is ``num_experts`` SwiGLU experts of which a
    router picks ``num_experts_per_tok`` per token, beside optional always-on
    shared experts).

    Counts leave out attention biases (Qwen2's q/k/v), Qwen3's per-head q/k norms,
    and the one-output gate of Qwen2-MoE's shared expert: each under 0.1% of a
    model's weights."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # a dense MLP's width
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one routed expert's FFN width
    shared_expert_intermediate_size: int = 0  # total width of always-on shared experts (0: none)
    # leading layers with a dense MLP intermediate_size wide (DeepSeek's first_k_dense_replace)
    first_dense_layers: int = 0

    def __post_init__(self) -> None:
        if not self.is_moe:
            moe = ("num_experts_per_tok", "moe_intermediate_size", "first_dense_layers")
            if stray := [f for f in moe if getattr(self, f)]:
                raise ValueError(f"model {self.name}: {stray[0]} is set but num_experts is 0")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model {self.name}: num_experts_per_tok={self.num_experts_per_tok} "
                f"is not in 1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"model {self.name}: an MoE model needs moe_intermediate_size >= 1")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(
                f"model {self.name}: first_dense_layers={self.first_dense_layers} "
                f"is not in 0..num_layers={self.num_layers}"
            )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """Read the fields every Llama / Mistral / Qwen2 / Qwen3 config has, and the
        experts of Mixtral, Qwen2-MoE / Qwen3-MoE and DeepSeek-MoE configs."""
        name = name or config.get("_name_or_path") or config.get("model_type", "model")
        if config.get("kv_lora_rank") is not None:
            raise ValueError(
                f"model config {name}: kv_lora_rank={config['kv_lora_rank']} means MLA "
                "attention (DeepSeek-V2/V3), which this testbed does not model: its KV "
                "size and attention cost differ from grouped-query attention's"
            )
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            return cls(
                name=name,
                num_layers=layers,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                **_moe_fields(config, name, layers),
            )
        except KeyError as e:
            raise ValueError(f"model config {name}: lacks field {e.args[0]!r}") from e

    # --- sizes ---
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is routed experts (the rest: a dense MLP)."""
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def attention_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, k, v

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down (SwiGLU)

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (a SwiGLU MLP ``moe_intermediate_size`` wide)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def dense_layer_params(self) -> int:
        """A layer with a dense MLP: attention, MLP and two RMSNorm weights."""
        return self.attention_params_per_layer + self.dense_mlp_params + 2 * self.hidden_size

    def moe_layer_params(self, experts: int) -> int:
        """An MoE layer's weights counting ``experts`` routed experts: attention,
        router, shared experts and two RMSNorm weights beside them."""
        mlp = experts * self.expert_params + self.router_params + self.shared_expert_params
        return self.attention_params_per_layer + mlp + 2 * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """One layer's weights; of an MoE model, an MoE layer's, every expert's
        (its leading dense layers are :attr:`dense_layer_params`)."""
        if not self.is_moe:
            return self.dense_layer_params
        return self.moe_layer_params(self.num_experts)

    @property
    def num_params(self) -> int:
        """Every weight: all layers (all experts), embedding, LM head, final norm."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self._layers_params(self.num_experts) + embed + head + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters one token multiplies through: every layer (of an MoE layer,
        its top-k experts, shared experts and router) and the LM head."""
        return self._layers_params(self.num_experts_per_tok) + self.vocab_size * self.hidden_size

    def _layers_params(self, experts: int) -> int:
        """All layers' weights, counting ``experts`` routed experts per MoE layer."""
        if not self.is_moe:
            return self.num_layers * self.params_per_layer
        moe = self.num_moe_layers * self.moe_layer_params(experts)
        return (self.num_layers - self.num_moe_layers) * self.dense_layer_params + moe

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def _moe_fields(config: Mapping[str, Any], name: str, num_layers: int) -> dict[str, int]:
    """ModelSpec's expert fields from an HF config, by the field its family counts
    experts with (:data:`MOE_EXPERTS_FIELDS`); empty for a dense model."""
    key = moe_experts_field(config)
    if key is None:
        return {}
    for field, every_layer in (("decoder_sparse_step", 1), ("moe_layer_freq", 1)):
        if config.get(field, every_layer) != every_layer:
            raise ValueError(
                f"model config {name}: {field}={config[field]!r} (experts in only some "
                f"layers) is not modelled; only {every_layer} (every layer)"
            )
    if config.get("mlp_only_layers"):
        raise ValueError(
            f"model config {name}: mlp_only_layers={config['mlp_only_layers']!r} (dense "
            "layers among the MoE ones) is not modelled; only []"
        )
    fields = {"num_experts": int(config[key])}
    fields["num_experts_per_tok"] = int(config["num_experts_per_tok"])
    if key == "num_local_experts":  # Mixtral: every expert as wide as a dense MLP
        fields["moe_intermediate_size"] = int(config["intermediate_size"])
        return fields
    # OLMoE-style configs without moe_intermediate_size give each expert intermediate_size
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    fields["moe_intermediate_size"] = width
    if key == "n_routed_experts":  # DeepSeek: n_shared_experts experts of the routed width
        shared = int(config.get("n_shared_experts") or 0)
        fields["shared_expert_intermediate_size"] = shared * width
        # a model cut to its first layers (ResolvedModel.first_layers) may be all dense
        first_dense = int(config.get("first_k_dense_replace") or 0)
        fields["first_dense_layers"] = min(first_dense, num_layers)
    else:
        shared = config.get("shared_expert_intermediate_size") or 0
        fields["shared_expert_intermediate_size"] = int(shared)
    return fields


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
