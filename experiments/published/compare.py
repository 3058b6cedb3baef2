"""The simulator against published measurements: every point of
``experiments/published/measurements.yaml`` predicted by each latency model
(the GPU operator model and the spec-sheet roofline), with the error of each
measured figure (output throughput, TPOT, TTFT, E2E).

    python -m experiments.published.compare [--models operators roofline]
        [--only ID ...] [--max-requests 400] [--out outputs/published]

Each point runs the workload it gives as a simulation: a fixed concurrency
(closed loop: ``trace=concurrency``), one request at a time, a batch all sent
at once, or a Poisson rate, with the point's lengths (fixed, or a dataset's).
What a source leaves open takes the engine's defaults for its version
(:func:`engine_defaults`), and its engine's CPU overheads by era (:data:`ERAS`);
a client-side TTFT and E2E hold the front end's :data:`FRONT_END_S` (every
point but offline batches). ``roofline_before`` is the roofline as the
simulator had it before this comparison (its entries' old overheads, no eras,
no front end). Each row records its overrides. A point's request count is
capped at ``--max-requests`` (steady-state figures change little past it; the
cap is recorded). Prints the table and the summary (median and largest absolute
error per figure and model, points beyond 25%); writes ``published.csv``,
``published.json``, ``published.png`` and ``manifest.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from experiments.manifest import write_manifest
from testbed.config_schema import compose_config
from testbed.job import run_from_config

TABLE = Path(__file__).with_name("measurements.yaml")
CONF = Path(__file__).resolve().parents[2] / "conf"
MODELS = ("operators", "roofline", "roofline_before")
# The roofline as it was before the operator model: the hardware entries' CPU
# overheads then (the entries now carry published ones).
BEFORE_OVERHEADS = {"a100": (2e-3, 2e-5)}
BEFORE_DEFAULT = (1.5e-3, 2e-5)
# measured figure -> (metrics.json stem, scale to the published unit)
FIGURES = {
    "output_throughput_tok_s": ("throughput_output_tok_s", 1.0),
    "tpot_ms": ("tpot_s", 1e3),
    "ttft_ms": ("ttft_s", 1e3),
    "e2e_s": ("e2e_s", 1.0),
    "itl_ms": ("itl_s", 1e3),
    "request_throughput_req_s": ("throughput_req_s", 1.0),
    "duration_s": ("duration_s", 1.0),
}
TOTALS = ("output_throughput_tok_s", "request_throughput_req_s", "duration_s")
# A source's statistic -> metrics.json's; one it does not name (or a fit's value)
# is compared with the mean.
STATISTIC = {"median": "p50", "p50": "p50", "p90": "p90", "p99": "p99"}


# A dataset a source names, as the lengths its benchmark drew: vLLM's
# benchmark_serving samples ShareGPT's first turns (prompts up to 1,024 tokens,
# prompt + output up to 2,048), averaging 202 input and 179 output tokens with
# Llama-3's tokenizer (vLLM v0.6.0 blog, 2024-09-05); drawn here lognormal with
# those means, the shape an assumption.
DATASETS = {
    "sharegpt": (
        "{dist:lognormal,mean:202,cv:1.0,min:4,max:1024}",
        "{dist:lognormal,mean:179,cv:1.0,min:4,max:1024}",
    )
}
# The CPU overheads of a source's engine (seconds per step, per running request),
# by era, from component measurements (docs/gpu_latency_sources.md): V0 before 0.6;
# 0.6.x with multi-step scheduling and async output processing; V1 synchronous;
# V1 with async scheduling (the default from 0.14).
ERAS = {
    "v0": (2e-3, 1e-4),
    "multi_step": (4e-4, 7.5e-6),
    "v1": (1e-3, 1.5e-5),
    "v1_async": (2e-4, 1.5e-6),
}
# What a client's TTFT holds beyond the engine's (API server, tokenization,
# streaming: vLLM PR #54628), for points measured through the server.
FRONT_END_S = 0.010
OFFLINE = ("offline_batch",)


def era(point: dict[str, Any]) -> str:
    """The engine era of a point: by its version (a V1 blog's 0.7.0 ran V1), else
    by its source's date."""
    title = str((point.get("source") or {}).get("title") or "")
    if point.get("engine_version"):
        v = version(point)
        if v >= (0, 14):
            return "v1_async"
        if v >= (0, 8) or "V1" in title:
            return "v1"
        return "multi_step" if v >= (0, 6) else "v0"
    date = str((point.get("source") or {}).get("date") or "2025")
    if date < "2024-09":
        return "v0"
    if date < "2025-03":
        return "multi_step"
    return "v1" if date < "2026-01" else "v1_async"


def version(point: dict[str, Any]) -> tuple[int, int]:
    """The engine's (major, minor): given, else the V0 engine for a source dated
    before 2025 (V1 became vLLM's default in 0.8, 2025-03), else V1."""
    given = point.get("engine_version")
    if given:
        return tuple(int(x) for x in (str(given).split(".") + ["0"])[:2])  # type: ignore[return-value]
    date = str((point.get("source") or {}).get("date") or "2025")
    return (0, 5) if date < "2025" else (0, 10)


def engine_defaults(point: dict[str, Any]) -> dict[str, int | bool]:
    """vLLM's scheduler limits where a source gives none: V0 (before 0.8) 256
    sequences and no chunked prefill (a step holds whole prompts, up to the
    model's length); V1 (0.8 on) chunked prefill with 1,024 sequences and 8,192
    tokens a step on a GPU of 70 GiB or more other than an A100, else 256 and
    2,048 (vllm/engine/arg_utils.py, the OpenAI server's defaults). SGLang:
    its server's chunked prefill of 8,192 tokens and vLLM V1's sequence limit."""
    big = point.get("gpu_memory_gb", 80) >= 70 and not str(point["gpu"]).startswith("a100")
    if point["engine"] == "vllm" and version(point) < (0, 8):
        return {"max_num_seqs": 256, "enable_chunked_prefill": False}
    return {
        "max_num_seqs": 1024 if big else 256,
        "max_num_batched_tokens": 8192 if big else 2048,
        "enable_chunked_prefill": True,
    }


def workload_overrides(w: dict[str, Any], max_requests: int) -> list[str]:
    """The trace overrides of a point's workload."""
    kind = w["kind"]
    n = int(w.get("num_requests") or max_requests)
    lengths: list[str] = []
    if w.get("prompt_tokens") and w.get("output_tokens"):  # a dataset's name then says how made
        lengths = [
            f"trace.prompt_tokens={w['prompt_tokens']}",
            f"trace.output_tokens={w['output_tokens']}",
        ]
    elif w.get("dataset") in DATASETS:
        prompt, output = DATASETS[w["dataset"]]
        lengths = [f"trace.prompt={prompt}", f"trace.output={output}"]
    elif w.get("dataset"):
        lengths = [f"trace.lengths_from={w['dataset']}"]
    else:
        raise ValueError(f"workload {w}: neither fixed lengths nor a dataset")
    if kind == "single_request":
        return [
            "trace=concurrency",
            "trace.max_concurrency=1",
            f"trace.num_requests={min(n, 5)}",
            *lengths,
        ]
    if kind in ("concurrency", "offline_batch"):
        c = int(w.get("max_concurrency") or n) if kind == "concurrency" else n
        n = min(n, max(max_requests, 2 * min(c, max_requests)))
        return [
            "trace=concurrency",
            f"trace.max_concurrency={min(c, n)}",
            f"trace.num_requests={n}",
            *lengths,
        ]
    if kind == "request_rate":
        rate, n = w.get("request_rate"), min(n, max_requests)
        if rate in (None, "inf", math.inf):  # all at once: a batch
            return [
                "trace=concurrency",
                f"trace.max_concurrency={n}",
                f"trace.num_requests={n}",
                *lengths,
            ]
        if w.get("prompt_tokens"):
            dists = [f"trace.prompt={{dist:fixed,value:{w['prompt_tokens']}}}",
                     f"trace.output={{dist:fixed,value:{w['output_tokens']}}}"]  # fmt: skip
        elif w.get("dataset") in DATASETS:
            dists = lengths
        else:
            return [f"trace={w['dataset']}", f"trace.rate={rate}", f"trace.num_requests={n}"]
        return ["trace=synthetic", f"trace.rate={rate}", f"trace.num_requests={n}", *dists]
    raise ValueError(
        f"workload kind {kind!r}: single_request, concurrency, offline_batch, request_rate"
    )


def point_overrides(point: dict[str, Any], model: str, max_requests: int) -> list[str]:
    w = point["workload"]
    engine = engine_defaults(point)
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if w.get(key):
            engine[key] = int(w[key])
    if not engine.get("enable_chunked_prefill", True) and "max_num_batched_tokens" not in engine:
        hf = yaml.safe_load((CONF / "model" / f"{point['model']}.yaml").read_text())["hf_config"]
        longest = int((w.get("prompt_tokens") or 0) + (w.get("output_tokens") or 0))
        engine["max_num_batched_tokens"] = max(longest, hf["max_position_embeddings"], 2048)
    longest = int((w.get("prompt_tokens") or 0) + (w.get("output_tokens") or 0))
    context = [f"model.hf_config.max_position_embeddings={longest}"] if longest > 8192 else []
    step, request = ERAS[era(point)]
    if model == "roofline_before":  # the simulator before this comparison: its own overheads
        step, request = BEFORE_OVERHEADS.get(point["gpu"], BEFORE_DEFAULT)
        model = "roofline"
    overheads = [f"hardware.step_overhead_s={step}", f"hardware.request_overhead_s={request}"]
    return [
        "mode=sim",
        f"mode.latency_model={model}",
        *overheads,
        *context,
        f"model={point['model']}",
        f"hardware={point['gpu']}",
        f"engine.tensor_parallel_size={point.get('tensor_parallel_size', 1)}",
        f"engine.pipeline_parallel_size={point.get('pipeline_parallel_size', 1)}",
        "engine.enable_prefix_caching=false",
        *(f"engine.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in engine.items()),
        *workload_overrides(w, max_requests),
        "logging=disabled",
        "progress=false",
        "plots=false",
    ]


def predicted(point: dict[str, Any], metrics: dict[str, Any], front_end_s: float) -> dict:
    """The metrics' values of the figures the point measured, in its units; a
    client's TTFT and E2E hold ``front_end_s`` more than the engine's."""
    stats = point.get("statistic") or {}
    out = {}
    for figure in point["measured"]:
        stem, scale = FIGURES[figure]
        if figure in TOTALS:
            out[figure] = metrics[stem] * scale
        else:
            value = metrics[f"{stem}_{STATISTIC.get(stats.get(figure), 'mean')}"]
            if stem in ("ttft_s", "e2e_s"):
                value += front_end_s
            out[figure] = value * scale
    return out


def front_end(point: dict[str, Any], model: str) -> float:
    """The front end's share of a client's TTFT: none offline, nor before this comparison."""
    offline = point["workload"]["kind"] in OFFLINE
    return 0.0 if offline or model == "roofline_before" else FRONT_END_S


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Median and largest absolute error per latency model and figure, and the
    points beyond 25%."""
    out = []
    for (model, figure), g in rows.groupby(["latency_model", "figure"]):
        err = g["error"].abs()
        out.append(
            dict(
                latency_model=model,
                figure=figure,
                points=len(g),
                median_abs_error=err.median(),
                max_abs_error=err.max(),
                beyond_25pct=int((err > 0.25).sum()),
            )
        )
    return pd.DataFrame(out)


def plot(rows: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = sorted(rows["figure"].unique())
    fig, axes = plt.subplots(1, len(figures), figsize=(4.2 * len(figures), 4), squeeze=False)
    for ax, figure in zip(axes[0], figures, strict=True):
        g = rows[rows["figure"] == figure]
        for model, marker in zip(MODELS, "os^", strict=False):
            h = g[g["latency_model"] == model]
            ax.scatter(h["measured"], h["predicted"], marker=marker, label=model, alpha=0.7)
        lo, hi = g[["measured", "predicted"]].min().min(), g[["measured", "predicted"]].max().max()
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.75, 1.25):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", xlabel="published", ylabel="simulated", title=figure)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.published.compare", description=__doc__
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--only", nargs="+", help="point ids")
    ap.add_argument("--max-requests", type=int, default=400)
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--out", type=Path, default=Path("outputs/published"))
    a = ap.parse_args(argv)
    points = yaml.safe_load(a.table.read_text())["points"]
    if a.only:
        points = [p for p in points if p["id"] in a.only]
    rows = []
    for point in points:
        for model in a.models:
            overrides = point_overrides(point, model, a.max_requests)
            run_dir = a.out / "runs" / f"{point['id']}-{model}"
            try:
                m = run_from_config(compose_config(overrides), run_dir)
                pred, note = predicted(point, m, front_end(point, model)), ""
            except Exception as e:  # a point the model cannot price: kept, with why
                pred, note = {f: math.nan for f in point["measured"]}, f"{type(e).__name__}: {e}"
            for figure, value in point["measured"].items():
                rows.append(
                    dict(
                        id=point["id"],
                        gpu=point["gpu"],
                        model=point["model"],
                        tp=point.get("tensor_parallel_size", 1),
                        kind=point["workload"]["kind"],
                        era=era(point),
                        figure=figure,
                        latency_model=model,
                        measured=float(value),
                        predicted=pred[figure],
                        error=pred[figure] / float(value) - 1,
                        note=note,
                        overrides=" ".join(overrides),
                    )
                )
                r = rows[-1]
                print(
                    f"{r['id']:<48} {model:<9} {figure:<24} published {r['measured']:>9.4g} "
                    f"simulated {r['predicted']:>9.4g} ({r['error']:+.0%}) {note}",
                    flush=True,
                )
    df = pd.DataFrame(rows)
    s = summary(df.dropna(subset=["error"]))
    print(s.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "published.csv", index=False)
    (a.out / "published.json").write_text(
        json.dumps(
            {"rows": df.to_dict("records"), "summary": s.to_dict("records")}, indent=1, default=str
        )
    )
    plot(df.dropna(subset=["error"]), a.out / "published.png")
    write_manifest(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
