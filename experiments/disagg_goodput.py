"""Disaggregated vs colocated serving in the simulator, at equal instance counts:
goodput under TTFT and TPOT SLOs (DistServe's measure: the highest load at which
a target fraction of requests meets both) across offered loads, P:D ratios and
KV links.

For each trace, load (``--rates``: requests per second *per instance*) and shape
(``--shapes``, e.g. ``1P1D 4P4D 2P6D``), one simulation of the shape with each
link (``--links``: presets, or ``name=bytes/s`` for a slower network; the first
link only for the shapes after the first two) and
one of as many colocated replicas (least outstanding requests), on the trace's
first ``--num-requests`` requests. Attainment is
counted for every SLO pair of ``--slos`` (``ttft:tpot`` in seconds) from the same
runs. ``--model`` / ``--hardware``: Llama-3-8B on H200 specs by default.

    python -m experiments.disagg_goodput [--traces azure_conv mooncake_conv]
        [--rates 2 4 8 16] [--shapes 1P1D 4P4D 2P6D] [--slos 0.5:0.05 0.5:0.02]
        [--num-requests 4000] [--model qwen3-0.6b]

Prints the tables; writes ``disagg_goodput.csv`` (one row per run and SLO),
``goodput.csv`` and ``disagg_goodput.json`` and ``manifest.json`` to ``--out``
(``outputs/disagg_goodput``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from testbed.config_schema import compose_config
from testbed.job import run_from_config

TRACE_OPTIONS = {"mooncake_conv": ["trace.prompt_scale=0.25"]}


def parse_shape(shape: str) -> tuple[int, int]:
    """``"2P6D"`` -> (2, 6)."""
    m = re.fullmatch(r"(\d+)P(\d+)D", shape)
    if not m:
        raise SystemExit(f"--shapes: {shape!r} is not of the form <P>P<D>D (e.g. 1P1D)")
    return int(m.group(1)), int(m.group(2))


def parse_slo(slo: str) -> tuple[float, float]:
    """``"0.5:0.05"`` -> (TTFT s, TPOT s)."""
    try:
        ttft, tpot = (float(x) for x in slo.split(":"))
    except ValueError:
        raise SystemExit(f"--slos: {slo!r} is not of the form <ttft s>:<tpot s>") from None
    return ttft, tpot


def attainment(df: pd.DataFrame, ttft: float, tpot: float) -> float:
    """Requests that finished within both SLOs, over all requests (a refused or
    unfinished request misses)."""
    ok = (df.ttft_s <= ttft) & (df.tpot_s.fillna(0) <= tpot)
    return float(ok.sum() / len(df))


def parse_link(link: str) -> tuple[str, list[str]]:
    """``"nvlink"`` (a preset) or ``"10GbE=1.25e9"`` (the infiniband preset's
    latency with this bandwidth, bytes/s) -> (name, overrides)."""
    if "=" not in link:
        return link, [f"cluster.link={link}"]
    name, bandwidth = link.split("=", 1)
    return name, ["cluster.link=infiniband", f"cluster.link_bandwidth_bytes_s={bandwidth}"]


def setups(shapes: list[str], links: list[str]) -> dict[str, tuple[int, list[str]]]:
    """Every run's name -> (instances, overrides): each shape with each link (the
    first link alone past the first two shapes), and colocated at each size."""
    out: dict[str, tuple[int, list[str]]] = {}
    for i, shape in enumerate(shapes):
        p, d = parse_shape(shape)
        coloc = f"{p + d} colocated"
        out.setdefault(
            coloc, (p + d, [f"cluster.num_replicas={p + d}", "cluster.router=least_outstanding"])
        )
        for link in links if i < 2 else links[:1]:
            name, overrides = parse_link(link)
            out[f"{shape} {name}"] = (
                p + d,
                [
                    "cluster=disagg", f"cluster.num_prefill={p}", f"cluster.num_decode={d}",
                    *overrides,
                ],
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.disagg_goodput", description=__doc__)
    ap.add_argument("--traces", nargs="+", default=["azure_conv", "mooncake_conv"])
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16],
                    help="offered load per instance (req/s)")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=4000, help="each trace's first N")
    ap.add_argument("--keep-steps", action="store_true", help="keep each run's steps.csv")
    ap.add_argument("--shapes", nargs="+", default=["1P1D", "4P4D", "2P6D"])
    ap.add_argument(
        "--links", nargs="+", default=["nvlink", "pcie", "infiniband", "10GbE=1.25e9"],
        help="link presets, or name=bandwidth (bytes/s) on the infiniband preset's latency",
    )  # fmt: skip
    ap.add_argument("--slos", nargs="+", default=["0.5:0.05", "0.5:0.02", "1:0.012"])
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--out", type=Path, default=Path("outputs/disagg_goodput"))
    a = ap.parse_args(argv)
    slos = [parse_slo(s) for s in a.slos]
    rows = []
    for trace in a.traces:
        for rate in a.rates:
            for name, (n, overrides) in setups(a.shapes, a.links).items():
                run_dir = a.out / a.model / trace / f"{rate:g}" / name.replace(" ", "_")
                cfg = compose_config(
                    [
                        "mode=sim",
                        f"model={a.model}",
                        f"hardware={a.hardware}",
                        f"trace={trace}",
                        *TRACE_OPTIONS.get(trace, []),
                        f"trace.rate={rate * n}",
                        f"trace.num_requests={a.num_requests}",
                        *overrides,
                        *a.extra,
                        "logging=disabled",
                        "progress=false",
                        "plots=false",
                    ]
                )
                m = run_from_config(cfg, run_dir)
                df = pd.read_csv(run_dir / "requests.csv", usecols=["ttft_s", "tpot_s"])
                if not a.keep_steps:  # tens of MB per run, not read here
                    (run_dir / "steps.csv").unlink(missing_ok=True)
                base = dict(
                    model=a.model, trace=trace, rate_per_instance=rate, setup=name, instances=n,
                    ttft_s_p90=m["ttft_s_p90"], tpot_s_p90=m["tpot_s_p90"],
                    kv_transfer_s_mean=m.get("kv_transfer_s_mean"),
                    kv_link_utilization_max=m.get("kv_link_utilization_max"),
                )  # fmt: skip
                att = [attainment(df, ttft, tpot) for ttft, tpot in slos]
                for (ttft, tpot), value in zip(slos, att, strict=True):
                    rows.append(dict(base, ttft_slo_s=ttft, tpot_slo_s=tpot, attainment=value))
                print(
                    f"{trace:<14} {rate:>4g}/inst  {name:<20} attainment "
                    + " ".join(f"{v:.3f}" for v in att)
                    + f"  TTFT p90 {m['ttft_s_p90']:.3f}  TPOT p90 {m['tpot_s_p90']:.4f}",
                    flush=True,
                )
    table = pd.DataFrame(rows)
    keys = ["model", "trace", "ttft_slo_s", "tpot_slo_s", "setup"]
    met = table[table.attainment >= a.target].groupby(keys)["rate_per_instance"].max()
    goodput = (
        table.groupby(keys)["instances"].first().to_frame().join(met.rename("goodput_per_inst"))
    ).fillna({"goodput_per_inst": 0.0})
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "disagg_goodput.csv", index=False)
    goodput.reset_index().to_csv(a.out / "goodput.csv", index=False)
    (a.out / "disagg_goodput.json").write_text(
        json.dumps({"rows": rows, "goodput": goodput.reset_index().to_dict("records")}, indent=2)
        + "\n"
    )
    write_manifest(a.out, slos=a.slos, target=a.target, rates_per_instance=a.rates)
    print(f"goodput per instance (highest load with attainment >= {a.target}; 0: none met):")
    wide = goodput.goodput_per_inst.unstack("setup")
    print(wide.to_string(float_format=lambda x: f"{x:g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
