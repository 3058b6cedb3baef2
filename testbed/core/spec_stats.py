"""Speculative decoding's counts, as vLLM names them (each verification of a
request's drafts is a "draft"; its draft tokens, how many were accepted), in
total and per draft position, and what the acceptance model of the simulator
is measured from: per position, how often a proposer drafts there and how
often a draft token there is accepted."""

from __future__ import annotations

from dataclasses import dataclass, field


def _count(counts: list[int], n: int) -> None:
    """Add one to ``counts[0:n]``, growing it as needed."""
    if n > len(counts):
        counts.extend([0] * (n - len(counts)))
    for k in range(n):
        counts[k] += 1


def _at(counts: list[int], k: int) -> int:
    return counts[k] if k < len(counts) else 0


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per draft position k (0 first):
    drafted_per_pos: list[int] = field(default_factory=list)  # drafts with a token at k
    accepted_per_pos: list[int] = field(default_factory=list)  # ... accepted (so all before)
    verified_per_pos: list[int] = field(default_factory=list)  # ... reached: all before accepted
    offered_per_pos: list[int] = field(default_factory=list)  # proposals with room at k, k drafted
    proposed_per_pos: list[int] = field(default_factory=list)  # ... that drafted a token at k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of its ``num_draft_tokens`` accepted
        (a prefix: the first rejection ends it)."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        _count(self.drafted_per_pos, num_draft_tokens)
        _count(self.accepted_per_pos, num_accepted)
        _count(self.verified_per_pos, min(num_draft_tokens, num_accepted + 1))

    def observe_proposal(self, room: int, num_proposed: int) -> None:
        """After a sampled token: room for ``room`` drafts, ``num_proposed`` proposed."""
        _count(self.offered_per_pos, min(room, num_proposed + 1))
        _count(self.proposed_per_pos, num_proposed)

    def merge(self, other: SpecDecodingStats) -> None:
        for name in ("drafted", "accepted", "verified", "offered", "proposed"):
            mine, theirs = getattr(self, f"{name}_per_pos"), getattr(other, f"{name}_per_pos")
            mine.extend([0] * (len(theirs) - len(mine)))
            for k, n in enumerate(theirs):
                mine[k] += n
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    @classmethod
    def merged(cls, parts) -> SpecDecodingStats:
        """The counts of several engines (replicas) together."""
        total = cls()
        for part in parts:
            total.merge(part)
        return total

    @property
    def acceptance_rate(self) -> float:
        """Accepted over draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def table(self) -> list[dict[str, float | int]]:
        """The acceptance model's table, per draft position k: ``proposal_rate``,
        P(the proposer drafts a token at k | room for it and a token at k - 1), and
        ``acceptance_rate``, P(the token at k accepted | the ones before it
        accepted), with the counts behind both."""
        rows = []
        for k in range(max(len(self.offered_per_pos), len(self.drafted_per_pos))):
            offered, proposed = _at(self.offered_per_pos, k), _at(self.proposed_per_pos, k)
            verified, accepted = _at(self.verified_per_pos, k), _at(self.accepted_per_pos, k)
            rows.append(
                dict(
                    position=k,
                    offered=offered,
                    proposed=proposed,
                    proposal_rate=proposed / offered if offered else 0.0,
                    verified=verified,
                    accepted=accepted,
                    acceptance_rate=accepted / verified if verified else 0.0,
                )
            )
        return rows

    def metrics(self) -> dict[str, float | int | list[float]]:
        """The ``spec_*`` fields of ``metrics.json``."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            # vLLM's per-position rate: accepted at k over drafts with a token at k.
            "spec_acceptance_rate_per_pos": [
                _at(self.accepted_per_pos, k) / d if d else 0.0
                for k, d in enumerate(self.drafted_per_pos)
            ],
        }


@dataclass
class ProposerTime:
    """A proposer's time per step as ``per_step + per_request * n`` (``n``: the
    requests it drafts for), fitted by least squares to what a real run measured:
    a draft model's passes cost about the same for one request as for several (a
    fixed part per step), an n-gram lookup about the same per request."""

    steps: int = 0
    _sum_n: float = 0.0
    _sum_nn: float = 0.0
    _sum_t: float = 0.0
    _sum_nt: float = 0.0
    total_s: float = 0.0
    # Each observation's start (a ``time.perf_counter`` reading) and seconds, so that
    # a run's speed can leave the proposer out of each step it ran in.
    starts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)

    def observe(self, num_requests: int, seconds: float, start: float | None = None) -> None:
        self.total_s += seconds
        if start is not None:
            self.starts.append(start)
            self.durations.append(seconds)
        if num_requests <= 0:
            return
        self.steps += 1
        self._sum_n += num_requests
        self._sum_nn += num_requests * num_requests
        self._sum_t += seconds
        self._sum_nt += num_requests * seconds

    def fit(self) -> tuple[float, float]:
        """``(per_step, per_request)``, both >= 0."""
        m, sn, snn, st, snt = self.steps, self._sum_n, self._sum_nn, self._sum_t, self._sum_nt
        if m == 0:
            return 0.0, 0.0
        det = m * snn - sn * sn
        if det > 0:
            per_request = (m * snt - sn * st) / det
            per_step = (st - per_request * sn) / m
            if per_request >= 0 and per_step >= 0:
                return per_step, per_request
        # One part only: whichever of the two leaves the smaller squared error.
        b = snt / snn  # through the origin
        a = st / m  # a constant
        err_b = b * b * snn - 2 * b * snt
        err_a = a * a * m - 2 * a * st
        return (0.0, b) if err_b <= err_a else (a, 0.0)
