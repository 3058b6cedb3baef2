"""``python -m experiments.vllm_parity``: one stream, both schedulers, compared.

    python -m experiments.vllm_parity --n 3000 --rate 4 --num-gpu-blocks 256
    python -m experiments.vllm_parity --stream my.csv --policy priority --no-reserve-full-isl
    python -m experiments.vllm_parity --policy sjf --vllm-class --num-tenants 3 --ttft-slo-s 5 50

``--vllm-class`` runs vLLM with the policy inside its scheduler
(``testbed.vllm_backend``); without it vLLM runs its own fcfs or priority.

Without ``--stream`` a synthetic one is written (``streams.py``). Prints the
number of identical steps and, at the first divergence, both sides' step; the
control plane's cost per step (schedule + update) on both sides; writes
``ours_steps.csv``, ``vllm_steps.csv``, ``parity.json`` and ``manifest.json``
to ``--out`` (``outputs/vllm_parity``). Exit status 1 when a step differs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from experiments.manifest import write_manifest
from experiments.vllm_parity.compare import Comparison, compare
from experiments.vllm_parity.ours import OurRun, run_ours
from experiments.vllm_parity.reference import POLICY_CLASS, ReferenceRun, Settings, run_vllm
from experiments.vllm_parity.streams import StreamSpec, write_stream
from policies import REGISTRY


def run_pair(
    stream: Path, settings: Settings, out: Path
) -> tuple[Comparison, OurRun, ReferenceRun]:
    """Both schedulers on ``stream``; their comparison and runs."""
    ours = run_ours(stream, settings, out)
    theirs = run_vllm(stream, settings, out)
    return compare(ours.steps_csv, theirs.steps_csv), ours, theirs


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.vllm_parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("outputs/vllm_parity"))
    p.add_argument("--stream", type=Path, help="a stream CSV (the replay tool's format)")
    g = p.add_argument_group("a synthetic stream (without --stream)")
    d = StreamSpec()
    g.add_argument("--n", type=int, default=d.n)
    g.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per step")
    g.add_argument("--prompt", type=int, nargs=2, default=d.prompt)
    g.add_argument("--output", type=int, nargs=2, default=d.output)
    g.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    g.add_argument("--share-frac", type=float, default=d.share_frac)
    g.add_argument("--priority-classes", type=int, default=d.priority_classes)
    g.add_argument("--num-tenants", type=int, default=d.num_tenants)
    g.add_argument(
        "--ttft-slo-s", type=float, nargs=2, default=d.ttft_slo_s, help="a TTFT SLO range"
    )
    g.add_argument("--stream-seed", type=int, default=d.seed)
    e = p.add_argument_group("the engine (both sides)")
    s = Settings()
    e.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    e.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    e.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=s.num_gpu_blocks,
        help="vLLM's (one is its null block)",
    )
    e.add_argument("--block-size", type=int, default=s.block_size)
    b = argparse.BooleanOptionalAction
    e.add_argument("--enable-chunked-prefill", action=b, default=s.enable_chunked_prefill)
    e.add_argument("--enable-prefix-caching", action=b, default=s.enable_prefix_caching)
    e.add_argument("--long-prefill-token-threshold", type=int, default=0)
    e.add_argument("--reserve-full-isl", action=b, default=s.reserve_full_isl)
    e.add_argument("--policy", choices=sorted(REGISTRY), default=s.policy)
    e.add_argument(
        "--policy-args", default=s.policy_args, help="the policy's arguments, as a JSON object"
    )
    e.add_argument(
        "--vllm-class",
        nargs="?",
        const=POLICY_CLASS,
        default=None,
        help=f"run the policy inside vLLM with this scheduler class (default {POLICY_CLASS})",
    )
    e.add_argument(
        "--forget-uncomputed",
        action="store_true",
        help="with --vllm-class: unfind the blocks a victim preempted after its scheduling "
        "in the same step had cached (never written), as our KV manager does",
    )
    e.add_argument("--max-model-len", type=int, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out: Path = a.out
    stream = a.stream
    if stream is None:
        spec = StreamSpec(
            n=a.n,
            rate=a.rate,
            prompt=tuple(a.prompt),
            output=tuple(a.output),
            hash_block=a.block_size,
            num_prefixes=a.num_prefixes,
            share_frac=a.share_frac,
            priority_classes=a.priority_classes,
            num_tenants=a.num_tenants,
            ttft_slo_s=tuple(a.ttft_slo_s) if a.ttft_slo_s else None,
            seed=a.stream_seed,
        )
        stream = write_stream(spec, out / "stream.csv")
    settings = Settings(
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        num_gpu_blocks=a.num_gpu_blocks,
        block_size=a.block_size,
        enable_chunked_prefill=a.enable_chunked_prefill,
        enable_prefix_caching=a.enable_prefix_caching,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        reserve_full_isl=a.reserve_full_isl,
        policy=a.policy,
        policy_args=a.policy_args,
        vllm_class=a.vllm_class,
        forget_uncomputed=a.forget_uncomputed,
        max_model_len=a.max_model_len,
    )
    result, ours, theirs = run_pair(stream, settings, out)
    print(result.summary())
    print(
        f"control plane, schedule + update per step: ours {ours.ms_per_step:.3f} ms, "
        f"vLLM {theirs.ms_per_step} ms"
        + (
            f" (ours / vLLM {ours.ms_per_step / theirs.ms_per_step:.2f})"
            if theirs.ms_per_step
            else ""
        )
    )
    record = {
        "stream": str(stream),
        "settings": asdict(settings),
        "steps_vllm": result.steps_vllm,
        "steps_ours": result.steps_ours,
        "identical_steps": result.identical,
        "first_divergence": result.first_divergence,
        "first_fields": result.first_fields,
        "differing_steps_by_field": result.differing,
        "ms_per_step_ours": ours.ms_per_step,
        "ms_per_step_vllm": theirs.ms_per_step,
        "unfinished_ours": ours.unfinished,
    }
    (out / "parity.json").write_text(json.dumps(record, indent=2) + "\n")
    write_manifest(out)
    return 0 if result.same else 1
