"""The simulator's acceptance model for speculative decoding.

Per draft position k: ``proposal_rates[k]``, the probability that the proposer
drafts a token at k (given room for it and a token at k - 1: an n-gram lookup
often finds nothing, a draft model always drafts), and ``acceptance_rates[k]``,
the probability that the token at k is accepted given that all before it were
(a draft is accepted up to its first rejection). Either one rate for every
position given by hand (``engine.speculative.acceptance_rate``, every step
drafting k tokens) or a table a real run measured (its ``spec_acceptance.csv``;
stored beside the profiles as ``<hardware>/<model>.spec.<method>.csv``, a draft
model's as ``<model>.spec.draft_model.<draft>.csv``, with ``#`` lines above the
header saying how it was measured). There is no default: how often drafts are
accepted depends on the model, the draft and the workload, which only a real
run measures.

Each request draws from its own generator, so its drafts and acceptances do not
depend on which requests share its batches (the same random numbers under every
policy).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from testbed.errors import InputError

TABLE_COLUMNS = ("position", "proposal_rate", "acceptance_rate")


def acceptance_table_path(
    profiles_dir: str | Path, hardware: str, model: str, method: str, draft: str | None = None
) -> Path:
    """Where ``engine.speculative.acceptance_table=auto`` looks: a draft model's
    table is named after the draft too (another draft accepts differently)."""
    key = f"{method}.{draft}" if draft else method
    return Path(profiles_dir) / hardware / f"{model}.spec.{key}.csv"


class AcceptanceModel:
    def __init__(
        self,
        proposal_rates: list[float],
        acceptance_rates: list[float],
        source: str,
        header: list[str] | None = None,
    ) -> None:
        if len(proposal_rates) != len(acceptance_rates):
            raise ValueError("one proposal rate and one acceptance rate per position")
        self.proposal_rates = list(proposal_rates)
        self.acceptance_rates = list(acceptance_rates)
        self.source = source
        self.header = header or []  # a table's ``#`` lines: how it was measured

    @property
    def k(self) -> int:
        return len(self.proposal_rates)

    @classmethod
    def constant(cls, k: int, rate: float) -> AcceptanceModel:
        return cls(
            [1.0] * k, [rate] * k, f"acceptance_rate={rate} at each of {k} positions (given)"
        )

    @classmethod
    def from_csv(cls, path: str | Path, k: int) -> AcceptanceModel:
        """A measured table's first ``k`` positions; positions it never saw get a
        proposal rate of 0 (the real run never drafted that far). ``#`` lines before
        its header are kept as :attr:`header`."""
        path = Path(path)
        try:
            with open(path, newline="") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise InputError(f"{path}: cannot read the acceptance table ({e.strerror})") from e
        head = 0
        while head < len(lines) and lines[head].startswith("#"):
            head += 1
        rows = list(csv.DictReader(lines[head:]))
        columns = set(rows[0]) if rows else set()
        if missing := [c for c in TABLE_COLUMNS if c not in columns]:
            raise InputError(
                f"{path}: the acceptance table needs the column(s) {', '.join(missing)}"
            )
        proposal, acceptance = [0.0] * k, [0.0] * k
        for i, row in enumerate(rows):
            line = head + i + 2  # after the # lines and the header
            values = {}
            for name in TABLE_COLUMNS:
                try:
                    values[name] = float(row[name])
                except (TypeError, ValueError):
                    raise InputError(
                        f"{path}, line {line}: {name}={row[name]!r} is not a number"
                    ) from None
            if values["position"] != i:
                raise InputError(f"{path}, line {line}: position={row['position']}, expected {i}")
            for name in ("proposal_rate", "acceptance_rate"):
                if not 0 <= values[name] <= 1:
                    raise InputError(f"{path}, line {line}: {name}={row[name]} is not in [0, 1]")
            if i < k:
                proposal[i], acceptance[i] = values["proposal_rate"], values["acceptance_rate"]
        header = [line.lstrip("#").strip() for line in lines[:head]]
        return cls(proposal, acceptance, str(path), header)

    def num_drafts(self, rng: random.Random, room: int) -> int:
        """How many tokens the proposer drafts, with room for ``room``."""
        n = 0
        for rate in self.proposal_rates[: max(0, room)]:
            if rng.random() >= rate:
                break
            n += 1
        return n

    def num_accepted(self, rng: random.Random, num_drafts: int) -> int:
        """How many of ``num_drafts`` draft tokens verification accepts."""
        n = 0
        for rate in self.acceptance_rates[:num_drafts]:
            if rng.random() >= rate:
                break
            n += 1
        return n
