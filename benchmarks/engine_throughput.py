"""Offline throughput: our engine against transformers' ``generate`` on the same model.

A fixed workload on the same weights, machine and run: by default nano-vllm's
shape (input and output lengths uniform in [100, 1024], seed 0, every request
runs to its output length), with 64 requests instead of 256 to suit a CPU.
transformers' ``generate`` with static batching is what a user without a paged
engine runs: it pads prompts and keeps finished sequences in the batch until
the longest is done. Both count only the output tokens the workload asks for.
On CUDA the JSON also records the GPU, the weight bytes and the decode-roofline
floor of the run (every decode step reads all weights once);
``benchmarks/decode_step.py`` measures the achieved bandwidth per step.

    python benchmarks/engine_throughput.py [--model dummy-llama] [--out ...json]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import write_results

from testbed.core import SamplingParams
from testbed.engine.llm import LLM

HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12}


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


def hf_model_like(llm: LLM):
    """transformers' model of the same config with our engine's exact weights."""
    import transformers

    raw = dict(llm.config.raw)
    arch = raw.get("architectures", ["LlamaForCausalLM"])[0]
    kind = raw.pop("model_type", "llama")
    config = transformers.AutoConfig.for_model(kind, **raw)
    model = getattr(transformers, arch)(config)
    state = {k: v for k, v in llm.executor.model.state_dict().items() if "rotary" not in k}
    model.load_state_dict(state, strict=False)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy-llama")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096)
    prompts, outputs = workload(
        args.requests, tuple(args.prompt), tuple(args.output), llm.config.vocab_size, 0
    )
    run_ours(llm, prompts[:4], [8] * 4)  # warm-up
    ours_s, _ = run_ours(llm, prompts, outputs)
    hf = hf_model_like(llm)
    run_hf(hf, prompts[:4], [8] * 4, 4)  # warm-up
    hf_s = run_hf(hf, prompts, outputs, args.hf_batch)
    tokens = sum(outputs)
    row = dict(
        model=args.model,
        device=str(llm.executor.device),
        requests=args.requests,
        output_tokens=tokens,
        ours_s=ours_s,
        hf_generate_s=hf_s,
        ours_tok_s=tokens / ours_s,
        hf_tok_s=tokens / hf_s,
        speedup=hf_s / ours_s,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in HBM.items() if k in name), None)
        weights = sum(p.numel() * p.element_size() for p in llm.executor.model.parameters())
        row |= dict(gpu=name, weight_bytes=weights)
        if peak:
            # Decode roofline: every step reads all weights once.
            steps = max(outputs)
            row["decode_roofline_s_floor"] = steps * weights / peak
    print(f"{'':14} {'seconds':>9} {'out tok/s':>10}")
    print(f"{'ours':14} {ours_s:>9.2f} {row['ours_tok_s']:>10.1f}")
    print(f"{'hf generate':14} {hf_s:>9.2f} {row['hf_tok_s']:>10.1f}")
    print(f"speed-up: {row['speedup']:.2f}x (aim: >= 3x on CPU with the default model)")
    write_results(
        args.out,
        "engine_throughput",
        [row],
        prompt=args.prompt,
        output=args.output,
        hf_batch=args.hf_batch,
    )


if __name__ == "__main__":
    main()
