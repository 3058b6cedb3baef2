"""A sweep's summary: once ``python run.py -m ...`` has run every job, one table.

Hydra calls :class:`SweepSummary` (``hydra.callbacks`` in ``conf/config.yaml``)
at the end of a multirun. It reads each job's ``metrics.json`` under the sweep
directory, prints a line per run and writes them to ``sweep_summary.csv``
there. Two checks a sweep needs:

* jobs that differ only in ``mode`` (``-m mode=sim,real ...``) are paired, and
  the simulation's relative error against the real run is printed for the
  issue's fidelity targets (throughput, mean TPOT and E2E, p50 TTFT);
* real runs whose machine ran at different speeds against its profile
  (``speed_vs_profile``, see :func:`testbed.sim.latency.speed_against`) are
  flagged: on a shared machine, what separates two real runs is partly the
  machine, not the policy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# metrics.json keys the summary keeps, with their column headings
COLUMNS = {
    "mode": "mode",
    "policy": "policy",
    "trace": "trace",
    "num_finished": "finished",
    "throughput_req_s": "req/s",
    "ttft_s_p50": "TTFT p50",
    "tpot_s_mean": "TPOT mean",
    "e2e_s_mean": "E2E mean",
    "speed_vs_profile": "speed vs profile",
}
# What a simulation is held to against its real run (relative error), as in the
# fidelity experiment (experiments/fidelity.py)
TARGETS = {"throughput_req_s": 0.05, "tpot_s_mean": 0.05, "e2e_s_mean": 0.05, "ttft_s_p50": 0.10}
# Real runs whose speed_vs_profile differs by more than this are flagged
SPEED_SPREAD = 0.05


def job_order(run_dir: Path) -> tuple[int, str]:
    """Hydra's job number where the directory starts with it, then the name."""
    number = re.match(r"\d+", run_dir.name)
    return (int(number.group()) if number else 1 << 62, run_dir.name)


def job_overrides(run_dir: Path) -> list[str]:
    """The job's command-line overrides (Hydra's ``.hydra/overrides.yaml``), if kept."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    return [str(o) for o in yaml.safe_load(path.read_text()) or []]


def sweep_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job of the sweep that wrote a ``metrics.json``, in job order: the
    :data:`COLUMNS`, ``partial``, its directory's name (``run``) and ``pair``, its
    overrides other than ``mode`` (jobs with the same ``pair`` differ only in mode)."""
    runs = []
    for run_dir in sorted((p.parent for p in sweep_dir.glob("*/metrics.json")), key=job_order):
        path = run_dir / "metrics.json"
        try:
            metrics = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err})") from err
        overrides = [o for o in job_overrides(run_dir) if not o.startswith("mode=")]
        runs.append({
            "run": run_dir.name,
            **{key: metrics.get(key) for key in COLUMNS},
            "partial": bool(metrics.get("partial")),
            "pair": " ".join(sorted(overrides)),
        })  # fmt: skip
    return runs


def fidelity_pairs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each simulation against the real run of the same overrides: the relative
    error (sim / real - 1) of every :data:`TARGETS` metric, and ``meets`` (all
    within their targets). Only pairs with exactly one run of each mode."""
    pairs = []
    keys = dict.fromkeys(r["pair"] for r in runs)
    for key in keys:
        group = [r for r in runs if r["pair"] == key]
        sims = [r for r in group if r["mode"] == "sim"]
        reals = [r for r in group if r["mode"] == "real"]
        if len(sims) != 1 or len(reals) != 1:
            continue
        sim, real = sims[0], reals[0]
        errors = {
            metric: sim[metric] / real[metric] - 1
            for metric in TARGETS
            if sim.get(metric) is not None and real.get(metric)
        }
        meets = len(errors) == len(TARGETS) and all(abs(e) <= TARGETS[m] for m, e in errors.items())
        pairs.append({"sim": sim["run"], "real": real["run"], **errors, "meets": meets})
    return pairs


def speed_spread(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The lowest and highest ``speed_vs_profile`` of the real runs, where two or
    more have one."""
    speeds = [r["speed_vs_profile"] for r in runs if r["mode"] == "real"]
    speeds = [s for s in speeds if s is not None]
    return (min(speeds), max(speeds)) if len(speeds) >= 2 else None


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def met(meets: bool) -> str:
    return "met" if meets else "missed"


def table(headings: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    lines = [headings, *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def summary(runs: list[dict[str, Any]]) -> str:
    """The printed summary: the runs, then the sim-vs-real pairs and the speed check."""
    headings = ["run", *COLUMNS.values()]
    rows = [
        [r["run"] + (" (partial)" if r["partial"] else ""), *(cell(r[k]) for k in COLUMNS)]
        for r in runs
    ]
    parts = [table(headings, rows)]
    pairs = fidelity_pairs(runs)
    if pairs:
        heads = ["sim", "real", *(f"{COLUMNS[m]} err" for m in TARGETS), "targets"]
        lines = [
            [p["sim"], p["real"], *(percent(p.get(m)) for m in TARGETS), met(p["meets"])]
            for p in pairs
        ]
        limits = ", ".join(f"{COLUMNS[m]} {t:.0%}" for m, t in TARGETS.items())
        parts.append(f"simulation against the real run ({limits}):\n" + table(heads, lines))
    spread = speed_spread(runs)
    if spread is not None and spread[1] / spread[0] - 1 > SPEED_SPREAD:
        low, high = spread
        parts.append(
            f"WARNING: the real runs' machine ran at {low:.3f}x to {high:.3f}x its profile's "
            f"step time ({high / low - 1:.0%} apart): what separates these runs is partly the "
            "machine, not only what the sweep varied. Repeat the sweep (in another order) "
            "to see how much, or compare the policies in simulation."
        )
    return "\n\n".join(parts)


def write_summary(sweep_dir: Path) -> str | None:
    """Write ``sweep_summary.csv`` under ``sweep_dir`` and return the printed
    summary; None where no job wrote a ``metrics.json`` (a sweep of profiles)."""
    runs = sweep_runs(sweep_dir)
    if not runs:
        return None
    import pandas as pd

    pd.DataFrame(runs).to_csv(sweep_dir / "sweep_summary.csv", index=False)
    return summary(runs)


class SweepSummary(Callback):
    """Prints and writes the sweep's summary when a multirun ends."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        text = write_summary(sweep_dir)
        if text is not None:
            print(f"\nsweep {sweep_dir} ({sweep_dir / 'sweep_summary.csv'}):\n{text}")
