"""Disaggregated vs colocated serving in the simulator, at equal instance counts:
SLO attainment (the fraction of requests meeting both a TTFT and a TPOT SLO,
DistServe's measure) across offered loads, with each KV link.

For each trace and load (``--rates``: requests per second), one simulation of
``2N`` colocated replicas (least outstanding requests) and one of ``N`` prefill +
``N`` decode replicas per link preset; Llama-3-8B on H200 specs. Goodput at an
attainment target (``--target``, 90%) is the highest load whose attainment
reaches it.

    python -m experiments.disagg_goodput [--traces azure_conv mooncake_conv]
        [--rates 4 8 12 16 24] [--ttft 0.5 --tpot 0.05]

Prints the table; writes ``disagg_goodput.csv``, ``.json`` and ``manifest.json``
to ``--out`` (``outputs/disagg_goodput``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from testbed.config_schema import compose_config
from testbed.job import run_from_config

TRACE_OPTIONS = {"mooncake_conv": ["trace.prompt_scale=0.25"]}


def attainment(run_dir: Path, ttft: float, tpot: float) -> float:
    """Requests that finished within both SLOs, over all requests."""
    df = pd.read_csv(run_dir / "requests.csv")
    ok = (df.ttft_s <= ttft) & (df.tpot_s.fillna(0) <= tpot)
    return float(ok.sum() / len(df))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.disagg_goodput", description=__doc__)
    ap.add_argument("--traces", nargs="+", default=["azure_conv", "mooncake_conv"])
    ap.add_argument("--rates", type=float, nargs="+", default=[4, 8, 12, 16, 24])
    ap.add_argument("--pairs", type=int, default=1, help="N: 2N colocated vs NPND")
    ap.add_argument("--links", nargs="+", default=["nvlink", "pcie", "infiniband"])
    ap.add_argument("--ttft", type=float, default=0.5, help="TTFT SLO (s)")
    ap.add_argument("--tpot", type=float, default=0.05, help="TPOT SLO (s)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path("outputs/disagg_goodput"))
    a = ap.parse_args(argv)
    n = a.pairs
    setups = {
        f"{2 * n} colocated": [f"cluster.num_replicas={2 * n}", "cluster.router=least_outstanding"]
    }
    for link in a.links:
        setups[f"{n}P{n}D {link}"] = [
            "cluster=disagg", f"cluster.num_prefill={n}", f"cluster.num_decode={n}",
            f"cluster.link={link}",
        ]  # fmt: skip
    rows = []
    for trace in a.traces:
        for rate in a.rates:
            for name, overrides in setups.items():
                run_dir = a.out / trace / f"{rate:g}" / name.replace(" ", "_")
                cfg = compose_config(
                    [
                        "mode=sim",
                        "model=llama3-8b",
                        "hardware=h200",
                        f"trace={trace}",
                        *TRACE_OPTIONS.get(trace, []),
                        f"trace.rate={rate}",
                        *overrides,
                        "logging=disabled",
                        "progress=false",
                        "plots=false",
                    ]
                )
                m = run_from_config(cfg, run_dir)
                row = dict(
                    trace=trace,
                    rate=rate,
                    setup=name,
                    attainment=attainment(run_dir, a.ttft, a.tpot),
                    ttft_s_p90=m["ttft_s_p90"],
                    tpot_s_p90=m["tpot_s_p90"],
                    kv_transfer_s_mean=m.get("kv_transfer_s_mean"),
                    overloaded=m.get("overloaded"),
                )
                rows.append(row)
                print(
                    f"{trace:<14} {rate:>5g} req/s  {name:<18} attainment "
                    f"{row['attainment']:.3f}  TTFT p90 {row['ttft_s_p90']:.3f}  "
                    f"TPOT p90 {row['tpot_s_p90']:.4f}",
                    flush=True,
                )
    table = pd.DataFrame(rows)
    goodput = (
        table[table.attainment >= a.target]
        .groupby(["trace", "setup"])["rate"]
        .max()
        .rename("goodput")
    )
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "disagg_goodput.csv", index=False)
    (a.out / "disagg_goodput.json").write_text(
        json.dumps({"rows": rows, "goodput": goodput.reset_index().to_dict("records")}, indent=2)
        + "\n"
    )
    write_manifest(a.out, slo=dict(ttft_s=a.ttft, tpot_s=a.tpot, target=a.target))
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"goodput (highest rate with attainment >= {a.target}):")
    print(goodput.to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
