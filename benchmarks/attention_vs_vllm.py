"""Our CPU paged-attention kernel against vLLM's CPU attention kernel, on the same
inputs: prompts (causal, whole or in chunks after cached keys) and decodes.

Dummy Llama attention (8 query heads, 4 KV heads, head dim 64), blocks of 32
drawn at random from a cache of 2,048, float32 and bfloat16. This process makes
every case's queries, keys and values once and saves them; each side writes the
keys and values into its own cache layout with its own cache-write op, then
times its kernel: ours in this process (``cpu_attention.paged_attention_prefill``
/ ``_decode``, the C++ kernel), vLLM's (``cpu_attention_with_kv_cache``, the
``vec`` ISA its CPU backend picks on a CPU without AMX) in vLLM's own
environment (``.venv-vllm``, this file started there with ``--side vllm``).
Rounds alternate the sides, each a median of repeats after warm-up, the same
thread count on both; the two outputs are compared (``max_abs_diff``), so both
did the same work. GFLOP/s counts the causal (query, key) pairs, 4 x head dim
FLOPs a pair and query head. Skips vLLM, with the install command, where its
environment is absent.

    python benchmarks/attention_vs_vllm.py [--rounds 3] [--threads 2] \\
        [--out benchmarks/results/attention_vs_vllm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from timing import median_s

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 8, 4, 64, 32, 2048
DTYPES = ("float32", "bfloat16")


def shapes() -> dict[str, tuple[list[int], list[int]]]:
    """name: (keys per sequence, query rows per sequence: its last positions)."""
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(100, 501, (48,), generator=gen).tolist()
    burst = torch.randint(20, 71, (45,), generator=gen).tolist()
    return {
        "one prompt of 2,048": ([2048], [2048]),
        "4 prompts of 1,000": ([1000] * 4, [1000] * 4),
        "2 chunks of 512 after 1,536": ([2048] * 2, [512] * 2),
        "16 prompts of 128": ([128] * 16, [128] * 16),
        "45 prompts of 20-70": (burst, burst),
        "48 decodes, contexts 100-500": (contexts, [1] * 48),
    }


def gflop(keys: list[int], rows: list[int]) -> float:
    pairs = sum(sum(n - q + j + 1 for j in range(q)) for n, q in zip(keys, rows))
    return pairs * HEADS * 4 * HEAD_DIM / 1e9


def make_inputs(keys: list[int], rows: list[int], dtype: torch.dtype, seed: int) -> dict:
    """One case's tensors: queries, every key's K and V rows, their cache slots."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in keys)
    order = torch.randperm(NUM_BLOCKS, generator=gen)[: width * len(keys)]
    tables = order.view(len(keys), width).to(torch.int32)
    slots = torch.cat(
        [
            tables[i, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
            for i, n in enumerate(keys)
        ]
    )
    total = sum(keys)
    return dict(
        query=torch.randn(sum(rows), HEADS, HEAD_DIM, generator=gen).to(dtype),
        key=torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
        value=torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
        slots=slots,
        tables=tables,
        starts=torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32),
        lens=torch.tensor(keys, dtype=torch.int32),
        decode=max(rows) == 1,
    )


def ours(t: dict):
    """Our kernel's call on a case, K/V in our cache ([blocks, block, KV heads, dim])."""
    from testbed.kernels import cpu_attention, cpu_native

    dtype = t["query"].dtype
    kc, vc = (torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in "kv")
    cpu_native.layer_ops().reshape_and_cache(t["key"], t["value"], kc, vc, t["slots"])
    scale, q = HEAD_DIM**-0.5, t["query"]
    if t["decode"]:
        return lambda: cpu_attention.paged_attention_decode(
            q, kc, vc, t["tables"], t["lens"], scale
        )
    return lambda: cpu_attention.paged_attention_prefill(
        q, kc, vc, t["tables"], t["starts"], t["lens"], scale
    )


def vllm(t: dict):
    """vLLM's kernel on a case, K/V in its cache ([blocks, KV heads, 2 x block, dim])."""
    import vllm._custom_ops as ops

    kv = torch.zeros(NUM_BLOCKS, KV_HEADS, 2 * BLOCK, HEAD_DIM, dtype=t["query"].dtype)
    kc, vc = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(t["key"], t["value"], kc, vc, t["slots"], "vec")
    out = torch.empty_like(t["query"])
    plan = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(t["lens"]),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        seq_lens=t["lens"],
        dtype=t["query"].dtype,
        query_start_loc=t["starts"],
        causal=True,
        sliding_window_size=-1,
        isa="vec",
        enable_kv_split=True,
    )

    def call():
        ops.cpu_attention_with_kv_cache(
            query=t["query"],
            key_cache=kc,
            value_cache=vc,
            output=out,
            query_start_loc=t["starts"],
            seq_lens=t["lens"],
            scale=HEAD_DIM**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=t["tables"],
            softcap=0.0,
            scheduler_metadata=plan,
            s_aux=None,
        )
        return out

    return call


def measure(side: str, cases: dict, repeats: int) -> tuple[dict, dict]:
    """({case: ms}, {case: output}) for one side, in this process."""
    build = ours if side == "ours" else vllm
    times, outputs = {}, {}
    for case, tensors in cases.items():
        fn = build(tensors)
        outputs[case] = fn().clone()
        times[case] = median_s(fn, repeats, warmup=3) * 1e3
    return times, outputs


def vllm_round(python: Path, folder: Path, threads: int, repeats: int) -> dict:
    """One round of vLLM's side in its environment; its outputs left in ``folder``."""
    cmd = [str(python), __file__, "--side", "vllm", "--folder", str(folder)]
    cmd += ["--threads", str(threads), "--repeats", str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> None:
    print(f"\n{'dtype':9s} {'shape':30s} {'ours ms':>8s} {'vLLM ms':>8s} {'ours/vLLM':>9s}")
    for row in rows:
        cells = [f"{row[k]:8.2f}" if k in row else f"{'-':>8s}" for k in ("ours_ms", "vllm_ms")]
        ratio = f"{row['ours_over_vllm']:8.2f}x" if "ours_over_vllm" in row else ""
        print(f"{row['dtype']:9s} {row['shape']:30s} {' '.join(cells)} {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["both", "vllm"], default="both")
    ap.add_argument("--folder", help="(--side vllm) where the inputs are and outputs go")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/attention_vs_vllm.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side == "vllm":  # in vLLM's environment: one line of JSON, outputs saved
        folder = Path(args.folder)
        times, outputs = measure("vllm", torch.load(folder / "inputs.pt"), args.repeats)
        torch.save(outputs, folder / "vllm_outputs.pt")
        print(json.dumps([[list(case), ms] for case, ms in times.items()]))
        return

    from common import write_results

    from testbed.vllm_backend import install

    threads = torch.get_num_threads()
    python = install.python() if install.ready() else None
    skipped = None if python else f"vLLM's environment is not set up; run `{install.COMMAND}`"
    if skipped:
        print(f"vLLM skipped: {skipped}")
    cases = {
        (dtype, name): make_inputs(keys, rows, getattr(torch, dtype), seed)
        for dtype in DTYPES
        for seed, (name, (keys, rows)) in enumerate(shapes().items())
    }
    rounds: dict[str, list[dict]] = {"ours": [], "vllm": []}
    our_outputs, their_outputs, interrupted = {}, {}, False
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.save(cases, folder / "inputs.pt")
        try:
            for r in range(args.rounds):
                for side in ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours"):
                    if side == "ours":
                        times, our_outputs = measure("ours", cases, args.repeats)
                    elif python:
                        got = vllm_round(python, folder, threads, args.repeats)
                        times = {tuple(k): v for k, v in got}
                        their_outputs = torch.load(folder / "vllm_outputs.pt")
                    else:
                        continue
                    rounds[side].append(times)
                    print(f"round {r}: {side} done", flush=True)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: writing the rounds measured so far")
    rows = []
    for (dtype, name), tensors in cases.items():
        keys, rows_ = tensors["lens"].tolist(), (tensors["starts"].diff()).tolist()
        row = dict(dtype=dtype, shape=name, gflop=gflop(keys, rows_))
        for side, runs in rounds.items():
            if runs:
                row[f"{side}_ms_rounds"] = [run[(dtype, name)] for run in runs]
                row[f"{side}_ms"] = statistics.median(row[f"{side}_ms_rounds"])
                row[f"{side}_gflop_s"] = row["gflop"] / row[f"{side}_ms"] * 1e3
        if "ours_ms" in row and "vllm_ms" in row:
            row["ours_over_vllm"] = row["ours_ms"] / row["vllm_ms"]
            ours_out = our_outputs[(dtype, name)].float()
            row["max_abs_diff"] = (
                (ours_out - their_outputs[(dtype, name)].float()).abs().max().item()
            )
            row["max_abs"] = ours_out.abs().max().item()
        rows.append(row)
    table(rows)
    write_results(
        args.out,
        "attention_vs_vllm",
        rows,
        threads=threads,
        rounds=args.rounds,
        repeats=args.repeats,
        vllm_skipped=skipped,
        interrupted=interrupted,
    )
    if interrupted:
        sys.exit(130)  # as a shell reports an interrupted command


if __name__ == "__main__":
    sys.exit(main())
