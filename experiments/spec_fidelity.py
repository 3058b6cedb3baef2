"""Sim vs real with speculative decoding: one workload on stories260K, real and
simulated, with speculation off, n-gram and the model's own first layers as its
draft.

Each real run (``mode=real``, the engine on this CPU) writes its acceptance
table and proposer time; its simulation reads the table, with the CPU profile of
stories260K (``--profiles``, ``<dir>/<hardware>/tinystories-260k.csv``), and
the proposer's cost: the n-gram proposer's fitted CPU time, and the draft's
passes predicted from the profile of stories260K cut to the draft's 4 layers
(``tinystories-260k.first4.csv`` beside it). Two simulations per run: from the
profiles as they are (the prediction), and at the run's measured speed against
the profile (``speed_vs_profile``; the draft's passes at the run's speed against
the draft's profile, ``spec_draft_speed_vs_profile``: this VM's speed moves by
10-30% within minutes, so a prediction's error is mostly the machine's). Errors
(sim / real - 1, :mod:`testbed.metrics.fidelity`) of throughput, mean TPOT and mean
E2E.

    python -m experiments.spec_fidelity --profiles profiles [--requests 150 --rate 6]

Prints the table; writes ``spec_fidelity.csv``, ``spec_fidelity.json`` and
``manifest.json`` to ``--out`` (``outputs/spec_fidelity``), the runs beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from testbed.config_schema import compose_config
from testbed.job import run_from_config
from testbed.metrics.fidelity import relative_error

K = 3
DRAFT_LAYERS = 4
METHODS = {
    "off": [],
    "ngram": [
        "engine.speculative.method=ngram",
        f"engine.speculative.num_speculative_tokens={K}",
        "engine.speculative.prompt_lookup_min=2",
    ],
    "draft_model": [
        "engine.speculative.method=draft_model",
        f"engine.speculative.num_speculative_tokens={K}",
        "engine.speculative.model=tinystories-260k",
        f"engine.speculative.draft_num_layers={DRAFT_LAYERS}",
    ],
}
METRICS = ("throughput_req_s", "tpot_s_mean", "e2e_s_mean")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.spec_fidelity", description=__doc__)
    ap.add_argument("--profiles", type=Path, default=Path("profiles"))
    ap.add_argument("--hardware", default="cpu1")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second")
    ap.add_argument("--out", type=Path, default=Path("outputs/spec_fidelity"))
    a = ap.parse_args(argv)
    profile = a.profiles / a.hardware / "tinystories-260k.csv"
    draft_profile = profile.with_name(f"tinystories-260k.first{DRAFT_LAYERS}.csv")
    for path, cut in ((profile, ""), (draft_profile, f" mode.num_layers={DRAFT_LAYERS}")):
        if not path.exists():
            raise SystemExit(
                f"no profile at {path} (python run.py mode=profile model=tinystories-260k "
                f"hardware={a.hardware}{cut} profiles_dir={a.profiles})"
            )
    base = [
        "model=tinystories-260k",
        f"hardware={a.hardware}",
        f"profiles_dir={a.profiles.resolve()}",
        f"trace.num_requests={a.requests}",
        f"trace.rate={a.rate}",
        "logging=disabled",
        "progress=false",
        "plots=false",
    ]
    rows = []
    for method, spec in METHODS.items():
        real_dir = a.out / method / "real"
        real = run_from_config(compose_config(["mode=real", *base, *spec]), real_dir)
        sim_spec = list(spec)
        if method != "off":
            sim_spec.append(
                f"engine.speculative.acceptance_table={real_dir / 'spec_acceptance.csv'}"
            )
        if method == "ngram":  # the draft's cost comes from its profile instead
            sim_spec += [
                f"engine.speculative.propose_s_per_step={real['spec_propose_s_per_step']}",
                f"engine.speculative.propose_s_per_request={real['spec_propose_s_per_request']}",
            ]
        speed = real.get("speed_vs_profile", 1.0)
        own_speed = [f"mode.latency_scale={speed}"]
        draft_speed = real.get("spec_draft_speed_vs_profile")
        if draft_speed is not None:  # the draft's passes at its own measured speed
            own_speed.append(f"engine.speculative.draft_latency_scale={draft_speed / speed}")
        for variant, extra in (("profile", []), ("own_speed", own_speed)):
            sim = run_from_config(
                compose_config(["mode=sim", *base, *sim_spec, *extra]), a.out / method / variant
            )
            row = dict(
                method=method, variant=variant, speed_vs_profile=speed, draft_speed=draft_speed
            )
            for m in METRICS:
                row[f"real_{m}"], row[f"sim_{m}"] = real[m], sim[m]
                row[f"err_{m}"] = relative_error(sim[m], real[m])
            if method != "off":
                row["real_acceptance"] = real["spec_acceptance_rate"]
                row["sim_acceptance"] = sim["spec_acceptance_rate"]
            rows.append(row)
            print(
                f"{method:<12} {variant:<10} "
                + "  ".join(f"{m} {row[f'err_{m}']:+.1%}" for m in METRICS),
                flush=True,
            )
    table = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "spec_fidelity.csv", index=False)
    (a.out / "spec_fidelity.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_manifest(a.out, profiles=[profile, draft_profile])
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
