"""``python -m experiments.vllm_parity.matrix``: the comparison over a matrix of
streams and settings (sizes, prefix sharing, tight and roomy caches, the
long-prefill cap, both reservation settings, chunked prefill and prefix caching
off, the priority policy, a large batch), then each bundled policy inside
vLLM's scheduler (``testbed.vllm_backend``, the ``in-vllm`` cases, on streams
with tenants, priorities, TTFT deadlines and shared prefixes), with
both control planes' cost per step. Prints a table; writes ``matrix.csv``,
``matrix.md``, ``matrix.json`` and ``manifest.json`` to ``--out``
(``outputs/vllm_parity_matrix``).

    python -m experiments.vllm_parity.matrix            # every case (about 10 minutes here)
    python -m experiments.vllm_parity.matrix --only fcfs-3000 priority-1000
    python -m experiments.vllm_parity.matrix --in-vllm   # in-vllm cases, stock on their stream
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from experiments.fidelity.report import markdown_table
from experiments.manifest import write_manifest
from experiments.vllm_parity.cli import run_pair
from experiments.vllm_parity.compare import read_steps
from experiments.vllm_parity.reference import POLICY_CLASS, Settings
from experiments.vllm_parity.streams import StreamSpec, write_stream

S = StreamSpec
CASES: dict[str, tuple[StreamSpec, Settings]] = {
    "fcfs-50": (S(n=50), Settings()),
    "fcfs-500": (S(n=500, seed=2), Settings()),
    "fcfs-3000": (S(n=3000, seed=3), Settings()),
    "first-chunk-3000": (S(n=3000, seed=3), Settings(reserve_full_isl=False)),
    "tight-cache-3000": (S(n=3000, seed=3), Settings(num_gpu_blocks=48)),
    "tight-first-chunk-3000": (
        S(n=3000, seed=3),
        Settings(num_gpu_blocks=48, reserve_full_isl=False),
    ),
    "threshold-3000": (S(n=3000, seed=4), Settings(long_prefill_token_threshold=64)),
    "threshold-tight-3000": (
        S(n=3000, seed=4),
        Settings(
            long_prefill_token_threshold=100,
            num_gpu_blocks=60,
            block_size=32,
            reserve_full_isl=False,
        ),
    ),
    "shared-prefixes-2000": (
        S(n=2000, share_frac=0.9, num_prefixes=2, seed=5),
        Settings(num_gpu_blocks=100),
    ),
    "no-chunked-prefill-2000": (
        S(n=2000, prompt=(20, 900), seed=6),
        Settings(
            enable_chunked_prefill=False,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            num_gpu_blocks=200,
        ),
    ),
    "no-prefix-caching-2000": (
        S(n=2000, seed=7),
        Settings(enable_prefix_caching=False, num_gpu_blocks=80),
    ),
    "priority-1000": (
        S(n=1000, priority_classes=3, seed=8),
        Settings(policy="priority"),
    ),
    "priority-tight-2000": (
        S(n=2000, priority_classes=4, seed=9),
        Settings(policy="priority", num_gpu_blocks=64, reserve_full_isl=False),
    ),
    "priority-threshold-2000": (
        S(n=2000, priority_classes=4, seed=10),
        Settings(
            policy="priority",
            num_gpu_blocks=400,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
            long_prefill_token_threshold=128,
        ),
    ),
    "large-batch-3000": (
        S(n=3000, rate=16.0, share_frac=0.7, seed=11),
        Settings(max_num_seqs=256, max_num_batched_tokens=4096, num_gpu_blocks=2000),
    ),
}

# A testbed policy inside vLLM's scheduler: tenants, priorities, deadlines, prefixes.
MIXED = S(
    n=2000,
    rate=2.0,
    share_frac=0.6,
    priority_classes=4,
    num_tenants=4,
    ttft_slo_s=(5.0, 60.0),
    seed=12,
)
IN_VLLM = ("fcfs", "priority", "sjf", "edf", "vtc", "cache_aware_sjf", "srpt", "mlfq")


def in_vllm(policy: str, args: str = "{}", **settings) -> Settings:
    return Settings(policy=policy, policy_args=args, vllm_class=POLICY_CLASS, **settings)


# Stock vLLM on the in-vllm cases' stream and settings: the class's cost per step
# is the in-vllm case's vLLM time over these (fcfs and priority schedule alike).
for _p in ("fcfs", "priority"):
    CASES[f"{_p}-stock-mixed-roomy-2000"] = (MIXED, Settings(policy=_p, num_gpu_blocks=512))
    CASES[f"{_p}-stock-mixed-tight-2000"] = (MIXED, Settings(policy=_p, num_gpu_blocks=64))

# vLLM keeps a same-step victim's never-written blocks findable; the testbed does
# not (sjf, edf and cache_aware_sjf part in the *-threshold cases): the class's
# forget_uncomputed does as the testbed.
for _p in ("sjf", "edf", "cache_aware_sjf"):
    CASES[f"{_p}-in-vllm-threshold-forget-2000"] = (
        MIXED,
        in_vllm(_p, num_gpu_blocks=128, long_prefill_token_threshold=64, forget_uncomputed=True),
    )

for _p in IN_VLLM:
    CASES[f"{_p}-in-vllm-roomy-2000"] = (MIXED, in_vllm(_p, num_gpu_blocks=512))
    CASES[f"{_p}-in-vllm-tight-2000"] = (MIXED, in_vllm(_p, num_gpu_blocks=64))
    CASES[f"{_p}-in-vllm-threshold-2000"] = (
        MIXED,
        in_vllm(_p, num_gpu_blocks=128, long_prefill_token_threshold=64),
    )
CASES.update(
    {
        "edf-reject-late-in-vllm-2000": (MIXED, in_vllm("edf", '{"reject_late": true}')),
        "sjf-aging-in-vllm-2000": (
            MIXED,
            in_vllm("sjf", '{"aging_tokens_per_s": 2.0}', num_gpu_blocks=64),
        ),
        "priority-aging-in-vllm-2000": (
            MIXED,
            in_vllm("priority", '{"aging_interval_s": 20.0}', num_gpu_blocks=64),
        ),
        "vtc-lowest-rank-in-vllm-2000": (
            MIXED,
            in_vllm("vtc", '{"victim": "lowest_rank"}', num_gpu_blocks=64),
        ),
        # MLFQ promoting a request that waited 50 steps (the replay's clock) to the top.
        "mlfq-starvation50-in-vllm-2000": (
            MIXED,
            in_vllm("mlfq", '{"starvation_s": 50.0}', num_gpu_blocks=64),
        ),
        "cache-aware-sjf-share0.9-in-vllm-2000": (
            S(n=2000, rate=2.0, share_frac=0.9, num_prefixes=2, num_tenants=4, seed=13),
            in_vllm("cache_aware_sjf", num_gpu_blocks=128),
        ),
    }
)


def run_matrix(names: list[str], out: Path) -> pd.DataFrame:
    rows = []
    for name in names:
        spec, settings = CASES[name]
        folder = out / name
        stream = write_stream(spec, folder / "stream.csv")
        result, ours, theirs = run_pair(stream, settings, folder)
        preempting = sum(1 for row in read_steps(theirs.steps_csv).values() if row["preempted"])
        rows.append(
            dict(
                case=name,
                policy=settings.policy
                + ("" if settings.policy_args in ("", "{}") else f" {settings.policy_args}"),
                in_vllm=settings.vllm_class is not None,
                requests=spec.n,
                steps_vllm=result.steps_vllm,
                identical_steps=result.identical,
                first_divergence=result.first_divergence,
                steps_preempting=preempting,
                ms_per_step_ours=round(ours.ms_per_step, 4),
                ms_per_step_vllm=theirs.ms_per_step,
                ours_over_vllm=round(ours.ms_per_step / theirs.ms_per_step, 3)
                if theirs.ms_per_step
                else None,
                stream=asdict(spec),
                settings=asdict(settings),
            )
        )
        print(
            f"{name:<26} {result.identical:>6} of {result.steps_vllm:>6} steps identical; "
            f"{preempting:>5} preempting; ms/step ours {ours.ms_per_step:.3f}, "
            f"vLLM {theirs.ms_per_step}",
            flush=True,
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.vllm_parity.matrix", description=__doc__
    )
    p.add_argument("--out", type=Path, default=Path("outputs/vllm_parity_matrix"))
    p.add_argument("--only", nargs="+", choices=sorted(CASES), help="these cases only")
    p.add_argument(
        "--in-vllm",
        action="store_true",
        help="the policy-in-vLLM cases, and stock vLLM on their stream",
    )
    a = p.parse_args(argv)
    names = a.only or [n for n in CASES if not a.in_vllm or "-in-vllm" in n or "-mixed-" in n]
    table = run_matrix(names, a.out)
    flat = table.drop(columns=["stream", "settings"])
    flat.to_csv(a.out / "matrix.csv", index=False)
    cells = [["" if pd.isna(v) else str(v) for v in row] for row in flat.itertuples(index=False)]
    (a.out / "matrix.md").write_text(markdown_table(list(flat.columns), cells, left=1))
    (a.out / "matrix.json").write_text(json.dumps(table.to_dict("records"), indent=2) + "\n")
    write_manifest(a.out)
    print(flat.to_string(index=False))
    return 0 if (table.first_divergence.isna()).all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
