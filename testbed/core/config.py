"""Limits of one engine instance."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
