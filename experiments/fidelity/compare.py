"""The simulation against the real runs: relative errors of a pair's metrics and
of the latency model on the real steps, the spread of repeated runs, and what
each says about the policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.metrics.fidelity import TARGETS, join_requests, metric_errors, relative_error
from testbed.profile_table import profile_machine

from .execute import read_metrics

THROUGHPUTS = ("throughput_req_s", "throughput_output_tok_s")
STATS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft_s", "tpot_s", "e2e_s")
NOISE = " (real vs real)"  # the policy column of a real run against its repeat


def pair_errors(sim_dir: Path, real_dir: Path) -> dict:
    """Relative errors of the simulation against the real run
    (:func:`~testbed.metrics.fidelity.relative_error`), the latencies of both,
    and the per-request correlation of E2E."""
    ms = read_metrics(sim_dir)
    mr = read_metrics(real_dir)
    row = {f"err_{k}": e for k, e in metric_errors(ms, mr, THROUGHPUTS).items()}
    for key in (f"{lat}_{s}" for lat in LATENCIES for s in STATS):
        row[f"sim_{key}"], row[f"real_{key}"] = ms[key], mr[key]
        row[f"err_{key}"] = relative_error(ms[key], mr[key])
    both = join_requests(
        pd.read_csv(sim_dir / "requests.csv"),
        pd.read_csv(real_dir / "requests.csv"),
        "e2e_s",
        f"{sim_dir} and {real_dir}",
    )
    row["e2e_corr"] = float(np.corrcoef(both["e2e_s_sim"], both["e2e_s_real"])[0, 1])
    row["joined_requests"] = len(both)
    return row


def prefixed_errors(sim_dir: Path, real_dir: Path, prefix: str) -> dict:
    """The relative errors of :func:`pair_errors`, named ``<prefix>_err_*``: for
    another simulation of a pair beside the prediction."""
    errors = pair_errors(sim_dir, real_dir)
    return {f"{prefix}_{k}": v for k, v in errors.items() if k.startswith("err_")}


def error_ratio(err: float, base: float) -> float:
    """One relative error against another, (1 + err) / (1 + base) - 1: what is
    left of ``err`` once the error both share (the machine's speed) is taken out."""
    return (1 + err) / (1 + base) - 1


def step_errors(steps: pd.DataFrame) -> dict:
    """The latency model against the real run's own steps: each measured step's
    composition predicted (sim / real - 1), free of any difference in schedule.
    ``total``: the summed busy time; ``median``: the typical step;
    ``per_request``: each step counted once per request in its batch, as the
    requests' latencies add it up (what mean TPOT and E2E average: a large batch
    weighs as much as the requests that wait on it); split into steps with a
    prefill chunk and plain decode steps. ``steps``: a run's
    :func:`~experiments.fidelity.speeds.busy_steps` (or several runs' together)."""
    pred = steps["pred_s"].to_numpy(float)
    real = steps["latency_s"].to_numpy(float)
    row = {
        "step_err_total": float(pred.sum() / real.sum() - 1),
        "step_err_median": float(np.median(pred / real) - 1),
    }
    reqs = steps["num_reqs"].to_numpy(float)
    row["step_err_per_request"] = float((reqs * pred).sum() / (reqs * real).sum() - 1)
    prefill = steps["num_prefill_tokens"].to_numpy() > 0
    for name, mask in (("prefill", prefill), ("decode", ~prefill)):
        if mask.any():
            row[f"step_err_{name}_total"] = float(pred[mask].sum() / real[mask].sum() - 1)
    return row


def size_bucket(num_reqs: int) -> int:
    """A batch size as :func:`steps_by_size` groups it: each size up to 16, then
    the power of two at or above it."""
    return num_reqs if num_reqs <= 16 else 1 << (num_reqs - 1).bit_length()


def size_label(bucket: int) -> str:
    return str(bucket) if bucket <= 16 else f"{bucket // 2 + 1}-{bucket}"


def steps_by_size(runs: dict[str, list[pd.DataFrame]]) -> pd.DataFrame:
    """The latency model on the real runs' own steps, by batch composition: for
    each trace (the busy steps of all its real runs), decode-only steps and
    steps with a prefill chunk, by the number of requests in the batch; their
    share of the busy time and the model's error on them (predicted / real - 1).
    ``err_vs_trace`` divides out the trace's overall error, which the machine's
    speed sets: what is left is where the model's shape misses."""
    rows = []
    for trace, frames in runs.items():
        if not frames:
            continue
        steps = pd.concat(frames)
        busy = steps["latency_s"].sum()
        level = steps["pred_s"].sum() / busy
        kind = np.where(steps["num_prefill_tokens"] > 0, "with prefill", "decode only")
        bucket = steps["num_reqs"].astype(int).map(size_bucket)
        for (k, b), g in steps.groupby([kind, bucket]):
            err = g["pred_s"].sum() / g["latency_s"].sum()
            rows.append(
                dict(
                    trace=trace,
                    step=k,
                    num_reqs=size_label(int(b)),
                    steps=len(g),
                    busy_share=g["latency_s"].sum() / busy,
                    err=err - 1,
                    err_vs_trace=err / level - 1,
                )
            )
    return pd.DataFrame(rows)


def queued_steps(run_dir: Path) -> float:
    """The fraction of a run's steps with a request waiting: where the policy
    chooses anything. With none, every policy runs the same schedule and their
    rows differ only by the real runs' noise."""
    waiting = pd.read_csv(run_dir / "steps.csv", usecols=["num_waiting"])["num_waiting"]
    return float((waiting > 0).mean()) if len(waiting) else float("nan")


def simulated_with(run_dir: Path) -> str | None:
    """The latency model a simulation ran with (its ``latency_model_source``)."""
    return read_metrics(run_dir).get("latency_model_source")


def reuse_warning(reused_sim: Path, sim: Path) -> str | None:
    """Where the reused invocation simulated a pair with another latency model (a
    profile measured again, or passes added) than this one: a warning that names
    both, since the tables will differ from that invocation's; else None."""
    if not (reused_sim / "metrics.json").exists():
        return None
    was, now = simulated_with(reused_sim), simulated_with(sim)
    if was == now:
        return None
    return (
        f"WARNING --reuse: {reused_sim} was simulated with {was}; this simulation "
        f"with {now}: the tables differ from that invocation's for the model, not the runs"
    )


def machine_mismatches(pairs: list[tuple[Path, object]]) -> list[str]:
    """A warning line for each real run measured on another machine than the
    profile its pair was simulated with (``machine`` in the run's
    ``metrics.json`` against the profile header's; see
    :func:`~testbed.profile_table.profile_machine`): two VMs of one name can
    differ 2-3x in step time, which no speed factor should be asked to hide.
    Runs or profiles that do not record the machine are not compared."""
    lines = []
    for run, model in pairs:
        ran_on = read_metrics(run).get("machine")
        profiled_on = profile_machine(getattr(model, "header", {}))
        if ran_on and profiled_on and ran_on != profiled_on:
            lines.append(
                f"WARNING: {run.parent.name}/{run.name} ran on {ran_on}; its latency model "
                f"({getattr(model, 'source', '?')}) was profiled on {profiled_on}"
            )
    return lines


SPREAD = tuple(TARGETS)  # the metrics a simulation is held to


def repeat_spread(sim: Path, reals: list[Path], own: list[Path] | None = None) -> dict:
    """How far repeated real runs of one pair are apart (``real_spread_*``:
    (max - min) / mean), and the simulation's error against each of them alone
    (``err_min_*``, ``err_max_*``); with ``own`` (each run simulated at its own
    speed), those simulations' errors against their runs (``own_each_err_*``)."""
    metrics = [read_metrics(r) for r in reals]
    ms = read_metrics(sim)
    owns = [read_metrics(r) for r in own or []]
    row: dict = {"real_runs": len(reals)}
    for key in SPREAD:
        values = np.array([m[key] for m in metrics], float)
        row[f"real_spread_{key}"] = float(np.ptp(values) / values.mean())
        errors = np.array([relative_error(ms[key], m[key]) for m in metrics])
        row[f"err_min_{key}"], row[f"err_max_{key}"] = float(errors.min()), float(errors.max())
        if owns:
            pairs = zip(owns, metrics, strict=True)
            each = np.array([relative_error(o[key], m[key]) for o, m in pairs])
            row[f"own_each_err_min_{key}"] = float(each.min())
            row[f"own_each_err_max_{key}"] = float(each.max())
    return row


EFFECTS = ("ttft_s_mean", "ttft_s_p90", "tpot_s_mean", "e2e_s_mean", "e2e_s_p90")
GROUPS = ("priority", "tenant")  # what priority and vtc order by


def metrics_of(run_dir: Path) -> dict:
    """A run's metrics, with the mean TTFT of each priority class and tenant
    (``ttft_s_mean[priority=0]``, ...) where the trace has more than one: what
    priority and vtc change, which the whole trace's means can hide."""
    metrics = read_metrics(run_dir)
    reqs = run_dir / "requests.csv"
    if reqs.exists():
        df = pd.read_csv(reqs, usecols=["ttft_s", *GROUPS])
        for group in GROUPS:
            if df[group].nunique() > 1:
                for value, ttft in df.groupby(group)["ttft_s"]:
                    metrics[f"ttft_s_mean[{group}={value}]"] = float(ttft.mean())
    return metrics


@dataclass
class PairRuns:
    """One trace and policy: its simulation, its real runs, each real run
    simulated at that run's own speed (empty with one run), and the simulation
    at the runs' speed window by window (their mean with repeats)."""

    sim: Path
    reals: list[Path]
    own: list[Path] = field(default_factory=list)
    by_window: Path | None = None


def round_effects(runs: list[dict], base: list[dict], key: str) -> list[float]:
    """Run k against the baseline's run k, for every round both have."""
    return [a[key] / b[key] - 1 for a, b in zip(runs, base, strict=False)]


def ordered_alike(values: dict, real: dict, pairs_of: list[tuple[str, str]]) -> int:
    """How many pairs of policies ``values`` order as the real runs (``real``) do."""
    same = [np.sign(values[a] - values[b]) == np.sign(real[a] - real[b]) for a, b in pairs_of]
    return int(sum(same))


@dataclass
class TraceMetrics:
    """One trace's runs' metrics per policy: the simulations, the real runs, each
    real run at its own speed, and the simulations by window (empty unless every
    policy has one)."""

    sims: dict[str, dict]
    reals: dict[str, list[dict]]
    owns: dict[str, list[dict]]
    wins: dict[str, dict]

    @classmethod
    def read(cls, pairs: dict[str, PairRuns]) -> TraceMetrics:
        wins = {p: metrics_of(r.by_window) for p, r in pairs.items() if r.by_window}
        return cls(
            sims={p: metrics_of(r.sim) for p, r in pairs.items()},
            reals={p: [metrics_of(d) for d in r.reals] for p, r in pairs.items()},
            owns={p: [metrics_of(d) for d in r.own] for p, r in pairs.items()},
            wins=wins if len(wins) == len(pairs) else {},
        )

    def keys(self, baseline: str) -> list[str]:
        """:data:`EFFECTS` and the per-class and per-tenant means every run has."""
        every = [*self.sims.values(), *(m for ms in self.reals.values() for m in ms)]
        grouped = sorted(k for k in self.sims[baseline] if "[" in k and all(k in m for m in every))
        return [*EFFECTS, *grouped]


def effect_row(m: TraceMetrics, key: str, policy: str, baseline: str, win_v: dict) -> dict:
    """One policy's effect on ``key`` against ``baseline``: in simulation, in the
    real runs (their means, and round by round), at the runs' speed by window
    (``win_v``), and round by round between the runs' own-speed simulations."""
    sim_v = {p: s[key] for p, s in m.sims.items()}
    real_v = {p: float(np.mean([r[key] for r in rs])) for p, rs in m.reals.items()}
    rounds = round_effects(m.reals[policy], m.reals[baseline], key)
    row = dict(
        metric=key,
        policy=policy,
        sim_effect=sim_v[policy] / sim_v[baseline] - 1,
        real_effect=real_v[policy] / real_v[baseline] - 1,
        real_effect_min=min(rounds),
        real_effect_max=max(rounds),
    )
    if win_v:
        row.update(win_effect=win_v[policy] / win_v[baseline] - 1)
    with_key = all(key in o for o in (*m.owns[policy], *m.owns[baseline]))
    own = round_effects(m.owns[policy], m.owns[baseline], key) if with_key else []
    if own:
        gaps = [abs(o - r) for o, r in zip(own, rounds, strict=False)]
        row.update(own_effect_min=min(own), own_effect_max=max(own), own_round_gap=max(gaps))
    return row


def order_row(m: TraceMetrics, key: str, win_v: dict) -> dict:
    """The order the policies take on ``key`` in simulation and in the real runs,
    and how many pairs of policies the two (and the runs' speed by window) order
    alike."""
    sim_v = {p: s[key] for p, s in m.sims.items()}
    real_v = {p: float(np.mean([r[key] for r in rs])) for p, rs in m.reals.items()}
    names = list(m.sims)
    pairs_of = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    order = dict(
        metric=key,
        sim_order=" < ".join(sorted(names, key=sim_v.get)),
        real_order=" < ".join(sorted(names, key=real_v.get)),
        pairs_ordered_alike=ordered_alike(sim_v, real_v, pairs_of),
        pairs=len(pairs_of),
    )
    if win_v:
        order.update(win_pairs_ordered_alike=ordered_alike(win_v, real_v, pairs_of))
    return order


def policy_effects(runs: dict[str, dict[str, PairRuns]], baseline: str):
    """What the simulator says about the policies against what the real engine
    does: for each trace and metric, each policy's effect relative to
    ``baseline`` (policy / baseline - 1) in simulation and in the real runs
    (their means; with repeats also round by round, run k against run k, as the
    real effect's noise), and how many pairs of policies the two order alike.
    With repeats, also the effect round by round between the simulations of the
    runs at their own speeds (``own_effect_*``): what the simulator says the
    machine's speed in each run did to the effect, and ``own_round_gap``, the
    largest difference from the real effect of the same round. Where every pair
    has one, the effect between the simulations at the runs' speed window by
    window (``win_effect``; ``win_pairs_ordered_alike``): the simulator given
    how the machine's speed moved in each run.

    ``runs``: trace -> policy -> :class:`PairRuns`. Returns the effects (one
    row per trace, metric and policy) and the order agreement (one row per
    trace and metric)."""
    effects, orders = [], []
    for trace, pairs in runs.items():
        if baseline not in pairs or len(pairs) < 2:
            continue
        m = TraceMetrics.read(pairs)
        for key in m.keys(baseline):
            with_win = all(key in w for w in m.wins.values())
            win_v = {p: w[key] for p, w in m.wins.items()} if with_win else {}
            for policy in pairs:
                if policy != baseline:
                    effects.append(dict(trace=trace, **effect_row(m, key, policy, baseline, win_v)))
            orders.append(dict(trace=trace, **order_row(m, key, win_v)))
    return pd.DataFrame(effects), pd.DataFrame(orders)
