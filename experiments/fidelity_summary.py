"""How many sim-vs-real pairs meet the fidelity targets, experiment by experiment.

Reads the ``fidelity.csv`` and ``fidelity.json`` that ``experiments.fidelity``
wrote into each results folder given and counts, per way of setting the
simulation's speed, the pairs (trace, policy) that meet all of the issue's
targets at once: throughput, mean TPOT and mean E2E within 5%, p50 TTFT within
10%. The variants are the column prefixes the experiment writes:

- ``profile``: the profile alone, the prediction made before the run;
- ``reference``: scaled by the probe on the other core during the run (``ref_``);
- ``neighbours``: by the speed of the neighbouring real runs (``nb_``);
- ``own``: by the run's own measured speed, one factor (``own_``);
- ``window``: by its speed 10 s window by window (``win_``).

A variant an experiment did not compute is reported as absent (``–``), never
as a miss. The ``(real vs real)`` rows (``--noise``) are the real engine
against its own repeat and are counted apart: the noise floor. ``fit`` is the
merged profile's median relative error on its own points (``meta``), how much
the machine moved while it was profiled.

Each pair's prefill/decode split is reported beside its own speed: the error of
the summed busy time of steps with a prefill chunk against that of plain decode
steps, ``(1 + prefill error) / (1 + decode error) - 1``, which a uniform change
of the machine's speed leaves at zero, and the run's own speed factor (its
measured time over the profile's). ``split_vs_speed`` is the least-squares
slope of the split on the log of that factor, both taken relative to their
experiment's and trace's mean, over every experiment given: whether the
machine's slow spells slow one kind of step more than the other.

    python -m experiments.fidelity_summary experiments/results/fidelity_cpu*

prints a Markdown table and writes ``summary.json``, ``summary.md`` and
``manifest.json`` to ``--out`` (``outputs/fidelity_summary``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from experiments.fidelity.compare import NOISE, error_ratio
from experiments.fidelity.report import markdown_table, read_experiment
from experiments.manifest import ROOT, write_manifest
from testbed.metrics.fidelity import TARGETS, target_misses

VARIANTS = {
    "profile": "",
    "reference": "ref_",
    "neighbours": "nb_",
    "own": "own_",
    "window": "win_",
}


def misses(row: dict, prefix: str) -> list[str] | None:
    """The targets ``row`` misses with ``prefix``'s errors; None where it has none of them."""
    errors = {metric: number(row, f"{prefix}err_{metric}") for metric in TARGETS}
    if all(v is None for v in errors.values()):
        return None
    return [
        f"err_{metric}: missing" if value is None else f"err_{metric} {value:+.1%}"
        for metric, value in target_misses(errors).items()
    ]


def number(row: dict, column: str) -> float | None:
    """``row[column]`` as a float; None where the column is absent or empty."""
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def split(row: dict) -> float | None:
    """Prefill against decode busy-time error of one pair; None where not measured."""
    pre, dec = number(row, "step_err_prefill_total"), number(row, "step_err_decode_total")
    if pre is None or dec is None:
        return None
    return error_ratio(pre, dec)


def split_vs_speed(summaries: list[dict]) -> dict | None:
    """Slope and correlation of the split on log(own speed), within each experiment and trace."""
    xs, ys = [], []
    for s in summaries:
        groups: dict[str, list[tuple[float, float]]] = {}
        for pair in s["splits"]:
            if pair["split"] is not None and pair["own_speed_factor"] is not None:
                trace = pair["pair"].split("/")[0]
                groups.setdefault(trace, []).append(
                    (math.log(pair["own_speed_factor"]), pair["split"])
                )
        for points in groups.values():
            if len(points) < 2:
                continue
            mx = sum(x for x, _ in points) / len(points)
            my = sum(y for _, y in points) / len(points)
            xs += [x - mx for x, _ in points]
            ys += [y - my for _, y in points]
    sxx = sum(x * x for x in xs)
    syy = sum(y * y for y in ys)
    if len(xs) < 3 or sxx == 0 or syy == 0:
        return None
    sxy = sum(x * y for x, y in zip(xs, ys))
    return {"slope": sxy / sxx, "corr": sxy / math.sqrt(sxx * syy), "pairs": len(xs)}


def summarize(folder: Path) -> dict:
    """One experiment: pairs meeting every target per variant, and its noise floor."""
    meta, table = read_experiment(folder)
    noise = table["policy"].astype(str).str.endswith(NOISE)
    pairs, floor = table[~noise].to_dict("records"), table[noise].to_dict("records")
    variants = {}
    for name, prefix in VARIANTS.items():
        results = [(f"{r['trace']}/{r['policy']}", misses(r, prefix)) for r in pairs]
        results = [(pair, missed) for pair, missed in results if missed is not None]
        if not results:
            continue
        variants[name] = {
            "met": sum(not missed for _, missed in results),
            "pairs": len(results),
            "misses": {pair: missed for pair, missed in results if missed},
        }
    splits = []
    for r in pairs:
        splits.append(
            {
                "pair": f"{r['trace']}/{r['policy']}",
                "split": split(r),
                "own_speed_factor": number(r, "own_speed_factor"),
            }
        )
    noise_misses = [misses(r, "") for r in floor]
    noise_misses = [m for m in noise_misses if m is not None]
    return {
        "experiment": folder.name,
        "date": meta.get("date"),
        "repeats": meta.get("repeats"),
        "fit": meta.get("profile_fit_rel_error"),
        "variants": variants,
        "noise": {"met": sum(not m for m in noise_misses), "comparisons": len(noise_misses)},
        "splits": splits,
    }


def markdown(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        cells = [f"`{s['experiment']}/`", "–" if s["fit"] is None else f"{s['fit']:.1%}"]
        for name in VARIANTS:
            v = s["variants"].get(name)
            cells.append("–" if v is None else f"{v['met']} / {v['pairs']}")
        n = s["noise"]
        cells.append("–" if not n["comparisons"] else f"{n['met']} / {n['comparisons']}")
        rows.append(cells)
    return markdown_table(["experiment", "fit", *VARIANTS, "real vs real"], rows, left=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="experiments.fidelity results")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/fidelity_summary")
    args = parser.parse_args(argv)
    folders = [f for f in args.folders if (f / "fidelity.csv").is_file()]
    for skipped in sorted(set(args.folders) - set(folders)):
        print(f"skipped {skipped}: no fidelity.csv in it", file=sys.stderr)
    if not folders:
        parser.error("no fidelity results folder among " + ", ".join(map(str, args.folders)))
    summaries = [summarize(f) for f in folders]
    text = markdown(summaries)
    relation = split_vs_speed(summaries)
    if relation is not None:
        text += (
            f"\nprefill/decode split on log(own speed), within experiments: slope "
            f"{relation['slope']:+.3f}, correlation {relation['corr']:+.2f}, "
            f"{relation['pairs']} pairs\n"
        )
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"experiments": summaries, "split_vs_speed": relation}
    (args.out / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out / "summary.md").write_text(text)
    write_manifest(args.out)
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
