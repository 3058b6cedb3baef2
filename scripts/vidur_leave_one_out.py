"""Check the fitted operator curves by leaving one model out: each Vidur model's
operators predicted by the curve fitted without it (``fit_without`` in the files
``scripts/compact_vidur_profiles.py`` writes), against its measured rows, per op and
per layer at a few token counts and every measured TP degree, and per layer over
every measured row. Prints the table and writes JSON.

    python scripts/vidur_leave_one_out.py [VIDUR_DIR] [--out outputs/vidur_fit/leave_one_out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from compact_vidur_profiles import DEFAULT_VIDUR, ROOT, read_compute  # puts the project on sys.path

from testbed.sim.operators import DATA_DIR, OPS, OperatorTimes, gpus

LOO_TOKENS = (1, 16, 128, 512, 2048, 4096)


def leave_one_out(vidur: Path, data_dir: Path, out: Path) -> None:
    """Each model's ops from the curve fitted without it, against its measured rows: at
    ``LOO_TOKENS`` per op and per layer, and over every measured row per layer."""
    rows, every = [], []
    for gpu in gpus(data_dir):
        for tab in read_compute(vidur, gpu):
            times = OperatorTimes.load(gpu, data_dir, exclude=tab.model)
            for tp, part in tab.ms.groupby(level="tp"):
                part = part.droplevel("tp")
                fitted = times.layer(tab.shape, int(tp), fitted=True)
                other = times.layer(tab.shape, int(tp))  # another table of this shape, if any
                ops = [op for op in OPS if op in part]
                for tokens in part.index:
                    measured = part.loc[tokens, ops] * 1e-3
                    pred = fitted.seconds(int(tokens))
                    layer = sum(pred[op] for op in ops) / measured.sum() - 1
                    every.append({"gpu": gpu, "model": tab.model, "layer": abs(layer)})
                    if tokens not in LOO_TOKENS:
                        continue
                    row = {"gpu": gpu, "model": tab.model, "tp": int(tp), "tokens": int(tokens)}
                    row |= {op: round(pred[op] / measured[op] - 1, 4) for op in ops}
                    row["layer"] = round(layer, 4)
                    if other.measured:
                        same = other.seconds(int(tokens))
                        row["layer_other_table"] = round(
                            sum(same[op] for op in ops) / measured.sum() - 1, 4
                        )
                    rows.append(row)
    df, all_rows = pd.DataFrame(rows), pd.DataFrame(every)
    print("Leave one model out: |predicted / measured - 1| of the curve fitted without the model,")
    print(f"at tokens {LOO_TOKENS} x each measured TP degree, and per layer over every row\n")
    print(
        f"{'gpu':<5} {'model':<36} {'op med':>7} {'op max':>7} {'layer med':>9} "
        f"{'layer max':>9} {'all rows: layer med':>20} {'p90':>6}"
    )
    summary = []
    for (gpu, model), g in df.groupby(["gpu", "model"], sort=False):
        ops = g[[op for op in OPS if op in g]].abs().to_numpy().ravel()
        ops = ops[~np.isnan(ops)]
        lay = g["layer"].abs()
        a = all_rows[(all_rows.gpu == gpu) & (all_rows.model == model)].layer
        line = {
            "gpu": gpu,
            "model": model,
            "op_median": float(np.median(ops)),
            "op_max": float(ops.max()),
            "layer_median": float(lay.median()),
            "layer_max": float(lay.max()),
            "all_rows_layer_median": float(a.median()),
            "all_rows_layer_p90": float(a.quantile(0.9)),
        }
        summary.append(line)
        print(
            f"{gpu:<5} {model:<36} {line['op_median']:7.1%} {line['op_max']:7.1%} "
            f"{line['layer_median']:9.1%} {line['layer_max']:9.1%} "
            f"{line['all_rows_layer_median']:20.1%} {line['all_rows_layer_p90']:6.1%}"
        )
    print("\nper op, all models (median / max):")
    for gpu, g in df.groupby("gpu"):
        cells = [
            f"{op} {g[op].abs().median():.0%}/{g[op].abs().max():.0%}" for op in [*OPS, "layer"]
        ]
        print(f"  {gpu}: " + ", ".join(cells))
    if "layer_other_table" in df:
        print("\na table of the same shape (another model's) instead of the curve, per layer:")
        for (gpu, model), g in df.dropna(subset=["layer_other_table"]).groupby(["gpu", "model"]):
            e = g["layer_other_table"].abs()
            print(f"  {gpu} {model}: median {e.median():.1%}, max {e.max():.1%}")
    from benchmarks.common import write_results

    write_results(
        out,
        "vidur_leave_one_out",
        rows,
        summary=summary,
        tokens=list(LOO_TOKENS),
        data_dir=str(data_dir),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "vidur", nargs="?", type=Path, default=DEFAULT_VIDUR, help="vidur-profiles folder"
    )
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR, help="the compact files")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "vidur_fit" / "leave_one_out.json"
    )
    args = ap.parse_args(argv)
    if not (args.vidur / "compute").is_dir():
        sys.exit(f"no Vidur profiles at {args.vidur} (expected compute/ and network/ in it)")
    leave_one_out(args.vidur, args.data_dir, args.out)


if __name__ == "__main__":
    main()
