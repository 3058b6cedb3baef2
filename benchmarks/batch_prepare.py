"""The host's work before each forward pass: building the flattened batch.

1. ``testbed.engine.batch.flatten`` (whole-batch array operations) against the
   same batch built with tensors per row (``per_row`` below, the way it was built
   before), in the same run: decode batches of 16-1024 requests with contexts of
   100-2000 tokens, and a mixed step (8 prompt chunks of 256 tokens beside 56
   decodes). Median microseconds per step over repeats, and their ratio.
2. The decode steps of a tiny model (2 layers, hidden 64) through the engine at
   batches of 64 and 256, where the model's own work is small and the host's
   shows: milliseconds per decode step in preparation, the control plane and the
   rest (``benchmarks/step_breakdown.py``).

On a GPU the same host work precedes every launch, so it bounds a small model's
decode step from below.

    python benchmarks/batch_prepare.py [--repeats 30] [--out benchmarks/results/batch_prepare.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import llama_shape, write_results
from step_breakdown import StepBreakdown

from testbed.core import SamplingParams
from testbed.engine.batch import flatten
from testbed.engine.llm import LLM
from testbed.engine.model import AttentionMetadata

BLOCK = 16
TINY = llama_shape(
    "tiny-llama-2l-64",
    layers=2,
    hidden=64,
    intermediate=128,
    heads=2,
    kv_heads=1,
    head_dim=32,
    vocab=512,
    max_len=4096,
)


def per_row(rows, block_size: int, device: torch.device):
    """The same batch as ``flatten``, built with tensors row by row (the peer)."""
    tokens, positions, slots, q_start, seq_lens = [], [], [], [0], []
    max_blocks = max_query = 1
    for table, toks, start in rows:
        end = start + len(toks)
        tokens.extend(toks)
        pos = torch.arange(start, end)
        t = torch.tensor(table, dtype=torch.int64)
        positions.append(pos)
        slots.append(t[pos // block_size] * block_size + pos % block_size)
        q_start.append(q_start[-1] + len(toks))
        seq_lens.append(end)
        max_blocks, max_query = max(max_blocks, len(table)), max(max_query, len(toks))
    tables = torch.zeros((len(rows), max_blocks), dtype=torch.int32)
    for i, (table, _, _) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max_query,
        max_seq_len=max(seq_lens),
    )
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    return ids, torch.cat(positions).to(device), meta, q_start


def batch(rng: random.Random, decodes: int, chunks: int = 0):
    """``decodes`` rows of one token after 100-2000 cached, then ``chunks`` rows of
    256 prompt tokens after 0-1024 cached; tables of distinct blocks."""
    rows, next_block = [], 0
    for count in [1] * decodes + [256] * chunks:
        start = rng.randint(100, 2000) if count == 1 else rng.randint(0, 1024)
        need = -(-(start + count) // BLOCK)
        table = list(range(next_block, next_block + need))
        next_block += need
        rows.append((table, [rng.randrange(32_000) for _ in range(count)], start))
    return rows


def median_us(build, rows, repeats: int) -> float:
    cpu = torch.device("cpu")
    build(rows, BLOCK, cpu)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build(rows, BLOCK, cpu)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_flatten(repeats: int) -> list[dict]:
    rng = random.Random(0)
    shapes = [(n, 0) for n in (16, 64, 256, 1024)] + [(56, 8)]
    rows = []
    print(f"{'decodes':>8} {'chunks':>7} {'tokens':>7} {'per row us':>11} {'ours us':>8} {'x':>6}")
    for decodes, chunks in shapes:
        b = batch(rng, decodes, chunks)
        ours, peer = median_us(flatten, b, repeats), median_us(per_row, b, repeats)
        tokens = sum(len(t) for _, t, _ in b)
        rows.append(
            dict(
                part="flatten",
                decodes=decodes,
                chunks=chunks,
                tokens=tokens,
                per_row_us=peer,
                ours_us=ours,
                speedup=peer / ours,
            )
        )
        print(
            f"{decodes:>8} {chunks:>7} {tokens:>7} {peer:>11.0f} {ours:>8.0f} {peer / ours:>5.1f}x"
        )
    return rows


def bench_decode_steps() -> list[dict]:
    rows = []
    print(f"\n{'batch':>6} {'steps':>6} {'prepare ms':>11} {'control ms':>11} {'step ms':>8}")
    for n in (64, 256):
        llm = LLM(TINY, max_num_seqs=n, max_num_batched_tokens=8192, attention_backend="cpu")
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(100, 300))] for _ in range(n)]
        params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * n
        llm.generate(prompts[:4], params[:4])  # warm-up
        with StepBreakdown(llm) as breakdown:
            llm.generate(prompts, params)
        s, k = breakdown.seconds["decode"], breakdown.steps["decode"]
        row = dict(part="decode_step", batch=n, steps=k)
        row |= {f"{p}_ms": s[p] / k * 1e3 for p in s}
        rows.append(row)
        print(
            f"{n:>6} {k:>6} {row['prepare_ms']:>11.2f} {row['control_plane_ms']:>11.2f} "
            f"{row['total_ms']:>8.2f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/batch_prepare.json")
    args = ap.parse_args()
    rows = bench_flatten(args.repeats) + bench_decode_steps()
    write_results(
        args.out, "batch_prepare", rows, torch=torch.__version__, threads=torch.get_num_threads()
    )


if __name__ == "__main__":
    main()
