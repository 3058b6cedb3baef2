"""The search itself: for every (configuration, SLO), the highest rate per GPU
at which the configuration meets the SLO, bracketed and bisected in rounds,
with what cannot win pruned between rounds (branch and bound).

What is known of a (configuration, SLO) is an interval: the highest rate seen
to meet it (``lo``) and the lowest seen to miss it (``hi``). Every simulation
of a configuration is judged against each of its SLOs, so one run narrows them
all. A round asks, for each live pair, the next rate its interval needs, and
launches the distinct rates of each configuration at once (``launch``: the
Hydra launcher, or anything that simulates a batch). The rules, in order:

1. converged: ``hi <= lo x (1 + rel_tol)``;
2. challenge (with bounds on): a configuration below the best rate per GPU
   proven so far for the SLO (``best``) is tried at that rate first: met, it
   ties the best and climbs from there; missed, it is pruned. A configuration's
   challenges go lowest rate first, a round each: a miss at the lowest prunes
   every SLO whose best is higher too;
3. bracket: no ``hi`` yet, double ``lo`` (or start at the configuration's
   estimated capacity), jumping to the lowest ``hi`` of the configurations
   that hold the best where that is nearer; no ``lo`` yet, halve ``hi`` twice,
   then try the ladder's foot (``max_steps`` halvings below the start) at once;
4. bisect: ``sqrt(lo x hi)`` while the bracket spans more than a factor 4,
   then ``(lo + hi) / 2``.

Pruning (with bounds on), all sound where meeting an SLO is monotone in the
rate (more load never lowers a percentile of TTFT or TPOT): a pair whose
``hi`` per GPU is at or below ``best`` cannot beat it (branch and bound); a
pair whose latency floor misses the SLO (``bounds.py``) is never simulated.
At first only ``probes`` configurations (the highest estimated capacity per
GPU) search an SLO; the rest wait until the probes have converged and are then
challenged at the best they found, so that most of the space costs one
simulation each. Where no probe met an SLO at any rate, the rest try the
ladder's foot first. Configurations that tie with the best (knobs that do not
bind) follow one of them: the rest wait for it to converge, then are
challenged at its rate and its miss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from testbed.search.slo import SLO
from testbed.search.space import Deployment

LIVE, WAITING = "live", "waiting"
CONVERGED = "converged"  # bracketed within the tolerance
PRUNED = "pruned"  # cannot beat the best (branch and bound)
FLOOR = "floor"  # its latency floor misses the SLO
UNMET = "unmet"  # missed at every rate tried, down to the ladder's foot
UNBOUNDED = "unbounded"  # met at every rate tried, up to the ladder's top
FAILED = "failed"  # a simulation of it failed
STOPPED = "stopped"  # the round limit came first
FINAL = (CONVERGED, PRUNED, FLOOR, UNMET, UNBOUNDED, FAILED, STOPPED)
EPS = 1e-6  # relative: rates this close are one rate


def canonical(rate: float) -> float:
    """A rate as a run's override writes it (9 significant digits)."""
    return float(f"{rate:.9g}")


@dataclass
class Interval:
    """What the search knows of one (configuration, SLO), rates in req/s of the
    whole deployment."""

    lo: float | None = None  # the highest rate seen to meet the SLO
    hi: float | None = None  # the lowest rate seen to miss it
    status: str = WAITING
    reason: str = ""
    rounds: int = 0  # rounds in which it asked for a simulation
    lo_run: int | None = None  # the run that met it at ``lo``
    notes: list[str] = field(default_factory=list)


@dataclass
class Run:
    """One simulation: a configuration at a rate, and what came of it."""

    index: int
    dep: int  # Deployment.num
    rate: float
    round: int
    metrics: dict[str, Any] | None
    error: str | None = None
    run_dir: str | None = None
    met: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What ``launch`` returns for one simulation: its metrics, or its error."""

    metrics: dict[str, Any] | None
    error: str | None = None
    run_dir: str | None = None


Launch = Callable[[list[tuple[Deployment, float]]], Sequence[Outcome]]


class SearchError(RuntimeError):
    """The search cannot go on (every simulation of its first round failed)."""


class Search:
    """The state of one search over ``deployments`` (those the checks kept) under
    ``slos``. ``starts``: each deployment's first rate (req/s; its estimated
    capacity). ``bound=False`` searches exhaustively: every pair on its own
    ladder to convergence, nothing pruned, no floors, no probes."""

    def __init__(
        self,
        deployments: Sequence[Deployment],
        slos: Sequence[SLO],
        starts: dict[int, float],
        *,
        rel_tol: float = 0.05,
        probes: int = 4,
        bound: bool = True,
        max_steps: int = 10,
        max_rounds: int = 60,
        floor_misses: dict[tuple[int, str], str] | None = None,
    ) -> None:
        if not deployments:
            raise ValueError("no configuration to search")
        if not 0 < rel_tol < 1:
            raise ValueError(f"rel_tol={rel_tol}: must be in (0, 1)")
        self.deps = {d.num: d for d in deployments}
        self.slos = list(slos)
        self.start_pg = {n: starts[n] / d.gpus for n, d in self.deps.items()}
        self.rel_tol, self.bound = rel_tol, bound
        self.max_steps, self.max_rounds = max_steps, max_rounds
        self.runs: list[Run] = []
        self.round = 0
        self.simulated: set[tuple[int, float]] = set()
        self.intervals: dict[tuple[int, str], Interval] = {
            (n, s.name): Interval() for n in self.deps for s in self.slos
        }
        self.probes = self.pick_probes(probes) if bound else list(self.deps)
        for n in self.probes:
            for s in self.slos:
                self.intervals[(n, s.name)].status = LIVE
        if bound:
            for key, reason in (floor_misses or {}).items():
                self.stop(key, FLOOR, reason)

    # --- reading the state ---

    def pick_probes(self, k: int) -> list[int]:
        """The ``k`` deployments of highest estimated capacity per GPU, one per
        shape and batch limit first (so that the probes differ)."""
        order = sorted(self.deps, key=lambda n: (-self.start_pg[n], n))
        picked, seen = [], set()
        for n in order:
            d = self.deps[n]
            if (d.shape, d.max_num_seqs) not in seen and len(picked) < k:
                picked.append(n)
                seen.add((d.shape, d.max_num_seqs))
        picked += [n for n in order if n not in picked][: max(0, k - len(picked))]
        return picked

    def per_gpu(self, n: int, rate: float | None) -> float | None:
        return None if rate is None else rate / self.deps[n].gpus

    def best(self, slo: str) -> tuple[float, int] | None:
        """The highest rate per GPU proven to meet ``slo``, and its deployment."""
        found = [(iv.lo / self.deps[n].gpus, -n) for (n, s), iv in self.intervals.items()
                 if s == slo and iv.lo is not None]  # fmt: skip
        if not found:
            return None
        rate, neg = max(found)
        return rate, -neg

    def frontier(self, slo: str, best: float) -> float | None:
        """The lowest rate per GPU at which a deployment holding ``best`` missed."""
        his = [
            iv.hi / self.deps[n].gpus
            for (n, s), iv in self.intervals.items()
            if s == slo and iv.lo is not None and iv.hi is not None
            and iv.lo / self.deps[n].gpus >= best * (1 - EPS)
        ]  # fmt: skip
        return min(his) if his else None

    def done(self) -> bool:
        return all(iv.status in FINAL for iv in self.intervals.values())

    # --- changing it ---

    def stop(self, key: tuple[int, str], status: str, reason: str) -> None:
        iv = self.intervals[key]
        if iv.status not in FINAL:
            iv.status, iv.reason = status, reason

    def probes_done(self, slo: str) -> bool:
        return all(self.intervals[(n, slo)].status in FINAL for n in self.probes)

    def activate(self) -> None:
        """Start the waiting pairs of each SLO whose probes have all stopped: they are
        then challenged at the best the probes converged on."""
        for s in self.slos:
            if not self.probes_done(s.name):
                continue
            for n in self.deps:
                iv = self.intervals[(n, s.name)]
                if iv.status == WAITING:
                    iv.status = LIVE

    def prune(self) -> None:
        """Stop every pair that cannot beat the best of its SLO (branch and bound)."""
        if not self.bound:
            return
        for s in self.slos:
            best = self.best(s.name)
            if best is None:
                continue
            rate, holder = best
            for n in self.deps:
                iv = self.intervals[(n, s.name)]
                hi = self.per_gpu(n, iv.hi)
                if (
                    iv.status in (LIVE, WAITING, CONVERGED)
                    and hi is not None
                    and hi <= rate * (1 + EPS)
                ):
                    # (a pair that converged before the best rose past it is beaten too)
                    iv.status = PRUNED
                    iv.reason = (
                        f"misses it at {hi:.4g} req/s per GPU, no more than the {rate:.4g} "
                        f"that {self.deps[holder].id} meets"
                    )

    def next_rate(self, n: int, slo: str) -> tuple[float, bool] | None:
        """The rate (req/s) the pair needs next and whether it is a challenge (at the
        best's rate), or None where it has stopped."""
        iv, g, start = self.intervals[(n, slo)], self.deps[n].gpus, self.start_pg[n]
        lo, hi = self.per_gpu(n, iv.lo), self.per_gpu(n, iv.hi)
        if lo is not None and hi is not None and hi <= lo * (1 + self.rel_tol):
            self.stop((n, slo), CONVERGED, f"bracketed within {self.rel_tol:.0%}")
            return None
        best = self.best(slo) if self.bound else None
        if best is not None and (lo is None or lo < best[0] * (1 - EPS)):
            return best[0] * g, True
        bottom = start / 2**self.max_steps  # the ladder's foot
        if hi is None:
            if lo is None:
                # where no probe met the SLO at any rate, try the foot first: one run
                # settles a configuration that cannot meet it either
                nobody = self.bound and best is None and n not in self.probes
                return (bottom if nobody else start) * g, False
            up = 2 * lo
            edge = self.frontier(slo, best[0]) if best is not None else None
            if edge is not None and lo * (1 + EPS) < edge < up:
                up = edge
            if up > start * 2**self.max_steps:
                self.stop((n, slo), UNBOUNDED, f"met at every rate tried, up to {lo:.4g} per GPU")
                return None
            return up * g, False
        if lo is None:
            if hi <= bottom * (1 + EPS):
                self.stop((n, slo), UNMET, f"missed at every rate tried, down to {hi:.4g} per GPU")
                return None
            # halve near the start; far below it, the foot at once (then bisect up)
            return (hi / 2 if hi > start / 4 else bottom) * g, False
        # geometric while the bracket is wide (after a jump to the foot), then halves
        mid = math.sqrt(lo * hi) if hi > 4 * lo else (lo + hi) / 2
        return mid * g, False

    def plan(self) -> list[tuple[Deployment, float]]:
        """The next round: each live deployment at the distinct rates its pairs need
        (empty once every pair has stopped)."""
        if self.round >= self.max_rounds:
            for key in self.intervals:
                self.stop(key, STOPPED, f"the round limit ({self.max_rounds}) came first")
            return []
        while True:  # until a round has simulations, or nothing changes (all stopped)
            before = [iv.status for iv in self.intervals.values()]
            self.activate()
            self.prune()
            wanted = self.wanted()
            if wanted or before == [iv.status for iv in self.intervals.values()]:
                break
        for (n, _), slos in wanted.items():
            for slo in slos:
                self.intervals[(n, slo)].rounds += 1
        return [(self.deps[n], rate) for n, rate in sorted(wanted)]

    def followers(self) -> set[tuple[int, str]]:
        """Pairs that tie with the best of their SLO and wait for one of the ties,
        the leader (the narrowest bracket, then the lowest number), to converge:
        they then try its rate and its miss, two runs each (all at once), instead
        of bisecting alongside it in every round."""
        waiting: set[tuple[int, str]] = set()
        if not self.bound:
            return waiting
        for s in self.slos:
            best = self.best(s.name)
            if best is None:
                continue
            edge = self.frontier(s.name, best[0])
            if edge is not None and edge <= best[0] * (1 + self.rel_tol):
                continue  # the best has converged: the ties try its miss at once
            ties = [
                n for n in self.deps
                if self.intervals[(n, s.name)].status == LIVE
                and self.intervals[(n, s.name)].lo is not None
                and self.intervals[(n, s.name)].lo / self.deps[n].gpus >= best[0] * (1 - EPS)
            ]  # fmt: skip
            if len(ties) > 1:
                hi = {n: self.per_gpu(n, self.intervals[(n, s.name)].hi) for n in ties}
                leader = min(ties, key=lambda n: (math.inf if hi[n] is None else hi[n], n))
                waiting |= {(n, s.name) for n in ties if n != leader}
        return waiting

    def wanted(self) -> dict[tuple[int, float], list[str]]:
        """(deployment, rate) -> the SLOs that need it next. A deployment's
        challenges wait for its lowest rate wanted: a miss there prunes every SLO
        whose best is at or above it, so one run may settle them all."""
        asked: dict[int, list[tuple[float, str, bool]]] = {}
        followers = self.followers()
        for (n, slo), iv in self.intervals.items():
            if iv.status != LIVE:
                continue
            found = self.next_rate(n, slo)
            if found is None or (n, slo) in followers:
                continue
            rate = canonical(found[0])
            if (n, rate) in self.simulated:  # the rules never ask twice; a guard
                self.stop((n, slo), STOPPED, f"asked again for {rate:g} req/s")
                continue
            asked.setdefault(n, []).append((rate, slo, found[1]))
        wanted: dict[tuple[int, float], list[str]] = {}
        for n, requests in asked.items():
            lowest = min(rate for rate, _, _ in requests)
            for rate, slo, challenge in requests:
                if not challenge or rate <= lowest:
                    wanted.setdefault((n, rate), []).append(slo)
        return wanted

    def record(self, dep: Deployment, rate: float, outcome: Outcome) -> Run:
        """Judge one simulation against every SLO of its deployment."""
        n = dep.num
        run = Run(len(self.runs), n, rate, self.round, outcome.metrics, outcome.error,
                  outcome.run_dir)  # fmt: skip
        self.runs.append(run)
        self.simulated.add((n, canonical(rate)))
        for s in self.slos:
            key = (n, s.name)
            if outcome.metrics is None:
                self.stop(key, FAILED, f"its run at {rate:g} req/s failed: {outcome.error}")
                continue
            met = run.met[s.name] = s.met_by(outcome.metrics)
            iv = self.intervals[key]
            if met and (iv.hi is None or rate < iv.hi * (1 - EPS)):
                if iv.lo is None or rate > iv.lo:
                    iv.lo, iv.lo_run = rate, run.index
            elif not met and (iv.lo is None or rate > iv.lo * (1 + EPS)):
                iv.hi = rate if iv.hi is None else min(iv.hi, rate)
            else:  # a short trace's bunching can make meeting it not monotone in the rate
                iv.notes.append(f"{'met' if met else 'missed'} at {rate:g} req/s, out of order")
        return run

    def run(self, launch: Launch) -> None:
        """Search until every pair has stopped, a round at a time through ``launch``."""
        while batch := self.plan():
            self.round += 1
            outcomes = list(launch(batch))
            if len(outcomes) != len(batch):
                raise SearchError(f"launched {len(batch)} simulations, {len(outcomes)} came back")
            for (dep, rate), outcome in zip(batch, outcomes, strict=True):
                self.record(dep, rate, outcome)
            if self.round == 1 and all(o.metrics is None for o in outcomes):
                raise SearchError(
                    f"every simulation of the first round failed; the first: {outcomes[0].error}"
                )
