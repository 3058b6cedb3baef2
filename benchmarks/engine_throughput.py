"""Offline throughput: our engine against transformers' ``generate`` on the same model.

Fixed workloads on the same weights, machine and run (seed 0, every request runs
to its output length):

- ``nano``: nano-vllm's shape, input and output lengths uniform in [100, 1024],
  64 requests instead of 256 to suit a CPU, on ``dummy-llama``;
- ``short``: 48 requests, prompts of 32-256 tokens and outputs of 16-160, on a
  dummy Llama of 8 layers, hidden 512, 8 heads, 4 KV heads, vocabulary 8000.

transformers' ``generate`` with static batching is what a user without a paged
engine runs: it pads prompts and keeps finished sequences in the batch until the
longest is done; ``padding_bound`` is the work that padding alone adds to it
(padded prompt + output positions over the asked ones), the speed-up a paged
engine gets for free. Both count only the output tokens the workload asks for.
Our engine runs with each ``--backends`` attention path (default on a CPU: the
torch reference, the CPU path on torch alone (``cpu-torch``), and the CPU path
with its C++ kernel for short queries (``cpu``)) and reports where its step time goes
(``benchmarks/step_breakdown.py``), over all steps and by kind.
On CUDA the JSON also records the GPU, the weight bytes and the decode-roofline
floor of the run (every decode step reads all weights once);
``benchmarks/decode_step.py`` measures the achieved bandwidth per step.

    python benchmarks/engine_throughput.py [--workloads nano short] [--repeats 3] [--out ...json]
    # a GPU: nano-vllm's workload on Qwen3-0.6B; transformers on 64 of the requests
    python benchmarks/engine_throughput.py --model qwen3-0.6b --requests 256 \\
        --max-num-seqs 256 --hf-requests 64 --hf-batch 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import gpu_sheet, kernel_route, llama_shape, write_results
from step_breakdown import PARTS, StepBreakdown

from testbed.core import SamplingParams
from testbed.engine.llm import LLM
from testbed.kernels import describe

SHORT_MODEL = llama_shape(
    "dummy-llama-8l-512",
    layers=8,
    hidden=512,
    intermediate=1376,
    heads=8,
    kv_heads=4,
    head_dim=64,
    vocab=8000,
)
WORKLOADS = {
    "nano": dict(model="dummy-llama", requests=64, prompt=(100, 1024), output=(100, 1024)),
    "short": dict(model=SHORT_MODEL, requests=48, prompt=(32, 256), output=(16, 160)),
}


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    outputs = [rng.randint(*output) for _ in range(n)]
    return prompts, outputs


def run_ours(llm: LLM, prompts, outputs) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def padding_bound(prompts, outputs, batch: int) -> float:
    """Positions static batching computes (each batch padded to its longest prompt
    and run to its longest output) over the positions the workload asks for."""
    padded = asked = 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i : i + batch], outputs[i : i + batch]
        padded += len(ps) * (max(map(len, ps)) + max(os_))
        asked += sum(map(len, ps)) + sum(os_)
    return padded / asked


def hf_model_like(llm: LLM):
    """transformers' model of the same config with our engine's exact weights."""
    import transformers

    raw = dict(llm.config.raw)
    arch = raw.get("architectures", ["LlamaForCausalLM"])[0]
    kind = raw.pop("model_type", "llama")
    config = transformers.AutoConfig.for_model(kind, **raw)
    model = getattr(transformers, arch)(config)
    state = {k: v for k, v in llm.executor.model.state_dict().items() if "rotary" not in k}
    missing = model.load_state_dict(state, strict=False).missing_keys
    if missing:  # transformers would run them on random weights
        raise RuntimeError(f"{arch}: our engine has no weights for {missing[:5]} ...")
    dtype = next(llm.executor.model.parameters()).dtype
    return model.to(device=llm.executor.device, dtype=dtype).eval()


def run_hf(model, prompts, outputs, batch: int) -> float:
    """Static batches of ``batch`` prompts, left-padded, each run to its longest output."""
    device = next(model.parameters()).device
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i : i + batch], outputs[i : i + batch]
        width = max(map(len, ps))
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for j, p in enumerate(ps):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(os_),
                min_new_tokens=max(os_),
                do_sample=False,
                pad_token_id=0,
            )
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_workload(
    name: str,
    backends: list[str],
    hf_batch: int | None,
    repeats: int,
    max_num_seqs: int = 64,
    hf_requests: int | None = None,
    gpu_memory_utilization: float = 0.5,
) -> list[dict]:
    """Each engine ``repeats`` times, in rounds (ours with each backend, then
    transformers), so that a drift of the machine's speed reaches all alike; each
    engine's median time, and every round's speed-up against that round's
    transformers run. transformers runs the first ``hf_requests`` requests (all by
    default; the workload is drawn at random, so they are a sample of it) and the
    speed-ups compare output tokens per second. On CUDA our engine's KV cache takes
    ``gpu_memory_utilization`` of the card, leaving transformers room beside it."""
    spec = WORKLOADS[name]
    llms = {}
    for backend in backends:
        llms[backend] = LLM(
            spec["model"],
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=4096,
            attention_backend=backend.removesuffix("-torch"),
            gpu_memory_utilization=gpu_memory_utilization,
        )
    llm = llms[backends[-1]]
    prompts, outputs = workload(
        spec["requests"], spec["prompt"], spec["output"], llm.config.vocab_size, 0
    )
    n_hf = min(hf_requests or len(prompts), len(prompts))
    hf_prompts, hf_outputs = prompts[:n_hf], outputs[:n_hf]
    batch = hf_batch or n_hf
    hf = hf_model_like(llm)
    warm = min(4, len(prompts))
    run_hf(hf, prompts[:warm], [8] * warm, warm)  # warm-up
    times: dict[str, list[float]] = {b: [] for b in [*backends, "hf"]}
    breakdowns, routes = {}, {}
    for _ in range(repeats):
        for backend in backends:
            with kernel_route(backend):
                routes[backend] = describe(llms[backend].executor.backend)
                run_ours(llms[backend], prompts[:warm], [8] * warm)  # warm-up
                if llms[backend].executor.device.type == "cpu":
                    with StepBreakdown(llms[backend]) as breakdown:
                        times[backend].append(run_ours(llms[backend], prompts, outputs)[0])
                    breakdowns.setdefault(backend, breakdown.summary())  # the first round's
                else:
                    times[backend].append(run_ours(llms[backend], prompts, outputs)[0])
        times["hf"].append(run_hf(hf, hf_prompts, hf_outputs, batch))
    rows = [
        dict(
            workload=name,
            engine=f"ours ({backend})",
            attention_backend=routes[backend],
            seconds=statistics.median(times[backend]),
            rounds_s=times[backend],
            speedup_by_round=[
                sum(outputs) / t / (sum(hf_outputs) / h)
                for h, t in zip(times["hf"], times[backend], strict=True)
            ],
            breakdown=breakdowns.get(backend, {}),
        )
        for backend in backends
    ]
    rows.append(
        dict(
            workload=name,
            engine=f"hf generate (batch {batch})"
            + (f", {n_hf} of {len(prompts)} requests" if n_hf < len(prompts) else ""),
            seconds=statistics.median(times["hf"]),
            rounds_s=times["hf"],
            requests_run=n_hf,
            output_tokens=sum(hf_outputs),
        )
    )
    hf_tok_s = sum(hf_outputs) / rows[-1]["seconds"]
    for row in rows:
        row.setdefault("requests_run", len(prompts))
        row.setdefault("output_tokens", sum(outputs))
        row |= dict(
            model=spec["model"] if isinstance(spec["model"], str) else spec["model"]["name"],
            device=str(llm.executor.device),
            requests=spec["requests"],
            prompt=list(spec["prompt"]),
            output=list(spec["output"]),
            tok_s=row["output_tokens"] / row["seconds"],
            speedup_vs_hf=row["output_tokens"] / row["seconds"] / hf_tok_s,
            padding_bound=padding_bound(hf_prompts, hf_outputs, batch),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        )
    if torch.cuda.is_available():
        name, sheet = gpu_sheet()
        peak = sheet.mem_bandwidth if sheet else None
        weights = sum(p.numel() * p.element_size() for p in llm.executor.model.parameters())
        for row in rows:
            row |= dict(gpu=name, weight_bytes=weights)
            if peak:  # decode roofline: every step reads all weights once
                longest = max(outputs[: row["requests_run"]])
                row["decode_roofline_s_floor"] = longest * weights / peak
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'workload':9} {'engine':40} {'seconds':>8} {'out tok/s':>10} {'vs hf':>6} "
        f"{'by round':>12} {'pad':>5}"
    )
    for r in rows:
        rounds = r.get("speedup_by_round", [])
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else ""
        print(
            f"{r['workload']:9} {r['engine']:40} {r['seconds']:>8.2f} {r['tok_s']:>10.1f} "
            f"{r['speedup_vs_hf']:>5.2f}x {spread:>12} {r['padding_bound']:>5.2f}"
        )
    print("\nshare of step time (ours), all steps / decode-only steps:")
    print(
        f"{'workload':9} {'engine':16} {'kind':8} {'steps':>6} "
        + " ".join(f"{p[:9]:>9}" for p in PARTS)
    )
    for r in rows:
        for kind, shares in r.get("breakdown", {}).items():
            if kind not in ("all", "decode"):
                continue
            cells = " ".join(f"{shares[p]:>9.1%}" for p in PARTS)
            print(f"{r['workload']:9} {r['engine']:16} {kind:8} {shares['steps']:>6} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["short", "nano"], choices=list(WORKLOADS))
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["auto"] if torch.cuda.is_available() else ["torch", "cpu-torch", "cpu"],
        help="attention paths of our engine (default: triton on CUDA, else the torch "
        "reference, the CPU path on torch alone, and the CPU path with its C++ kernel)",
    )
    ap.add_argument("--model", help="a custom workload on this conf/model (instead of --workloads)")
    ap.add_argument("--requests", type=int, default=64, help="(custom workload)")
    ap.add_argument("--prompt", type=int, nargs=2, default=[100, 1024], help="(custom workload)")
    ap.add_argument("--output", type=int, nargs=2, default=[100, 1024], help="(custom workload)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=None, help="default: all it runs")
    ap.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="transformers runs only the first N requests (default: all); compared by tok/s",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="on CUDA, our engine's share of the card (transformers runs beside it)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every engine")
    ap.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = ap.parse_args()
    if args.model:
        WORKLOADS["custom"] = dict(
            model=args.model,
            requests=args.requests,
            prompt=tuple(args.prompt),
            output=tuple(args.output),
        )
        args.workloads = ["custom"]
    rows = []
    for name in args.workloads:
        rows += run_workload(
            name,
            args.backends,
            args.hf_batch,
            args.repeats,
            args.max_num_seqs,
            args.hf_requests,
            args.gpu_memory_utilization,
        )
    print_table(rows)
    write_results(args.out, "engine_throughput", rows, backends=args.backends, repeats=args.repeats)


if __name__ == "__main__":
    main()
