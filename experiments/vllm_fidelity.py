"""The simulator against vLLM itself on this machine.

``profile``: vLLM's own profile of this hardware and model, from its step log:
every step of mode=vllm replays of the profiler's two synthetic workloads (a busy
one and a sparse one, :mod:`testbed.profiling.replay_steps`), written as a
profile table (``<profiles>/<hardware>/<model>.csv``, header ``engine: vllm
<version>``) that the simulator's profile model fits as it fits this project's
engine's.

``compare``: for each policy and condition (a trace at ``--load`` of vLLM's
capacity, and a burst), a mode=vllm run, then the simulation of the same
requests with vLLM's profile, as predicted (the profile's speed) and at the
run's measured speed (``mode.latency_scale`` = its ``speed_vs_profile``); the
errors on throughput, mean TPOT, mean E2E and p50 TTFT
(:data:`testbed.metrics.fidelity.TARGETS`). Writes ``vllm_fidelity.json``,
``vllm_fidelity.md`` and ``manifest.json`` to ``--out``.

    python -m experiments.vllm_fidelity profile                      # about 3 minutes
    python -m experiments.vllm_fidelity compare --policies fcfs sjf vtc
    python -m experiments.vllm_fidelity report    # the table again from --work's runs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.fidelity.report import markdown_table
from experiments.manifest import write_manifest
from testbed.config_schema import compose_config
from testbed.job import run_from_config
from testbed.metrics.fidelity import TARGETS, metric_errors, target_misses
from testbed.profile_table import profile_path, write_profile
from testbed.profiling.replay_steps import REPLAY_LENGTHS, SPARSE_RATE
from testbed.sim.latency import FEATURES

PROFILES = Path("profiles/vllm")
# Both engines on vLLM's CPU block size, a context the dummy model holds.
COMMON = ["engine.block_size=32", "logging=disabled", "progress=false", "plots=false"]
CONDITIONS = {
    "load": lambda a: [
        f"trace={a.trace}",
        f"trace.num_requests={a.num_requests}",
        f"load={a.load}",
    ],
    "burst": lambda a: ["trace=burst", f"trace.num_requests={a.num_requests}"],
}


def lengths(name: str) -> str:
    spec = REPLAY_LENGTHS[name]
    return f"trace.{name}={{" + ",".join(f"{k}:{v}" for k, v in spec.items()) + "}"


# The profiler's replays (testbed.profiling.replay_steps), busy then sparse, and
# two bursts that stand in for its grid: every request arrives at once, so decode
# steps run at every batch size from the burst's down to one as outputs end, at
# short and at long contexts (a replay's decodes share steps with prefill chunks).
WORKLOADS = {
    "replay": ["trace.num_requests=80", "trace.rate=2.5", lengths("prompt"), lengths("output")],
    "replay_sparse": [
        "trace.num_requests=12", f"trace.rate={SPARSE_RATE}", lengths("prompt"), lengths("output")
    ],
    "burst_short": [
        "trace.num_requests=64", "trace.rate=1000",
        "trace.prompt={dist:lognormal,mean:200,cv:0.5,min:16,max:512}",
        "trace.output={dist:lognormal,mean:120,cv:0.6,min:8,max:240}",
    ],
    "burst_long": [
        "trace.num_requests=32", "trace.rate=1000",
        "trace.prompt={dist:lognormal,mean:1200,cv:0.3,min:600,max:1800}",
        "trace.output={dist:lognormal,mean:100,cv:0.6,min:8,max:240}",
    ],
}  # fmt: skip


def profile(a: argparse.Namespace) -> Path:
    """Replay the workloads on vLLM; their steps as vLLM's profile table (the bursts'
    as replay rows: the fit weighs them as real mixes, not as grid corners)."""
    rows, version, threads, counts = [], None, None, {}
    for grid, overrides in WORKLOADS.items():
        run_dir = a.work / "profile" / grid
        cfg = compose_config(
            ["mode=vllm", *COMMON, "trace=synthetic", "trace.seed=1234", *overrides,
             f"model={a.model}", *a.extra]
        )  # fmt: skip
        metrics = run_from_config(cfg, run_dir)
        version, threads = metrics["vllm_version"], metrics["threads"]
        steps = pd.read_csv(run_dir / "steps.csv")
        steps = steps[steps.num_reqs > 0]
        table = pd.DataFrame({
            "kind": "step", "grid": "replay" if grid.startswith("burst") else grid,
            "num_reqs": steps.num_reqs,
            "num_tokens": steps.num_prefill_tokens + steps.num_decode_tokens,
            "attn_pairs": steps.attn_pairs, "kv_tokens": steps.kv_tokens, "max_kv": steps.max_kv,
            "latency_s": steps.latency_s,
        })  # fmt: skip
        rows.append(table)
        counts[grid] = len(table)
    table = pd.concat(rows, ignore_index=True)
    assert set(FEATURES) <= set(table.columns)
    path = profile_path(a.profiles, "cpu", metrics["model"])
    header = {
        "engine": f"vllm {version} (testbed.vllm_backend.PolicyScheduler, fcfs)",
        "machine": metrics["machine"],
        "hardware": "cpu",
        "model": metrics["model"],
        "dtype": metrics.get("vllm_dtype"),
        "block_size": 32,
        "threads": threads,
        "measured_by": "python -m experiments.vllm_fidelity profile",
        "date": pd.Timestamp.now(tz="UTC").strftime("%Y-%m-%d %H:%M:%S UTC"),
        "steps": f"{len(table)} ({', '.join(f'{g} {n}' for g, n in counts.items())})",
    }
    write_profile(path, header, table)
    print(f"vLLM's profile: {path} ({len(table)} steps)")
    return path


def compare(a: argparse.Namespace) -> dict[str, Any]:
    """Each policy and condition on vLLM, and simulated as predicted and at speed."""
    base = [*COMMON, f"profiles_dir={a.profiles}", f"model={a.model}", *a.extra]
    for condition in a.conditions:
        for policy in a.policies:
            over = [*base, f"policy={policy}", *CONDITIONS[condition](a)]
            work = a.work / f"{condition}-{policy}"
            vllm = run_from_config(compose_config(["mode=vllm", *over]), work / "vllm")
            speed = vllm.get("speed_vs_profile")
            if speed is None:
                raise SystemExit(f"{work}: no speed against vLLM's profile; run `profile` first")
            run_from_config(compose_config(["mode=sim", *over]), work / "sim")
            at_speed = ["mode=sim", *over, f"mode.latency_scale={speed}"]
            run_from_config(compose_config(at_speed), work / "sim_at_speed")
    return collect(a)


def collect(a: argparse.Namespace) -> dict[str, Any]:
    """The errors of the simulations against the vLLM runs under ``--work``."""
    rows = []
    for condition in a.conditions:
        for policy in a.policies:
            work = a.work / f"{condition}-{policy}"
            vllm = json.loads((work / "vllm" / "metrics.json").read_text())
            for variant, folder in (("predicted", "sim"), ("at measured speed", "sim_at_speed")):
                sim = json.loads((work / folder / "metrics.json").read_text())
                errors = metric_errors(sim, vllm, TARGETS)
                rows.append({
                    "condition": condition, "policy": policy, "simulation": variant,
                    "vllm_speed_vs_profile": vllm.get("speed_vs_profile"),
                    **{f"{m}_vllm": vllm.get(m) for m in TARGETS},
                    **{f"{m}_err": e for m, e in errors.items()},
                    "meets": not target_misses(errors),
                    "vllm_finished": vllm["num_finished"], "vllm_rejected": vllm["num_rejected"],
                    "partial": vllm["partial"], "rate_req_s": vllm.get("rate_req_s"),
                })  # fmt: skip
    return {"rows": rows, "targets": TARGETS}


def report(result: dict[str, Any], out: Path, a: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    heads = ["condition", "policy", "simulation", "vLLM speed vs profile"]
    heads += [f"{m} error" for m in TARGETS] + ["within targets"]
    lines = [
        [r["condition"], r["policy"], r["simulation"], f"{r['vllm_speed_vs_profile']:.3f}"]
        + [f"{r[f'{m}_err']:+.1%}" for m in TARGETS]
        + ["yes" if r["meets"] else "no"]
        for r in result["rows"]
    ]
    table = markdown_table(heads, lines, left=3)
    (out / "vllm_fidelity.md").write_text(table)
    print(table)
    runs = f"{a.work}, made by `python -m experiments.vllm_fidelity compare`"
    write_manifest(out, profiles=[profile_path(a.profiles, "cpu", a.model)], runs=runs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["profile", "compare", "report"])
    ap.add_argument("--profiles", type=Path, default=PROFILES, help="vLLM's profiles_dir")
    ap.add_argument("--model", default="dummy-llama")
    ap.add_argument("--policies", nargs="+", default=["fcfs", "sjf", "vtc"])
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    ap.add_argument("--work", type=Path, default=Path("outputs/vllm_fidelity"))
    ap.add_argument("--out", type=Path, default=None, help="default: --work")
    a = ap.parse_args(argv)
    if a.what == "profile":
        profile(a)
        return
    report(compare(a) if a.what == "compare" else collect(a), a.out or a.work, a)


if __name__ == "__main__":
    main()
