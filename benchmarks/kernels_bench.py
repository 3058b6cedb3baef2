"""Paged-attention kernels on the GPU: decode bandwidth and prefill FLOP/s vs the roofline.

Decode (``testbed.kernels.triton_kernels.paged_attention_decode``): achieved HBM bandwidth,
counting the K and V bytes actually read (context tokens x KV heads x head dim x 2 x
dtype bytes) plus query and output, against the card's HBM bandwidth (its
``conf/hardware`` entry: 4.8 TB/s on an H200, 3.35 on an H100), at batch 1, 16, 64,
256 and contexts 1k, 4k, 16k (every sequence at the full context), head dim 128, 8 KV
heads, 32 query heads, bf16, blocks shuffled through the cache. The L2 cache is
flushed before each timed call (a small batch's K/V would otherwise sit in it). The
aim is >= 70% at batch 64, context 4k.

Prefill (``paged_attention_prefill``): causal TFLOP/s (4 x heads x head dim x attended
query-key pairs) against torch's ``scaled_dot_product_attention`` on the same data
unpaged (``is_causal`` when there is no cached prefix, a boolean mask when there is).

Median of repeats after warm-up, timed with CUDA events; shapes that do not fit in
free memory are skipped. Without a CUDA device it says so and exits 0.

    python benchmarks/kernels_bench.py [--out benchmarks/results/kernels_bench.json]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import gpu_sheet, write_results

from testbed.kernels import torch_attention as reference

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
PREFILL_SHAPES = ((8, 2048, 0), (2, 8192, 0), (8, 1024, 3072))  # seqs, new tokens, prefix


def time_cuda(fn: Callable[[], object], repeats: int, flush: torch.Tensor | None) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timed calls, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()  # evict the previous call's K/V from L2
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def paged(num_seqs: int, seq_len: int, block_size: int, gen: torch.Generator):
    """Caches holding ``num_seqs`` sequences of ``seq_len`` tokens in shuffled blocks."""
    per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    value_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    order = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    tables = order.view(num_seqs, per_seq).to(torch.int32)
    return key_cache, value_cache, tables


def unpaged(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[num_seqs, KV_HEADS, seq_len, HEAD_DIM]``: the same K or V, contiguous."""
    return cache[tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def bench_decode(tk, args, flush, gen, peak_bytes_s: float | None) -> list[dict]:
    rows = []
    for ctx in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
            io_bytes = 2 * batch * HEADS * HEAD_DIM * DTYPE.itemsize
            row = dict(kernel="decode", batch=batch, context=ctx, block_size=args.block_size)
            if kv_bytes * 1.2 > free_bytes():
                rows.append(dict(row, skipped="does not fit in free memory"))
                print(f"decode  batch {batch:4d}  context {ctx:6d}  skipped: does not fit")
                continue
            kc, vc, tables = paged(batch, ctx, args.block_size, gen)
            query = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
            call = (query, kc, vc, tables, lens, SCALE)
            if batch * ctx <= 16 * 4096:  # check against the reference where it is cheap
                want = reference.paged_attention_decode(*call)
                got = tk.paged_attention_decode(*call, max_context_len=ctx)
                row["max_abs_err"] = float((got.float() - want.float()).abs().max())
            seconds = time_cuda(
                lambda call=call, ctx=ctx: tk.paged_attention_decode(*call, max_context_len=ctx),
                args.repeats,
                flush,
            )
            splits, _ = tk._split_plan(batch, KV_HEADS, ctx, 64, tk._num_sms(query.device))
            bandwidth = (kv_bytes + io_bytes) / seconds
            row.update(
                num_splits=splits,
                time_us=seconds * 1e6,
                bytes=kv_bytes + io_bytes,
                bandwidth_gb_s=bandwidth / 1e9,
                fraction_of_peak=bandwidth / peak_bytes_s if peak_bytes_s else None,
            )
            rows.append(row)
            print(
                f"decode  batch {batch:4d}  context {ctx:6d}  splits {splits:2d}  "
                f"{seconds * 1e6:9.1f} us  {bandwidth / 1e9:7.0f} GB/s"
                + (f"  {bandwidth / peak_bytes_s:6.1%} of peak" if peak_bytes_s else "")
                + (f"  err {row['max_abs_err']:.1e}" if "max_abs_err" in row else "")
            )
            del kc, vc, tables, query
    return rows


def bench_prefill(tk, args, gen, peak_flop_s: float | None) -> list[dict]:
    rows = []
    for num_seqs, q_len, prefix in PREFILL_SHAPES:
        n = prefix + q_len
        row = dict(kernel="prefill", num_seqs=num_seqs, query_len=q_len, prefix_len=prefix)
        cache_bytes = 2 * num_seqs * n * KV_HEADS * HEAD_DIM * DTYPE.itemsize
        dense_bytes = 2 * num_seqs * n * HEADS * HEAD_DIM * DTYPE.itemsize  # SDPA's K/V
        if (cache_bytes + dense_bytes) * 1.5 > free_bytes():
            rows.append(dict(row, skipped="does not fit in free memory"))
            continue
        kc, vc, tables = paged(num_seqs, n, args.block_size, gen)
        t = num_seqs * q_len
        query = torch.randn(t, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
        starts = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=DEVICE)
        lens = torch.full((num_seqs,), n, dtype=torch.int32, device=DEVICE)
        call = (query, kc, vc, tables, starts, lens, SCALE)
        seconds = time_cuda(lambda call=call: tk.paged_attention_prefill(*call), args.repeats, None)

        # The same attention on unpaged, head-expanded K/V (SDPA's fast paths want equal heads).
        group = HEADS // KV_HEADS
        q = query.view(num_seqs, q_len, HEADS, HEAD_DIM).transpose(1, 2)
        k = unpaged(kc, tables, n).repeat_interleave(group, dim=1)
        v = unpaged(vc, tables, n).repeat_interleave(group, dim=1)
        if prefix:
            q_pos = torch.arange(prefix, n, device=DEVICE)[:, None]
            mask = torch.arange(n, device=DEVICE)[None, :] <= q_pos

            def sdpa(q=q, k=k, v=v, mask=mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)
        else:

            def sdpa(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)

        got = tk.paged_attention_prefill(*call).view(num_seqs, q_len, HEADS, HEAD_DIM)
        err = float((got.transpose(1, 2).float() - sdpa().float()).abs().max())
        sdpa_seconds = time_cuda(sdpa, args.repeats, None)
        pairs = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
        flops = 4 * HEADS * HEAD_DIM * pairs
        row.update(
            time_us=seconds * 1e6,
            tflop_s=flops / seconds / 1e12,
            fraction_of_peak=flops / seconds / peak_flop_s if peak_flop_s else None,
            sdpa_time_us=sdpa_seconds * 1e6,
            sdpa_tflop_s=flops / sdpa_seconds / 1e12,
            speed_vs_sdpa=sdpa_seconds / seconds,
            max_abs_err_vs_sdpa=err,
        )
        rows.append(row)
        print(
            f"prefill {num_seqs} x {q_len:5d} new + {prefix:5d} cached  "
            f"{seconds * 1e3:8.2f} ms  {row['tflop_s']:6.1f} TFLOP/s "
            + (f"({row['fraction_of_peak']:5.1%} of peak)" if peak_flop_s else "")
            + f"  SDPA {row['sdpa_tflop_s']:6.1f} TFLOP/s  "
            f"x{row['speed_vs_sdpa']:.2f}  err {err:.1e}"
        )
        del kc, vc, tables, query, k, v
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels_bench.json")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return
    import triton

    from testbed.kernels import triton_kernels as tk

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=DEVICE)  # > L2 (50 MB)
    props = torch.cuda.get_device_properties(0)
    _, sheet = gpu_sheet()
    peak_bytes_s, peak_flop_s = (sheet.mem_bandwidth, sheet.peak_flops) if sheet else (None, None)
    print(
        f"{props.name}: {props.multi_processor_count} SMs, torch {torch.__version__}; "
        + (
            f"peaks {peak_bytes_s / 1e12:.2f} TB/s, {peak_flop_s / 1e12:.0f} TFLOP/s ({sheet.name})"
            if sheet
            else "no conf/hardware entry: no peaks"
        )
    )
    rows = bench_decode(tk, args, flush, gen, peak_bytes_s)
    del flush
    if not args.skip_prefill:
        rows += bench_prefill(tk, args, gen, peak_flop_s)
    write_results(
        args.out,
        "kernels_bench",
        rows,
        device=props.name,
        num_sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=str(DTYPE),
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hardware=sheet.name if sheet else None,
        peak_hbm_bytes_s=peak_bytes_s,
        peak_bf16_flop_s=peak_flop_s,
    )


if __name__ == "__main__":
    main()
