"""Make Vidur's published operator and NCCL timings compact enough to commit, fit the
GEMM and elementwise curves that stand in for shapes they lack, and check both.

    python scripts/compact_vidur_profiles.py [VIDUR_DIR]         # write testbed/sim/data/*.json
    python scripts/vidur_leave_one_out.py                        # check the fitted curves

``VIDUR_DIR`` (default ``../shared/data/vidur-profiles`` beside the project) holds
``compute/<gpu>/<org>/<model>/mlp.csv`` and ``network/<gpu>_<topology>/*.csv``.

Compaction: per model, TP degree and op, the median time (median again over duplicate
rows) at a thinned grid of token counts. The grid starts at 1, 2, 4, ..., 128 and every
512 tokens, and grows where linear interpolation misses two adjacent rows the same way by
more than ``--tol`` (the worst row and its neighbours join, so that a step where the GEMM
kernel changes stays a step; one row off alone is left as noise), up to ``--max-knots``.
Knot values are the least-squares fit (in relative error) to every row, not the rows at
the knots: cuBLAS is often fastest at round token counts, and a grid of round counts read
as they are would run low in between.
Collectives: knots two per octave of size, fitted to the non-decreasing curve nearest the
rows (small NCCL messages time in two modes; time does not fall as a message grows).
Times in ms to 4 significant digits. Prints how far the thinned grid is from every row.

Fit: ``testbed/sim/operators.py`` states the curves; least squares on log time over every
linear-op row (and every elementwise row) of one GPU, Levenberg-Marquardt in numpy, once
with all tables and once without each model (``fit_without``, for the leave-one-out
check in ``scripts/vidur_leave_one_out.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.sim.operators import (  # noqa: E402
    DATA_DIR,
    ELEMENTWISE_KIND,
    LINEAR_OPS,
    OPS,
    POOLED,
    VIDUR_OPS,
    ElementwiseFit,
    Fit,
    GemmFit,
    LayerShape,
)

DEFAULT_VIDUR = ROOT.parent / "shared" / "data" / "vidur-profiles"
SOURCE = {
    "project": "Vidur",
    "repo": "github.com/microsoft/vidur",
    "commit": "7d47513",
    "license": "MIT (testbed/sim/data/README.md)",
    "column": "time_stats.<op>.median",
    "unit": "ms",
}
FLOOR_MS = 0.0015  # the tables' resolution is 1 us: a miss this small is not a miss
POOLED_KINDS = ("norm", "act", "add")


@dataclass
class Measured:
    """One model's table: its shape and the median ms of each op by (tp, num_tokens)."""

    model: str
    shape: LayerShape
    vocab: int
    ms: pd.DataFrame  # index (tp, num_tokens), columns: our op names it measured


def sig4(x: float) -> float:
    return float(f"{x:.4g}")


# ----------------------------------------------------------------------------- reading


def read_model(path: Path, model: str) -> Measured:
    """One ``mlp.csv``: checked, duplicate rows merged by their median."""
    df = pd.read_csv(path)
    shape_cols = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size"]
    keys = ["num_tensor_parallel_workers", "num_tokens"]
    need = [*shape_cols, "use_gated_mlp", *keys, "time_stats.emb.median"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}")
    shapes = df[[*shape_cols, "use_gated_mlp"]].drop_duplicates()
    if len(shapes) != 1:
        raise ValueError(f"{path}: more than one model shape ({len(shapes)})")
    s = shapes.iloc[0]
    heads, hidden = int(s.n_head), int(s.n_embd)
    if hidden % heads:
        raise ValueError(f"{path}: n_embd {hidden} is not a multiple of n_head {heads}")
    shape = LayerShape(
        hidden=hidden,
        intermediate=int(s.n_expanded_embd),
        num_heads=heads,
        num_kv_heads=int(s.n_kv_head),
        head_dim=hidden // heads,
        gated=bool(s.use_gated_mlp),
    )
    cols = {f"time_stats.{v}.median": op for op, v in VIDUR_OPS.items()}
    cols = {c: op for c, op in cols.items() if c in df.columns}
    values = df[list(cols)]
    bad = values.isna().any(axis=1) | (values <= 0).any(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(f"{path}: row {row + 2}: a median time is missing or not positive")
    ms = df[keys + list(cols)].groupby(keys).median().rename(columns=cols)
    ms.index.names = ["tp", "num_tokens"]
    return Measured(model, shape, int(s.vocab_size), ms)


def read_compute(root: Path, gpu: str) -> list[Measured]:
    folder = root / "compute" / gpu
    files = sorted(folder.glob("*/*/mlp.csv"))
    if not files:
        raise ValueError(f"no {folder}/<org>/<model>/mlp.csv")
    return [read_model(f, f"{f.parent.parent.name}/{f.parent.name}") for f in files]


def read_network(path: Path) -> dict[tuple[int, int], pd.Series]:
    """Median ms by size, per (num_workers, devices_per_node)."""
    df = pd.read_csv(path)
    col = [c for c in df.columns if c.startswith("time_stats.") and c.endswith(".median")]
    need = ["size", "num_workers", "devices_per_node"]
    if len(col) != 1 or any(c not in df.columns for c in need):
        raise ValueError(f"{path}: needs one time_stats.*.median column and {need}")
    if (df[col[0]].isna() | (df[col[0]] <= 0)).any():
        raise ValueError(f"{path}: a median time is missing or not positive")
    out = {}
    for (w, dpn), g in df.groupby(["num_workers", "devices_per_node"]):
        out[(int(w), int(dpn))] = g.groupby("size")[col[0]].median()
    return out


# ---------------------------------------------------------------------------- thinning


def _hat(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Rows: the piecewise-linear basis on ``knots`` evaluated at ``x``."""
    i = np.clip(np.searchsorted(knots, x, side="right") - 1, 0, len(knots) - 2)
    w = (x - knots[i]) / (knots[i + 1] - knots[i])
    a = np.zeros((len(x), len(knots)))
    a[np.arange(len(x)), i] = 1 - w
    a[np.arange(len(x)), i + 1] += w
    return a


def thin(
    x: np.ndarray, y: np.ndarray, base: list[int], tol: float, max_knots: int
) -> tuple[list[int], list[float], np.ndarray]:
    """Knot indices into ``x``, knot values (ms, 4 significant digits) and each row's
    relative miss. Knots sit on rows, so every knot has a row to fit."""
    chosen = set(base) | {0, len(x) - 1}
    while True:
        idx = sorted(chosen)
        knots = x[idx]
        a = _hat(x, knots)
        v, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
        v = np.array([sig4(max(q, 1e-4)) for q in v])
        miss = a @ v - y
        off = np.sign(miss) * (np.abs(miss) > np.maximum(tol * y, FLOOR_MS))
        # a run of two rows off the same way is a step to follow; one row alone is noise
        run = (off[:-1] != 0) & (off[:-1] == off[1:])
        bad = np.r_[run, False] | np.r_[False, run]
        if not bad.any() or len(chosen) >= max_knots:
            return idx, list(v), np.abs(miss) / y
        worst = int(np.argmax(np.where(bad, np.abs(miss) / y, -1)))
        before = len(chosen)
        chosen |= {j for j in (worst - 1, worst, worst + 1) if 0 <= j < len(x)}
        if len(chosen) == before:  # every row near the worst is a knot already
            return idx, list(v), np.abs(miss) / y


def monotone(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest to ``y`` in least squares (pool adjacent
    violators): a collective's time does not fall as its message grows, and where it
    seems to, the runs disagree (small NCCL messages time in two modes)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks])


def tail_slope(x: np.ndarray, y: np.ndarray) -> float:
    """ms per token over the upper half of the measured range (least squares)."""
    upper = x >= x[-1] / 2
    if upper.sum() < 2:
        upper = slice(-2, None)
    xs, ys = x[upper], y[upper]
    slope = float(np.polyfit(xs, ys, 1)[0])
    return sig4(max(slope, 0.0))


def token_base(tokens: np.ndarray) -> list[int]:
    """Rows at 1, 2, 4, ..., 128 and every 512 tokens (where measured)."""
    want = {1, 2, 4, 8, 16, 32, 64, 128, *range(512, int(tokens[-1]) + 1, 512)}
    return [i for i, t in enumerate(tokens) if t in want]


def size_base(sizes: np.ndarray) -> list[int]:
    """Rows nearest to sizes log-spaced two per octave."""
    logs = np.log2(sizes)
    grid = np.arange(logs[0], logs[-1] + 0.5, 0.5)
    return sorted({int(np.argmin(np.abs(logs - g))) for g in grid})


# ----------------------------------------------------------------------------- fitting


def levenberg(residual, p0: np.ndarray, iters: int = 300) -> tuple[np.ndarray, float]:
    """Least squares of ``residual(p)`` from ``p0`` (Levenberg-Marquardt, numeric Jacobian)."""
    p, lam = np.asarray(p0, float), 1e-2
    r = residual(p)
    cost = float(r @ r)
    for _ in range(iters):
        jac = np.stack([(residual(p + e) - r) / 1e-6 for e in np.eye(len(p)) * 1e-6], axis=1)
        a, g = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e10:
            step = -np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), g)
            r_new = residual(p + step)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                improved = cost - c_new > 1e-12 * cost
                p, r, cost, lam = p + step, r_new, c_new, max(lam / 3, 1e-9)
                break
            lam *= 4
        if not improved:
            break
    return p, cost


def _gemm_params(p: np.ndarray) -> GemmFit:
    t0_mem, t0_compute, flops, m_half, bw = np.exp(p)
    return GemmFit(t0_mem, t0_compute, flops, m_half, bw)


def gemm_model(p: np.ndarray, m, k, n) -> np.ndarray:
    """``GemmFit.seconds`` over arrays."""
    g = _gemm_params(p)
    compute = 2 * m * k * n * (m + g.m_half) / (g.flops_max * m)
    memory = 2 * (m * k + k * n + m * n) / g.bytes_per_s
    return np.maximum(g.t0_mem_s + memory, g.t0_compute_s + compute)


def fit_gemm(rows: pd.DataFrame) -> GemmFit:
    m, k, n, t = (rows[c].to_numpy(float) for c in ("m", "k", "n", "s"))
    log_t = np.log(t)
    best = None
    for m_half in (16.0, 64.0, 256.0):
        for flops, bw in ((3e14, 1.5e12), (8e14, 3e12)):
            p0 = np.log([3e-6, 6e-6, flops, m_half, bw])
            p, cost = levenberg(lambda p: np.log(gemm_model(p, m, k, n)) - log_t, p0)
            if best is None or cost < best[1]:
                best = (p, cost)
    return GemmFit(*(sig4(v) for v in vars(_gemm_params(best[0])).values()))


def fit_elementwise(elements: np.ndarray, t: np.ndarray) -> ElementwiseFit:
    log_t = np.log(t)

    def curve(p):
        t0, rate, q = np.exp(p)
        return (t0**q + (elements / rate) ** q) ** (1 / q)

    p0 = np.log([t.min(), float(np.max(elements / t)), 2.0])
    p, _ = levenberg(lambda p: np.log(curve(p)) - log_t, p0)
    t0, rate, q = (sig4(math.exp(v)) for v in p)
    return ElementwiseFit(t0_s=t0, elements_per_s=rate, q=q)


def fit_rows(tables: list[Measured]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every row as GEMM (model, tp, op, m, k, n, s) and elementwise (…, kind, elements, s)."""
    gemm, elem = [], []
    for tab in tables:
        for tp, part in tab.ms.groupby(level="tp"):
            tokens = part.index.get_level_values("num_tokens").to_numpy(float)
            dims, widths = tab.shape.gemm_dims(int(tp)), tab.shape.elementwise_widths(int(tp))
            for op, (k, n) in dims.items():
                s = part[op].to_numpy() * 1e-3
                gemm.append(
                    pd.DataFrame(dict(model=tab.model, tp=tp, op=op, m=tokens, k=k, n=n, s=s))
                )
            for op, width in widths.items():
                if op in part:
                    s = part[op].to_numpy() * 1e-3
                    kind = ELEMENTWISE_KIND[op]
                    elem.append(
                        pd.DataFrame(
                            dict(
                                model=tab.model,
                                tp=tp,
                                op=op,
                                kind=kind,
                                elements=tokens * width,
                                s=s,
                            )
                        )
                    )
    return pd.concat(gemm, ignore_index=True), pd.concat(elem, ignore_index=True)


def fit_all(tables: list[Measured]) -> Fit:
    gemm, elem = fit_rows(tables)
    fits = {}
    for kind in sorted(set(ELEMENTWISE_KIND.values())):
        part = elem[elem.kind == kind]
        fits[kind] = fit_elementwise(part.elements.to_numpy(), part.s.to_numpy())
    pooled = elem[elem.kind.isin(POOLED_KINDS)]
    fits[POOLED] = fit_elementwise(pooled.elements.to_numpy(), pooled.s.to_numpy())
    return Fit(fit_gemm(gemm), fits)


def fit_errors(fit: Fit, tables: list[Measured]) -> dict[str, dict[str, float]]:
    """Median and 90th-percentile absolute relative error of the fit over every row."""
    gemm, elem = fit_rows(tables)
    out = {}
    pred = np.array([fit.gemm.seconds(m, k, n) for m, k, n in gemm[["m", "k", "n"]].to_numpy()])
    out["gemm"] = _summary(np.abs(pred / gemm.s.to_numpy() - 1))
    for kind in [*sorted(set(ELEMENTWISE_KIND.values())), POOLED]:
        part = elem[elem.kind.isin(POOLED_KINDS if kind == POOLED else (kind,))]
        pred = np.array([fit.elementwise[kind].seconds(e) for e in part.elements])
        out[kind] = _summary(np.abs(pred / part.s.to_numpy() - 1))
    return out


def _summary(err: np.ndarray) -> dict[str, float]:
    return {
        "rows": len(err),
        "median": round(float(np.median(err)), 4),
        "p90": round(float(np.quantile(err, 0.9)), 4),
        "max": round(float(err.max()), 4),
    }


# ---------------------------------------------------------------------------- writing


def dumps(obj: Any, depth: int = 0) -> str:
    """JSON with a list of numbers on one line (a compact file that still diffs by line)."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + dumps(v, depth + 1) for v in obj) + f"\n{pad}]"
    return json.dumps(obj, separators=(",", ":"))


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else v


def compact_operators(tables: list[Measured], tol: float, max_knots: int):
    """The JSON tables, and each row's relative miss by (linear or not)."""
    out, misses = [], {"gemm": [], "other": []}
    for tab in tables:
        per_tp = {}
        for tp, part in tab.ms.groupby(level="tp"):
            tokens = part.index.get_level_values("num_tokens").to_numpy(float)
            base = token_base(tokens)
            per_op = {}
            for op in part.columns:
                y = part[op].to_numpy(float)
                idx, values, miss = thin(tokens, y, base, tol, max_knots)
                misses["gemm" if op in LINEAR_OPS else "other"].append(miss)
                per_op[op] = {
                    "tokens": [int(tokens[i]) for i in idx],
                    "ms": [_num(v) for v in values],
                    "tail": tail_slope(tokens, y),
                }
            per_tp[str(int(tp))] = per_op
        tokens_all = tab.ms.index.get_level_values("num_tokens")
        out.append(
            {
                "model": tab.model,
                "shape": vars(tab.shape),
                "vocab_size": tab.vocab,
                "num_tokens": [int(tokens_all.min()), int(tokens_all.max())],
                "tp": per_tp,
            }
        )
    return out, {k: np.concatenate(v) for k, v in misses.items()}


def compact_network(groups: dict[tuple[int, int], pd.Series]):
    """Per (num_workers, devices_per_node): knots two per octave, least squares on the
    non-decreasing fit to the rows; and each row's relative miss."""
    out, misses = [], []
    for (workers, dpn), series in sorted(groups.items()):
        sizes = series.index.to_numpy(float)
        y = series.to_numpy(float)
        base = size_base(sizes)
        idx, values, _ = thin(np.log2(sizes), monotone(y), base, math.inf, len(base))
        values = [sig4(v) for v in monotone(np.array(values))]  # a knot fit may dip a little
        misses.append(np.abs(np.interp(np.log2(sizes), np.log2(sizes[idx]), values) / y - 1))
        out.append(
            {
                "num_workers": workers,
                "devices_per_node": dpn,
                "bytes": [int(sizes[i]) for i in idx],
                "ms": [_num(v) for v in values],
            }
        )
    return out, np.concatenate(misses)


def _print_miss(label: str, miss: np.ndarray, tol: float) -> None:
    print(
        f"  {label:<28} rows {len(miss):6d}  median {np.median(miss):6.1%}  "
        f"p90 {np.quantile(miss, 0.9):6.1%}  p99 {np.quantile(miss, 0.99):6.1%}  "
        f"max {miss.max():6.1%}  within {tol:.0%}: {(miss <= tol).mean():6.1%}"
    )


def write_all(vidur: Path, out_dir: Path, tol: float, max_knots: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for gpu in sorted(p.name for p in (vidur / "compute").iterdir() if p.is_dir()):
        tables = read_compute(vidur, gpu)
        compact, misses = compact_operators(tables, tol, max_knots)
        fit = fit_all(tables)
        errors = fit_errors(fit, tables)
        obj = {
            "gpu": gpu,
            "source": {**SOURCE, "path": f"data/profiling/compute/{gpu}/<org>/<model>/mlp.csv"},
            "ops": {op: VIDUR_OPS[op] for op in (*OPS, "emb")},
            "thinning": {"tolerance": tol, "max_knots": max_knots, "knot_values": "least squares"},
            "fit": fit.to_json(),
            "fit_errors": errors,
            "fit_without": {
                t.model: fit_all([u for u in tables if u is not t]).to_json() for t in tables
            },
            "tables": compact,
        }
        path = out_dir / f"operators_{gpu}.json"
        path.write_text(dumps(obj) + "\n")
        print(f"wrote {_shown(path)} ({path.stat().st_size / 1024:.0f} KiB, {len(tables)} models)")
        print(" thinned grid vs every measured row (relative miss):")
        _print_miss("linear ops", misses["gemm"], tol)
        _print_miss("other ops", misses["other"], tol)
        print(f" fit: {fit.gemm.describe()}")
        for kind, e in errors.items():
            print(
                f"  fit {kind:<10} rows {e['rows']:6d}  median {e['median']:6.1%}  "
                f"p90 {e['p90']:6.1%}  max {e['max']:6.1%}"
            )
    for folder in sorted(p for p in (vidur / "network").iterdir() if p.is_dir()):
        gpu, topology = folder.name.split("_", 1)
        obj = {"gpu": gpu, "topology": topology}
        obj["source"] = {**SOURCE, "path": f"data/profiling/network/{folder.name}/<collective>.csv"}
        obj["thinning"] = {
            "knots": "two per octave of size",
            "knot_values": "least squares in log size to the non-decreasing fit of the rows",
        }
        report = []
        for name in ("all_reduce", "send_recv"):
            obj[name], miss = compact_network(read_network(folder / f"{name}.csv"))
            report.append((name, miss))
        path = out_dir / f"collectives_{gpu}_{topology}.json"
        path.write_text(dumps(obj) + "\n")
        print(f"wrote {_shown(path)} ({path.stat().st_size / 1024:.0f} KiB)")
        for name, miss in report:
            _print_miss(name, miss, tol)
    total = sum(p.stat().st_size for p in out_dir.glob("*.json"))
    print(f"total {total / 1024:.0f} KiB in {_shown(out_dir)}")


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "vidur", nargs="?", type=Path, default=DEFAULT_VIDUR, help="vidur-profiles folder"
    )
    ap.add_argument("--out-dir", type=Path, default=DATA_DIR, help="where the JSON files go")
    ap.add_argument("--tol", type=float, default=0.05, help="thinning: largest relative miss")
    ap.add_argument("--max-knots", type=int, default=48, help="thinning: most knots per op")
    args = ap.parse_args(argv)
    if not (args.vidur / "compute").is_dir():
        sys.exit(f"no Vidur profiles at {args.vidur} (expected compute/ and network/ in it)")
    write_all(args.vidur, args.out_dir, args.tol, args.max_knots)


if __name__ == "__main__":
    main()
