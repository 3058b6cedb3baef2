"""Limits of one engine instance."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# The fields an engine's options do not set by name: the model's context and the
# speculative config's draft counts.
_DERIVED = ("max_model_len", "num_speculative_tokens", "num_lookahead_tokens")


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one engine instance (names as in vLLM)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap
    # Speculative decoding: the most draft tokens a request verifies per step, and
    # the KV slots reserved past its tokens for a draft model's own drafts.
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    # Admit a waiting request only when its whole prompt (less prefix hits) fits
    # in free blocks, not just its first chunk (vLLM's scheduler_reserve_full_isl).
    reserve_full_isl: bool = True

    @classmethod
    def of(
        cls, engine: Mapping[str, Any] | Any, max_model_len: int, speculative: Any = None
    ) -> SchedulerConfig:
        """The limits of an engine's options, the one conversion for both modes: the
        Hydra ``engine`` group (a mapping) or ``EngineArgs`` (attributes), which name
        these fields alike (vLLM's names), so that an option added to both reaches
        either mode's scheduler; with the model's ``max_model_len`` (the options'
        may be None) and ``speculative``'s draft counts (None: no speculation)."""
        named = {
            f.name: engine[f.name] if isinstance(engine, Mapping) else getattr(engine, f.name)
            for f in fields(cls)
            if f.name not in _DERIVED
        }
        return cls(
            **named,
            max_model_len=max_model_len,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            num_lookahead_tokens=speculative.num_lookahead_tokens if speculative else 0,
        )

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
