"""One decoder layer's operators measured on this GPU against the simulator's prices.

The GPU operator model (``testbed.sim.gpu_model.GPUStepModel``) prices a layer from
Vidur's measured per-operator tables where a table matches the model's shape, from
a GEMM curve and elementwise rates fitted to them where none does, and attention
from published kernel figures. This benchmark measures the same operators here, in
torch at the tables' shapes at TP 1 (bf16):

* ``qkv``, ``o``, ``mlp_up`` (gate and up fused: n = 2 x intermediate), ``mlp_down``:
  ``torch.nn.functional.linear``;
* ``input_norm``, ``post_norm``: the engine's ``RMSNorm``; ``rope``: the engine's
  ``RotaryEmbedding`` over q and k (its cos/sin cached, as every layer after the
  first finds them); ``act``: SiLU-and-mul over the fused gate/up output; ``add``:
  the residual add;
* ``attention_decode``: the engine's Triton paged-attention decode kernel
  (``testbed.kernels.triton_kernels``) over a batch of requests at one context,
  blocks shuffled through the cache,

for two shapes: Llama-2-7B, which has a measured table on H100, and Llama-3-8B,
which the fitted curve prices there. Predictions are those of the device's
``conf/hardware`` entry (``testbed.hardware.gpu_entry``; ``--hardware`` names
another), carried from its sibling's tables (``BASE_GPU``) by the model's own
roofline ratio. Each time is the median of repeats after warm-up, timed with CUDA
events behind a GPU sleep (so that a call's kernels queue back to back: kernel
time, as Vidur's tables are, not the host's launch gaps); the L2 cache is flushed
before the GEMMs and attention (their weights and KV come from HBM in a real
forward pass) and not before the elementwise ops (their inputs were just written).

Prints one row per (op, shape, tokens): measured, predicted (its source), ratio
measured / predicted, achieved FLOP/s or bandwidth; then the median and the worst
ratio (farthest from 1) per op and source. Writes JSON to ``--out`` (a ``.json``
file, or a folder to hold ``gpu_operators.json``). Without a CUDA device it says so
and exits 0.

    python benchmarks/gpu_operators.py [--out outputs/gpu_operators] [--hardware h100]
"""

from __future__ import annotations

import argparse
import math
import signal
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from common import write_results

from testbed.core.outputs import pass_features
from testbed.hardware import gpu_entry, spec_sheet
from testbed.models import resolve_model
from testbed.sim.gpu_model import GPUStepModel
from testbed.sim.operators import LINEAR_OPS, OPS

MODELS = ("llama2-7b", "llama3-8b")  # conf/model entries: a measured table, a fitted curve
TOKENS = (1, 16, 64, 256, 1024, 4096)
DEVICE = "cuda"
ATTENTION = "attention_decode"
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
WARMUP = 3
SLEEP_CYCLES = 1_000_000  # about half a millisecond: the host queues a whole call meanwhile
FLUSH_BYTES = 512 * 2**20  # beyond any current GPU's L2


@dataclass(frozen=True)
class Measured:
    """One operator's median time here; ``flops`` and ``bytes`` (nominal) give its rates."""

    model: str
    op: str
    tokens: int  # tokens of the layer; for attention, decoding requests
    seconds: float
    context: int | None = None  # attention: keys each request reads
    flops: float = 0.0
    bytes: float = 0.0


class Stopped(Exception):
    """SIGTERM (the GPU check's step limit): stop measuring, write what was measured."""


# --- predictions and the comparison (no GPU needed) ---


def predictors(models: list[str], entry: str | None) -> tuple[dict[str, GPUStepModel], str]:
    """The operator model of each model on the hardware ``entry`` at TP 1, and a line
    saying what prices them (or why nothing does: no entry, no operator data)."""
    if entry is None:
        return {}, "no conf/hardware entry for this device (--hardware names one): no predictions"
    try:
        hw = spec_sheet(entry)
        steps = {m: GPUStepModel(resolve_model(m).spec(), hw, "bfloat16") for m in models}
    except (ValueError, FileNotFoundError) as e:
        return {}, f"no predictions: {e}"
    base = next(iter(steps.values())).base.name if steps else entry
    scaled = f" ({base}'s operators scaled by the roofline ratio)" if base != entry else ""
    return steps, f"predictions: GPU operator model of {entry}{scaled}"


def op_source(step: GPUStepModel) -> str:
    """Where ``step`` prices a layer's operators: ``table`` or ``fitted``, and the
    sibling GPU whose data it scales, if any."""
    kind = "table" if step.layer.measured else "fitted"
    return kind if step.base.name == step.hw.name else f"{kind}, {step.base.name} scaled"


def predict(step: GPUStepModel, m: Measured) -> tuple[float, str]:
    """Seconds ``step`` predicts for the measured operator, and its source."""
    if m.op == ATTENTION:
        if m.context is None:
            raise ValueError(f"{m.model} {ATTENTION} at {m.tokens} requests: no context")
        features = pass_features([(m.context - 1, 1)] * m.tokens)  # context counts the new token
        return step._attention(*features) / step.model.num_layers, "figures"
    if m.op not in OPS:
        raise ValueError(f"{m.model}: unknown op {m.op!r}; known: {', '.join(OPS)}, {ATTENTION}")
    return step._layer_ops(m.tokens)[m.op], op_source(step)


def compare(measured: list[Measured], steps: Mapping[str, GPUStepModel]) -> list[dict]:
    """One row per measurement: it, its prediction (None where ``steps`` lacks the
    model), the ratio measured / predicted and the achieved rates."""
    rows = []
    for m in measured:
        row = asdict(m)
        row["predicted"], row["source"], row["ratio"] = None, None, None
        step = steps.get(m.model)
        if step is not None:
            predicted, source = predict(step, m)
            row.update(predicted=predicted, source=source, ratio=m.seconds / predicted)
        row["tflop_s"] = m.flops / m.seconds / 1e12 if m.flops else None
        row["gb_s"] = m.bytes / m.seconds / 1e9 if m.bytes else None
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per op and source kind (table, fitted, figures): the median ratio and the
    worst (farthest from 1 either way), with where it fell."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["ratio"] is not None:
            groups.setdefault((r["op"], r["source"].split(",")[0]), []).append(r)
    order = {op: i for i, op in enumerate((*OPS, ATTENTION))}
    out = []
    for (op, kind), rs in sorted(groups.items(), key=lambda g: (order[g[0][0]], g[0][1])):
        worst = max(rs, key=lambda r: abs(math.log(r["ratio"])))
        out.append(
            dict(
                op=op,
                source=kind,
                n=len(rs),
                median_ratio=statistics.median(r["ratio"] for r in rs),
                worst_ratio=worst["ratio"],
                worst_at=_where(worst),
            )
        )
    return out


def _where(r: dict) -> str:
    at = f"{r['model']} {r['tokens']}"
    return at + (f" x {r['context']}" if r["context"] else "")


def print_table(rows: list[dict], summary: list[dict]) -> None:
    print(
        f"{'op':<17}{'shape':<11}{'tokens':>12}{'measured us':>13}{'predicted us':>14}"
        f"  {'source':<20}{'ratio':>7}  achieved"
    )
    for r in rows:
        tokens = f"{r['tokens']} x {r['context']}" if r["context"] else str(r["tokens"])
        pred = f"{r['predicted'] * 1e6:14.1f}" if r["predicted"] is not None else f"{'-':>14}"
        ratio = f"{r['ratio']:7.2f}" if r["ratio"] is not None else f"{'-':>7}"
        rates = [f"{r['tflop_s']:.0f} TFLOP/s"] if r["tflop_s"] else []
        rates += [f"{r['gb_s']:.0f} GB/s"] if r["gb_s"] else []
        print(
            f"{r['op']:<17}{r['model']:<11}{tokens:>12}{r['seconds'] * 1e6:13.1f}{pred}"
            f"  {r['source'] or '-':<20}{ratio}  {', '.join(rates)}"
        )
    if summary:
        print(f"\n{'op':<17}{'source':<9}{'n':>3}{'median':>8}{'worst':>8}  worst at")
    for s in summary:
        print(
            f"{s['op']:<17}{s['source']:<9}{s['n']:>3}{s['median_ratio']:8.2f}"
            f"{s['worst_ratio']:8.2f}  {s['worst_at']}"
        )


# --- measuring (CUDA) ---


def time_cuda(fn: Callable[[], object], repeats: int, flush: torch.Tensor | None) -> float:
    """Median seconds of ``fn``'s kernels over ``repeats`` calls after warm-up."""
    for _ in range(WARMUP):
        fn()
    events = []
    for _ in range(repeats):
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU waits while the host queues the call
        if flush is not None:
            flush.zero_()  # evict the previous call's weights / KV from L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def measure_layer_ops(model: str, tokens: list[int], repeats: int) -> Iterator[Measured]:
    """The nine layer operators of ``model`` at TP 1 at each token count, one by one."""
    from testbed.engine.model import RMSNorm, RotaryEmbedding
    from testbed.engine.model_config import ModelConfig

    cfg = ModelConfig.of(resolve_model(model))
    dev = torch.device(DEVICE)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=DTYPE, device=dev, generator=gen) * 0.02

    dims = {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "mlp_up": (h, 2 * i)}
    dims["mlp_down"] = (i, h)
    weights = {op: rand(n, k) for op, (k, n) in dims.items()}
    norm = RMSNorm(h, cfg.rms_norm_eps).to(device=dev, dtype=DTYPE)
    rope = RotaryEmbedding(cfg).to(dev)  # inv_freq stays float32, as the engine keeps it
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    el = DTYPE.itemsize
    with torch.inference_mode():
        for t in tokens:
            for op in LINEAR_OPS:
                k, n = dims[op]
                x, w = rand(t, k), weights[op]
                s = time_cuda(lambda x=x, w=w: F.linear(x, w), repeats, flush)
                nbytes = el * (t * k + k * n + t * n)
                yield Measured(model, op, t, s, flops=2 * t * k * n, bytes=nbytes)
            q, key = rand(t, heads, d), rand(t, kv, d)
            positions = torch.arange(t, device=dev)
            rope.cos_sin(positions)  # cached: every layer of a pass rotates by the same positions
            calls = _elementwise(
                norm, rope, rand(t, h), rand(t, h), rand(t, 2 * i), q, key, positions
            )
            for op, (fn, elements) in calls.items():
                s = time_cuda(fn, repeats, None)
                yield Measured(model, op, t, s, bytes=el * elements)
            print(f"  {model}: {t} tokens measured")


def _elementwise(norm, rope, x, y, gate_up, q, k, positions) -> dict[str, tuple[Callable, int]]:
    """Each elementwise op's call and the elements it reads and writes."""
    t, h = x.shape
    i = gate_up.shape[1] // 2
    return {
        "input_norm": (lambda: norm(x), 2 * t * h),
        "post_norm": (lambda: norm(y), 2 * t * h),
        "rope": (lambda: rope(positions, q, k), 2 * (q.numel() + k.numel())),
        "act": (lambda: _silu_and_mul(gate_up), 3 * t * i),
        "add": (lambda: x + y, 3 * t * h),
    }


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def measure_decode_attention(
    model: str, batches: list[int], contexts: list[int], repeats: int
) -> Iterator[Measured]:
    """The Triton paged-attention decode kernel on ``model``'s heads at each batch and
    context that fits in free memory (the others are left out, and said so), one by one."""
    from testbed.engine.model_config import ModelConfig
    from testbed.kernels import triton_kernels as tk

    cfg = ModelConfig.of(resolve_model(model))
    dev = torch.device(DEVICE)
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    el = DTYPE.itemsize
    for ctx in contexts:
        for b in batches:
            kv_bytes = 2 * b * ctx * kv * d * el
            torch.cuda.empty_cache()
            if kv_bytes * 1.2 > torch.cuda.mem_get_info()[0]:
                print(f"  {model}: {ATTENTION} {b} x {ctx}: does not fit in free memory")
                continue
            per_seq = -(-ctx // BLOCK_SIZE)
            shape = (b * per_seq, BLOCK_SIZE, kv, d)
            k_cache = torch.randn(shape, dtype=DTYPE, device=dev, generator=gen)
            v_cache = torch.randn(shape, dtype=DTYPE, device=dev, generator=gen)
            order = torch.randperm(b * per_seq, device=dev, generator=gen)
            tables = order.view(b, per_seq).to(torch.int32)
            query = torch.randn(b, heads, d, dtype=DTYPE, device=dev, generator=gen)
            lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            call = (query, k_cache, v_cache, tables, lens, d**-0.5)
            s = time_cuda(
                lambda call=call, ctx=ctx: tk.paged_attention_decode(*call, max_context_len=ctx),
                repeats,
                flush,
            )
            nbytes = kv_bytes + 2 * b * heads * d * el  # K and V read, query and output
            yield Measured(model, ATTENTION, b, s, ctx, bytes=nbytes)
            del k_cache, v_cache, tables, query


def out_path(out: str) -> Path:
    """``out`` itself where it names a ``.json`` file, else ``gpu_operators.json`` in it."""
    path = Path(out)
    return path if path.suffix == ".json" else path / "gpu_operators.json"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _stop(signum, frame) -> None:
    raise Stopped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="outputs/gpu_operators")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--hardware", default=None, help="conf/hardware entry (default: this GPU's)")
    ap.add_argument("--skip-attention", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_operators needs a CUDA device: nothing measured")
        return
    device = torch.cuda.get_device_name()
    entry = args.hardware or gpu_entry(device)
    steps, note = predictors(args.models, entry)
    print(f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}; {note}")
    measured: list[Measured] = []
    stopped = False
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for model in args.models:
            for m in measure_layer_ops(model, args.tokens, args.repeats):
                measured.append(m)  # one by one: a stop keeps what came before
        for model in [] if args.skip_attention else args.models:
            for m in measure_decode_attention(model, args.batches, args.contexts, args.repeats):
                measured.append(m)
    except Stopped:
        stopped = True
        print("stopped (SIGTERM): writing what was measured")
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = compare(measured, steps)
    summary = summarize(rows)
    print_table(rows, summary)
    shapes = {}
    for m in args.models:
        c = resolve_model(m).hf_config
        shapes[m] = {k: c[k] for k in ("hidden_size", "intermediate_size", "head_dim")} | {
            "num_heads": c["num_attention_heads"],
            "num_kv_heads": c["num_key_value_heads"],
        }
    write_results(
        out_path(args.out),
        "gpu_operators",
        rows,
        device=device,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_version("triton"),
        dtype=str(DTYPE),
        hardware=entry,
        predictions=note,
        sources={m: s.sources for m, s in steps.items()},
        shapes=shapes,
        tp=1,
        repeats=args.repeats,
        stopped=stopped,
        summary=summary,
    )


if __name__ == "__main__":
    main()
