"""End-to-end decode step time of a model against its memory roofline.

One decode step of ``batch`` requests, each with ``context`` cached tokens,
through the real engine's model (dummy weights of the real shape, paged KV
cache, the configured attention backend). A decode step must read every weight
and every cached K/V once, so it cannot beat (weights + KV bytes) / bandwidth;
the table shows the achieved bandwidth and the fraction of that roofline.

    python benchmarks/decode_step.py --model llama3-8b --batch 1 64 256 --context 1024
    python benchmarks/decode_step.py --model dummy-llama --device cpu   # a smoke run
    # small batches on one CPU thread (the committed JSON predates the engine's
    # W·hᵀ LM head, when 3 decodes cost more than 4; see benchmarks/lm_head.py)
    python benchmarks/decode_step.py --model dummy-llama --device cpu --threads 1 \
        --batch 1 2 3 4 5 6 7 8 --context 256 --repeats 30 \
        --out benchmarks/results/decode_step_cpu1.json

Without CUDA (and without ``--device cpu``) it prints that nothing was measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import gpu_sheet, write_results

from testbed.engine.device import pick_dtype
from testbed.engine.factory import engine_model
from testbed.engine.model import AttentionMetadata
from testbed.engine.weights import build_model
from testbed.kernels import select_backend


def step_time(model, backend, batch: int, context: int, block: int, device, repeats: int):
    cfg = model.config
    dtype = next(model.parameters()).dtype
    per_seq = -(-(context + 1) // block)
    shape = (batch * per_seq, block, cfg.num_kv_heads, cfg.head_dim)
    caches = [
        (
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
    pos = torch.full((batch,), context, dtype=torch.int64, device=device)
    slots = tables[:, context // block].long() * block + context % block
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=context + 1,
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            sync(device)
            t0 = time.perf_counter()
            hidden = model(ids, pos, meta, caches, backend)
            model.logits(hidden)
            sync(device)
            if i >= 3:  # warm-up first
                times.append(time.perf_counter() - t0)
    kv_bytes = (
        2
        * cfg.num_layers
        * batch
        * (context + 1)
        * cfg.num_kv_heads
        * cfg.head_dim
        * torch.tensor([], dtype=dtype).element_size()
    )
    del caches
    return statistics.median(times), kv_bytes


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    ap.add_argument("--out", default="benchmarks/results/decode_step.json")
    args = ap.parse_args()
    if args.device is None and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or "cuda")
    cfg, _, name = engine_model(args.model)
    model = build_model(cfg, None, pick_dtype(None, device), device)
    backend = select_backend(args.backend, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gpu, sheet = gpu_sheet() if device.type == "cuda" else ("cpu", None)
    bw = sheet.mem_bandwidth if sheet else None
    rows = []
    print(f"{name} on {gpu}: {weights / 1e9:.2f} GB of weights, context {args.context}")
    print(f"{'batch':>6} {'step ms':>9} {'roofline ms':>12} {'GB/s':>8} {'% roofline':>11}")
    for batch in args.batch:
        try:
            t, kv = step_time(
                model, backend, batch, args.context, args.block_size, device, args.repeats
            )
        except torch.OutOfMemoryError:
            print(f"{batch:>6} does not fit in memory")
            continue
        floor = (weights + kv) / bw if bw else float("nan")
        row = dict(
            model=name,
            device=gpu,
            batch=batch,
            context=args.context,
            step_s=t,
            weight_bytes=weights,
            kv_bytes=kv,
            achieved_bytes_s=(weights + kv) / t,
            roofline_s=floor,
            fraction_of_roofline=floor / t if bw else None,
        )
        rows.append(row)
        print(
            f"{batch:>6} {t * 1e3:>9.2f} {floor * 1e3:>12.2f} {(weights + kv) / t / 1e9:>8.0f} "
            f"{(100 * floor / t) if bw else float('nan'):>10.1f}%"
        )
    write_results(
        args.out, "decode_step", rows, backend=args.backend, threads=torch.get_num_threads()
    )


if __name__ == "__main__":
    main()
