"""Pool several fidelity experiments: the simulator's error per pair, over many real runs.

One ``experiments.fidelity`` experiment compares each (trace, policy) pair's
simulation with the mean of a few real runs. On a machine whose speed wanders
from run to run, a mean of two real runs is
itself off by a few percent, and so is the profile the simulation is measured
against: one experiment's error on a pair is the simulator's own error plus
that noise, which lands a pair or two over a 5% target in any one experiment.

This script reads the written results of several experiments of the same
workload (``fidelity.json`` and ``fidelity.csv`` of each ``--out`` directory:
nothing is run or re-simulated) and, per pair and error column, gives the
experiments' mean error, their standard deviation and the standard error of
the mean, the lowest and highest, and in how many experiments the pair was
within its target (5% for throughput, mean TPOT and mean E2E; 10% for p50
TTFT). The mean over independent experiments is the estimate of the
simulator's own error on that pair; the standard deviation is what a single
experiment adds. Rows comparing a real run with a repeat of itself
(``... (real vs real)``) are the machine's noise floor, pooled the same way.

Experiments pool only if they ran the same workload: the same load, number of
requests, context length and ``--extra`` overrides (apart from the settings in
``--may-differ``: by default ``hardware.cpus``, the cores the engine was
pinned to); anything else is an error naming the file and the field.

    python -m experiments.pool_fidelity outputs/fidelity/<stamp> outputs/fidelity/<stamp2> \\
        --names a b

writes ``pooled.csv``, ``pooled.md``, ``pooled.json`` and ``manifest.json`` to
``--out`` (``outputs/pool_fidelity``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.fidelity.compare import NOISE
from experiments.fidelity.report import markdown_table, read_experiment
from experiments.manifest import ROOT, write_manifest
from testbed.metrics.fidelity import TARGETS, within_target
from testbed.report.wandb_log import log_experiment

# column prefix: how the simulation was given the machine's speed (experiments.fidelity)
VARIANTS = {
    "err": "merged profile",
    "pass_err": "per-pass sims",
    "ref_err": "reference probe",
    "nb_err": "neighbours' speed",
    "own_err": "own speed (not a prediction)",
    "win_err": "runs' speed by window (not a prediction)",
}
SAME = ("load", "num_requests", "max_model_len")  # meta fields that must agree


def setting_key(override: str) -> str:
    """``hardware.cpus=[1]`` -> ``hardware.cpus``."""
    return override.split("=", 1)[0].lstrip("+~")


def check_alike(metas: dict[str, dict], may_differ: tuple[str, ...]) -> None:
    """Refuse to pool experiments of different workloads, naming the first field
    that differs."""
    (first, reference), *others = metas.items()

    def extra(meta: dict) -> list[str]:
        return sorted(o for o in meta.get("extra", []) if setting_key(o) not in may_differ)

    for name, meta in others:
        for field in SAME:
            if meta.get(field) != reference.get(field):
                raise SystemExit(
                    f"{name}/fidelity.json: meta.{field} is {meta.get(field)!r}, but "
                    f"{reference.get(field)!r} in {first}/fidelity.json: not the same workload"
                )
        if extra(meta) != extra(reference):
            raise SystemExit(
                f"{name}/fidelity.json: meta.extra is {extra(meta)}, but {extra(reference)} "
                f"in {first}/fidelity.json (settings that may differ: {list(may_differ)}): "
                "not the same workload"
            )


def pool(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per (trace, policy, variant, metric): the experiments that have it (``n``), their
    mean error, its standard deviation and standard error, the lowest and highest,
    and how many were within the metric's target; with the errors one by one, in the
    order the experiments were given."""
    names = list(tables)
    long = []
    for name, table in tables.items():
        for prefix in VARIANTS:
            for metric in TARGETS:
                column = f"{prefix}_{metric}"
                if column not in table:
                    continue
                part = table[["trace", "policy", column]].dropna(subset=[column])
                long.append(
                    part.rename(columns={column: "error"}).assign(
                        experiment=name, variant=prefix, metric=metric
                    )
                )
    if not long:
        raise SystemExit("no error columns to pool (fidelity.csv of experiments.fidelity)")
    errors = pd.concat(long, ignore_index=True)
    rows = []
    keys = ["trace", "policy", "variant", "metric"]
    for (trace, policy, variant, metric), g in errors.groupby(keys, sort=False):
        values = g["error"].to_numpy(float)
        sd = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
        by = dict(zip(g["experiment"], values, strict=True))
        rows.append(
            dict(
                trace=trace,
                policy=policy,
                variant=variant,
                metric=metric,
                n=len(values),
                mean=float(values.mean()),
                sd=sd,
                se=sd / np.sqrt(len(values)),
                lowest=float(values.min()),
                highest=float(values.max()),
                within=int(within_target(metric, values).sum()),
                **{f"err_{name}": by.get(name, np.nan) for name in names},
            )
        )
    return pd.DataFrame(rows)


def pair_label(trace: str, policy: str) -> str:
    return f"{trace.split(':')[0]} {policy}"


def pooled_markdown(pooled: pd.DataFrame, names: list[str], variants: dict = VARIANTS) -> str:
    """One table per variant (column prefix: title): each pair's pooled mean TPOT and
    E2E error (± standard error), the experiments one by one, and how many were
    within 5% on both."""
    parts = []
    for prefix, title in variants.items():
        part = pooled[pooled["variant"] == prefix]
        tpot = part[part["metric"] == "tpot_s_mean"].set_index(["trace", "policy"])
        e2e = part[part["metric"] == "e2e_s_mean"].set_index(["trace", "policy"])
        pairs = [k for k in tpot.index if k in e2e.index]
        if not pairs:
            continue
        rows = []
        for key in pairs:
            t, e = tpot.loc[key], e2e.loc[key]
            each = [
                f"{t[f'err_{n}']:+.1%} / {e[f'err_{n}']:+.1%}" if pd.notna(t[f"err_{n}"]) else "–"
                for n in names
            ]
            both = sum(
                within_target("tpot_s_mean", t[f"err_{n}"])
                and within_target("e2e_s_mean", e[f"err_{n}"])
                for n in names
                if pd.notna(t[f"err_{n}"])
            )
            rows.append(
                [
                    pair_label(*key),
                    f"{t['mean']:+.1%} ± {t['se']:.1%}",
                    f"{e['mean']:+.1%} ± {e['se']:.1%}",
                ]
                + each
                + [f"{both} of {int(t['n'])}"]
            )
        heading = ["pair", "TPOT mean, pooled", "E2E mean, pooled", *names, "within 5% (both)"]
        parts.append(f"### {title}\n\n" + markdown_table(heading, rows, left=1))
    return "\n".join(parts)


def count_within(part: pd.DataFrame) -> int:
    """Pairs whose pooled mean is within its target on every metric in ``part``."""
    ok = part.apply(lambda r: within_target(r["metric"], r["mean"]), axis=1)
    return int(ok.groupby([part["trace"], part["policy"]]).all().sum())


def write_pooled(out: Path, pooled: pd.DataFrame, names: list[str], summary: dict) -> None:
    """``pooled.csv``, ``pooled.md`` (the errors and the noise floor) and ``pooled.json``."""
    out.mkdir(parents=True, exist_ok=True)
    pooled.to_csv(out / "pooled.csv", index=False)
    noise = pooled["policy"].str.endswith(NOISE)
    (out / "pooled.md").write_text(
        f"## Errors pooled over {len(names)} experiments (TPOT mean / E2E mean)\n\n"
        + pooled_markdown(pooled[~noise], names)
        + "\n## The machine's noise floor: a real run against its repeat\n\n"
        + pooled_markdown(pooled[noise], names, {"err": "the second run against the first"})
    )
    (out / "pooled.json").write_text(json.dumps(summary, indent=1, default=float))


def print_worst(signal: pd.DataFrame) -> None:
    """Per variant: the pairs whose pooled mean TPOT and E2E are within 5%, and the worst."""
    for prefix, title in VARIANTS.items():
        part = signal[
            (signal["variant"] == prefix) & signal["metric"].isin(["tpot_s_mean", "e2e_s_mean"])
        ]
        if part.empty:
            continue
        worst = part.loc[part["mean"].abs().idxmax()]
        print(
            f"{title}: pooled mean TPOT and E2E within 5% on "
            f"{count_within(part)} of {part.groupby(['trace', 'policy']).ngroups} pairs; "
            f"largest {worst['mean']:+.1%} ± {worst['se']:.1%} "
            f"({pair_label(worst['trace'], worst['policy'])}, {worst['metric']})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiments", nargs="+", type=Path, help="experiments.fidelity results")
    ap.add_argument(
        "--names", nargs="+", help="a short name per experiment (default: folder names)"
    )
    ap.add_argument("--may-differ", nargs="*", default=["hardware.cpus"])
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/pool_fidelity")
    ap.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    args = ap.parse_args()
    names = args.names or [p.name for p in args.experiments]
    if len(names) != len(args.experiments) or len(set(names)) != len(names):
        raise SystemExit(f"--names: need {len(args.experiments)} distinct names, got {names}")
    read = {n: read_experiment(p) for n, p in zip(names, args.experiments, strict=True)}
    check_alike(
        {str(p): read[n][0] for n, p in zip(names, args.experiments, strict=True)},
        tuple(args.may_differ),
    )
    pooled = pool({n: table for n, (_, table) in read.items()})
    summary = {
        "experiments": {n: str(p) for n, p in zip(names, args.experiments, strict=True)},
        "meta": {n: meta for n, (meta, _) in read.items()},
        "pooled": pooled.to_dict(orient="records"),
    }
    write_pooled(args.out, pooled, names, summary)
    write_manifest(args.out)
    print_worst(pooled[~pooled["policy"].str.endswith(NOISE)])
    log_experiment(
        args.wandb,
        ROOT / "outputs",
        "fidelity",
        {"experiments": summary["experiments"], "meta": summary["meta"]},
        tables={"fidelity_pooled": pooled},
        tags=["fidelity", "pooled"],
    )
    print(f"wrote {args.out / 'pooled.md'}")


if __name__ == "__main__":
    main()
