"""Speculative decoding's counts, as vLLM names them: each verification of a
request's drafts (a "draft"), its draft tokens and how many were accepted, in
total and per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per draft position k (0 first): drafts that had a token there, and that
    # had it accepted (a draft's tokens are accepted up to its first rejection).
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of its ``num_draft_tokens`` accepted."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for k in range(num_draft_tokens):
            self.drafted_per_pos[k] += 1
        for k in range(num_accepted):
            self.accepted_per_pos[k] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        for k, (d, a) in enumerate(zip(other.drafted_per_pos, other.accepted_per_pos, strict=True)):
            if k == len(self.drafted_per_pos):
                self.drafted_per_pos.append(0)
                self.accepted_per_pos.append(0)
            self.drafted_per_pos[k] += d
            self.accepted_per_pos[k] += a
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted over draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def conditional_rates(self) -> list[float]:
        """Per position k: P(draft token k accepted | tokens before it accepted)
        (the acceptance model's table)."""
        out = []
        for k, drafted in enumerate(self.drafted_per_pos):
            reached = drafted if k == 0 else min(drafted, self.accepted_per_pos[k - 1])
            out.append(self.accepted_per_pos[k] / reached if reached else 0.0)
        return out

    def metrics(self) -> dict[str, float | int | list[float]]:
        """The ``spec_*`` fields of ``metrics.json``."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_acceptance_rate_per_pos": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
            ],
        }
