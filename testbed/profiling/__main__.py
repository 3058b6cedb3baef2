"""Profile without Hydra (for a bare CUDA machine):

    python -m testbed.profiling --model llama3-8b --hardware h200 --out profiles

The same measurement as ``python run.py mode=profile``; writes
``<out>/<hardware>/<model>.csv``.
"""

from __future__ import annotations

import argparse

from testbed.engine.args import EngineArgs
from testbed.engine.factory import engine_model
from testbed.profiling.fit_report import report_profile
from testbed.profiling.grid import GRID_CHOICES
from testbed.profiling.profiler import run_profile
from testbed.signals import ended_by_interrupts


def main() -> None:
    ap = argparse.ArgumentParser(description="Measure the real engine's step latencies.")
    ap.add_argument("--model", default="dummy-llama", help="a conf/model name or an HF folder")
    ap.add_argument("--hardware", default="cpu", help="the profile's hardware name")
    ap.add_argument(
        "--grid", default="auto", choices=GRID_CHOICES, help="auto: gpu on a GPU, else default"
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--replay-requests", type=int, default=80)
    ap.add_argument(
        "--replay-sparse-requests", type=int, default=0,
        help="also replay this many at a low rate (small batches at every context; "
        "mode.replay_sparse_requests, 12 by default in run.py)",
    )  # fmt: skip
    ap.add_argument(
        "--num-layers", type=int, default=None,
        help="profile the model cut to its first N layers (a self-speculation draft; "
        "writes <model>.first<N>.csv)",
    )  # fmt: skip
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--out", default="profiles")
    ap.add_argument(
        "--max-grid-seconds",
        type=float,
        default=None,
        help="start no grid point after this many seconds of the grid (the rest are "
        "skipped and named in the header; the replay still runs)",
    )
    args = ap.parse_args()
    engine = EngineArgs(model=args.model, device=args.device, num_kv_blocks=args.num_kv_blocks)
    model = engine_model(args.model, args.num_layers)
    with ended_by_interrupts():
        path = run_profile(
            engine,
            args.grid,
            args.repeats,
            args.warmup,
            args.out,
            args.hardware,
            model[2],
            model=model,
            replay_requests=args.replay_requests,
            sparse_requests=args.replay_sparse_requests,
            max_grid_s=args.max_grid_seconds,
        )
    report_profile(path)


if __name__ == "__main__":
    main()
