"""The simulator's acceptance model for speculative decoding.

Per draft position k: ``proposal_rates[k]``, the probability that the proposer
drafts a token at k (given room for it and a token at k - 1: an n-gram lookup
often finds nothing, a draft model always drafts), and ``acceptance_rates[k]``,
the probability that the token at k is accepted given that all before it were
(a draft is accepted up to its first rejection). Either one rate for every
position (``engine.speculative.acceptance_rate``, every step drafting k tokens)
or a table a real run measured (its ``spec_acceptance.csv``; stored beside the
profiles as ``<hardware>/<model>.spec.<method>.csv``).

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


def acceptance_table_path(profiles_dir: str | Path, hardware: str, model: str, method: str) -> Path:
    return Path(profiles_dir) / hardware / f"{model}.spec.{method}.csv"


class AcceptanceModel:
    def __init__(
        self, proposal_rates: list[float], acceptance_rates: list[float], source: str
    ) -> None:
        if len(proposal_rates) != len(acceptance_rates):
            raise ValueError("one proposal rate and one acceptance rate per position")
        self.proposal_rates = list(proposal_rates)
        self.acceptance_rates = list(acceptance_rates)
        self.source = source

    @property
    def k(self) -> int:
        return len(self.proposal_rates)

    @classmethod
    def constant(cls, k: int, rate: float) -> AcceptanceModel:
        return cls([1.0] * k, [rate] * k, f"acceptance_rate={rate} at each of {k} positions")

    @classmethod
    def from_csv(cls, path: str | Path, k: int) -> AcceptanceModel:
        """A measured table's first ``k`` positions; positions it never saw get a
        proposal rate of 0 (the real run never drafted that far)."""
        path = Path(path)
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
                columns = set(rows[0]) if rows else set()
        except OSError as e:
            raise InputError(f"{path}: cannot read the acceptance table ({e.strerror})") from e
        if missing := [c for c in TABLE_COLUMNS if c not in columns]:
            raise InputError(
                f"{path}: the acceptance table needs the column(s) {', '.join(missing)}"
            )
        proposal, acceptance = [0.0] * k, [0.0] * k
        for i, row in enumerate(rows):
            line = i + 2  # the header is line 1
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
        return cls(proposal, acceptance, str(path))

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
