"""Speculative decoding's options, as vLLM's ``speculative_config`` names them.
Pure Python: a simulation reads them without importing torch.

``method``: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (a smaller model,
or the target's first ``draft_num_layers`` layers, drafting autoregressively);
``None`` (or no config) is no speculation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from testbed.engine.model_config import ModelConfig
from testbed.models import ResolvedModel, resolve_model

METHODS = ("ngram", "draft_model")
# Verification runs 1 + k positions per request and step; more drafts than this
# are almost never all accepted and only waste the target's compute.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = 4  # ngram: the longest
    model: str | None = None  # draft_model: an HF folder or a conf/model name
    draft_num_layers: int | None = None  # draft_model: keep only its first N layers

    def __post_init__(self) -> None:
        def refuse(field: str, why: str) -> None:
            raise ValueError(f"speculative_config.{field}: {why}")

        if self.method not in METHODS:
            refuse("method", f"{self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            refuse(
                "num_speculative_tokens", f"{k!r} is not an integer in 1..{MAX_SPECULATIVE_TOKENS}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and lo >= 1):
                refuse("prompt_lookup_min", f"{lo!r} is not an integer >= 1")
            if not (isinstance(hi, int) and hi >= lo):
                refuse("prompt_lookup_max", f"{hi!r} is not an integer >= prompt_lookup_min ({lo})")
        if self.method == "draft_model":
            if not self.model:
                refuse("model", "draft_model needs the draft's model (a folder or config name)")
            n = self.draft_num_layers
            if n is not None and not (isinstance(n, int) and n >= 1):
                refuse("draft_num_layers", f"{n!r} is not an integer >= 1")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a step needs past its verified tokens: the draft model writes
        its drafts' KV there (n-gram lookup writes none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """From a mapping of vLLM's field names (unknown ones refused by name);
        None, or a ``method`` of None, is no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if value.get("method") is None:
            return None
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: missing")
        return cls(**{k: v for k, v in value.items() if v is not None})


def resolve_draft(
    speculative: SpeculativeConfig, target: ModelConfig, max_model_len: int | None = None
) -> ResolvedModel:
    """The draft model of a ``draft_model`` config, found and checked against its
    target (``max_model_len``: the engine's, default the target's): it exists, has
    the target's vocabulary, a context that reaches ``max_model_len`` and the
    layers asked for. The real engine and the simulator both call this first, so
    a draft either refuses is refused by both, in the same words."""

    def refuse(field: str, why: str) -> None:
        raise ValueError(f"speculative_config.{field}: {why}")

    try:
        draft = resolve_model(speculative.model)
        cfg = ModelConfig.of(draft)
    except (ValueError, FileNotFoundError) as e:
        refuse("model", str(e))
    max_model_len = max_model_len or target.max_model_len
    if cfg.vocab_size != target.vocab_size:
        refuse(
            "model",
            f"{draft.name}'s vocabulary ({cfg.vocab_size}) is not the target's "
            f"({target.vocab_size})",
        )
    if cfg.max_model_len < max_model_len:
        refuse(
            "model",
            f"{draft.name}'s context ({cfg.max_model_len}) is shorter than the target's "
            f"max_model_len ({max_model_len}): it could not draft that far",
        )
    layers = speculative.draft_num_layers or cfg.num_layers
    if layers > cfg.num_layers:
        refuse("draft_num_layers", f"{layers}, but {draft.name} has {cfg.num_layers} layers")
    return draft
