"""Paged attention on a CPU, per layer: the reference, the CPU path on torch alone,
and the CPU path with its C++ kernel, on the batches an engine step makes.

Shapes (dummy Llama attention: 8 query heads, 4 KV heads, head dim 64, blocks of
16, blocks shuffled through a cache of 4,096), in float32 and bfloat16: 48
decodes of contexts 100-500; 16 speculative verifications (a token and 3
drafts) after contexts 100-500; a burst of 45 prompts of 20-70 tokens; 3 chunks
of 256 rows after 1,024 cached tokens; 4 prompts of 980-1,024 tokens; one
prompt of 2,048 tokens; 4 decodes of contexts 12,000-16,000 (the kernel's keys
in chunks). ``kernel_ms`` is the C++ kernel on every item of the batch, whatever
the route would pick. For the decodes, the K/V bytes read per call over its
time, against this machine's streaming read bandwidth measured in the same run
(a sum over 200 MB): the memory floor. Those caches fit in this CPU's L3, so a
last row times what an engine's decode step does: 32 decodes of 760 keys
through 8 layers' caches of their own (blocks of 32, 400 MB in float32), K/V
read from memory. Median of repeats after warm-up; ``torch.get_num_threads()``
threads.

    python benchmarks/cpu_attention_bench.py [--repeats 20] [--dtypes float32 bfloat16] \\
        [--out benchmarks/results/cpu_attention.json]
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import torch
from common import write_results
from timing import median_s

from testbed.kernels import cpu_attention, cpu_native
from testbed.kernels import torch_attention as reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 8, 4, 64, 16, 4096
ROUTES = ("reference", "cpu-torch", "cpu", "kernel")


def read_bandwidth(repeats: int) -> float:
    """Bytes per second of a sum over 200 MB (streaming reads, torch's threads)."""
    x = torch.ones(50_000_000)
    return x.numel() * 4 / median_s(lambda: x.sum(), max(3, repeats // 4))


def batch(seq_lens: list[int], q_lens: list[int], gen: torch.Generator, dtype: torch.dtype):
    """Query rows of each sequence's last ``q_lens[i]`` positions, over a shuffled cache."""
    kc = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vc = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    width = max(-(-n // BLOCK) for n in seq_lens)
    order = torch.randperm(NUM_BLOCKS, generator=gen)[: width * len(seq_lens)]
    tables = order.view(len(seq_lens), width).to(torch.int32)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, kc, vc, tables, starts, lens


def shapes(gen: torch.Generator) -> dict[str, tuple[list[int], list[int]]]:
    ctx = torch.randint(100, 501, (48,), generator=gen).tolist()
    verify = torch.randint(100, 501, (16,), generator=gen).tolist()
    burst = torch.randint(20, 71, (45,), generator=gen).tolist()
    long_ctx = torch.randint(12_000, 16_001, (4,), generator=gen).tolist()
    prompts = torch.randint(980, 1_025, (4,), generator=gen).tolist()
    return {
        "48 decodes, contexts 100-500": (ctx, [1] * 48),
        "16 verifications (4 rows), contexts 100-500": ([n + 4 for n in verify], [4] * 16),
        "45 prompts of 20-70 tokens": (burst, burst),
        "3 chunks of 256 after 1,024": ([1280] * 3, [256] * 3),
        "4 prompts of 980-1,024": (prompts, prompts),
        "one prompt of 2,048": ([2048], [2048]),
        "4 decodes, contexts 12,000-16,000": (long_ctx, [1] * 4),
    }


MEMORY_SHAPE = "32 decodes of 760 keys, 8 layers (from memory)"


def decode_from_memory(dtype: torch.dtype, repeats: int, floor_bw: float) -> dict:
    """A decode step's attention over 8 layers whose caches do not fit in cache."""
    seqs, keys, layers, block = 32, 760, 8, 32
    gen = torch.Generator().manual_seed(1)
    per_seq = -(-keys // block)
    caches = [
        tuple(
            torch.randn(seqs * per_seq, block, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).to(torch.int32)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((seqs,), keys, dtype=torch.int32)

    def step():
        for kc, vc in caches:
            cpu_attention.paged_attention_decode(query, kc, vc, tables, lens, HEAD_DIM**-0.5)

    kv_bytes = seqs * keys * KV_HEADS * HEAD_DIM * dtype.itemsize * 2 * layers
    cpu_ms = median_s(step, repeats) * 1e3
    return dict(
        dtype=str(dtype).removeprefix("torch."),
        shape=MEMORY_SHAPE,
        kv_mb=kv_bytes / 1e6,
        cpu_ms=cpu_ms,
        cpu_read_gb_s=kv_bytes / cpu_ms / 1e6,
        floor_ms=kv_bytes / floor_bw * 1e3,
    )


def call(route: str, query, kc, vc, tables, starts, lens, decode: bool):
    backend = reference if route == "reference" else cpu_attention
    if decode:
        return lambda: backend.paged_attention_decode(query, kc, vc, tables, lens, HEAD_DIM**-0.5)
    return lambda: backend.paged_attention_prefill(
        query, kc, vc, tables, starts, lens, HEAD_DIM**-0.5
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default="benchmarks/results/cpu_attention.json")
    args = ap.parse_args()
    if cpu_native.kernel() is None:
        raise SystemExit(f"no C++ kernel here: {cpu_native.unavailable_reason()}")
    floor_bw = read_bandwidth(args.repeats)
    rows, memory_rows = [], []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(0)
        for name, (seq_lens, q_lens) in shapes(gen).items():
            inputs = batch(seq_lens, q_lens, gen, dtype)
            decode = all(q == 1 for q in q_lens)
            kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize * 2
            row = dict(dtype=dtype_name, shape=name, kv_mb=kv_bytes / 1e6)
            for route in ROUTES:
                kernel = "torch" if route == "cpu-torch" else "native"
                every = {torch.float32: 2**62} if route == "kernel" else {}
                with (
                    mock.patch.dict(os.environ, {"TESTBED_CPU_KERNEL": kernel}),
                    mock.patch.dict(cpu_attention.NATIVE_PAIRS, every),
                ):
                    row[f"{route}_ms"] = median_s(call(route, *inputs, decode), args.repeats) * 1e3
            row["cpu_vs_cpu_torch"] = row["cpu_ms"] / row["cpu-torch_ms"]
            row["kernel_vs_cpu_torch"] = row["kernel_ms"] / row["cpu-torch_ms"]
            if decode:
                row["cpu_read_gb_s"] = kv_bytes / row["cpu_ms"] / 1e6
                row["floor_ms"] = kv_bytes / floor_bw * 1e3
            rows.append(row)
        memory_rows.append(decode_from_memory(dtype, args.repeats, floor_bw))
    print(f"threads {torch.get_num_threads()}, streaming read {floor_bw / 1e9:.1f} GB/s")
    print(
        f"{'dtype':9} {'shape':44} {'K/V MB':>7} {'reference':>10} {'cpu-torch':>10} "
        f"{'cpu':>8} {'kernel':>8} {'cpu/torch':>9} {'kernel/torch':>12}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['shape']:44} {r['kv_mb']:7.1f} {r['reference_ms']:8.2f}ms "
            f"{r['cpu-torch_ms']:8.2f}ms {r['cpu_ms']:6.2f}ms {r['kernel_ms']:6.2f}ms "
            f"{r['cpu_vs_cpu_torch']:8.2f}x {r['kernel_vs_cpu_torch']:11.2f}x"
            + (
                f"   read {r['cpu_read_gb_s']:.1f} GB/s, floor {r['floor_ms']:.2f} ms"
                if "floor_ms" in r
                else ""
            )
        )
    for r in memory_rows:
        print(
            f"{r['dtype']:9} {r['shape']:44} {r['kv_mb']:7.1f} {r['cpu_ms']:8.2f}ms (cpu route)"
            f"   read {r['cpu_read_gb_s']:.1f} GB/s, floor {r['floor_ms']:.2f} ms"
        )
    write_results(
        args.out,
        "cpu_attention",
        rows + memory_rows,
        threads=torch.get_num_threads(),
        read_bandwidth_gb_s=floor_bw / 1e9,
        route=cpu_attention.route(),
    )


if __name__ == "__main__":
    main()
