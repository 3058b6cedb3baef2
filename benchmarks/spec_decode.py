"""Speculative decoding on the real engine, and the simulator's prediction of it.

stories260K (the shared real model) on this machine, greedy, 64 output tokens
per request, TinyStories openings as prompts, all requests of a batch at once.
For each proposer (off; n-gram k=3; the model's own first 4 of 5 layers as its
draft, k=3) and batch size: acceptance rate, mean acceptance length, output
tokens per second, and speculation's speedup over no speculation in the same
run (repeats interleaved, medians). Speculation pays while a step's cost barely
grows with its tokens and stops where the batch saturates the machine: the
crossover is the first batch size whose speedup is below 1.

Then the same batches simulated: the profile of stories260K on this hardware
(``--profile``; measured first with the quick grid when not given), each
proposer's acceptance table as the real runs measured it, the n-gram
proposer's fitted CPU time, and the draft's passes from the profile of
stories260K cut to its first 4 layers (``tinystories-260k.first4.csv`` beside
the profile; measured likewise when missing). Where the two crossovers lie is
the question.

    python benchmarks/spec_decode.py [--batches 1 4 16 64] [--repeats 3]
        [--profile PATH] [--out benchmarks/results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from common import write_results

from testbed.build import model_spec
from testbed.config_schema import compose_config
from testbed.core import Request, SamplingParams
from testbed.core.spec_stats import ProposerTime, SpecDecodingStats
from testbed.engine.args import EngineArgs
from testbed.engine.factory import engine_model
from testbed.engine.llm import LLM
from testbed.models import models_dir
from testbed.modes.sim import simulate
from testbed.profiling.profiler import run_profile
from testbed.report.rundir import write_spec_acceptance

OPENINGS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog went to the park.",
    "Tom had a red ball. He liked to play with it every day.",
    "There was a small bird who lived in a tree.",
    "Sue and her mom went to the store to buy some food.",
    "The sun was shining and the sky was blue.",
    "A little boy named Ben found a shiny rock.",
    "Max the cat was very hungry.",
]
OUTPUT = 64
K = 3
DRAFT_LAYERS = 4  # the draft: stories260K's first 4 of its 5 layers
PROPOSERS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
    "draft_model": {
        "method": "draft_model",
        "num_speculative_tokens": K,
        "draft_num_layers": DRAFT_LAYERS,
    },
}


def model_path() -> str:
    return str(models_dir() / "stories260K" / "hf")


def prompts(n: int) -> list[str]:
    return [f"{OPENINGS[i % len(OPENINGS)]} {i}" for i in range(n)]


def engine(name: str, batch: int) -> LLM:
    spec = PROPOSERS[name]
    if spec and spec["method"] == "draft_model":
        spec = {**spec, "model": model_path()}
    threads = None if torch.cuda.is_available() else 1  # on a CPU: one thread (cpu1)
    return LLM(model_path(), max_num_seqs=max(batch, 1), speculative_config=spec, threads=threads)


def measure(llm: LLM, batch: int) -> tuple[float, int]:
    """Wall seconds of one batch, and its output tokens."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def simulated_tok_s(
    profile: Path,
    hardware: str,
    batch: int,
    prompt_lens: list[int],
    spec: dict | None,
    table: Path | None,
    propose_s: tuple[float, float],
) -> float:
    overrides = [
        "mode=sim",
        "model=tinystories-260k",
        f"hardware={hardware}",
        "logging=disabled",
        "progress=false",
        "plots=false",
        f"profiles_dir={profile.parent.parent}",
        f"engine.max_num_seqs={max(batch, 1)}",
    ]
    if spec:
        overrides += [f"engine.speculative.{k}={v}" for k, v in spec.items()]
        overrides.append(f"engine.speculative.acceptance_table={table}")
        if spec["method"] == "draft_model":  # its passes: the cut model's profile
            overrides.append("engine.speculative.model=tinystories-260k")
        else:
            overrides += [
                f"engine.speculative.propose_s_per_step={propose_s[0]}",
                f"engine.speculative.propose_s_per_request={propose_s[1]}",
            ]
    cfg = compose_config(overrides)
    reqs = [
        Request(
            f"b{i}",
            num_prompt_tokens=n,
            target_output_tokens=OUTPUT,
            arrival_time=0.0,
            sampling_params=SamplingParams(max_tokens=None, ignore_eos=True),
        )
        for i, n in enumerate(prompt_lens)
    ]
    result, _ = simulate(cfg, reqs, model_spec(cfg.model))
    return batch * OUTPUT / result.duration_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hardware", default="cpu1", help="the simulator's hardware config")
    ap.add_argument("--profile", type=Path, help="stories260K's profile on that hardware")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    a = ap.parse_args()
    if not (Path(model_path()) / "config.json").exists():
        raise SystemExit(f"stories260K not found at {model_path()} (set TESTBED_MODELS_DIR)")
    rows = []
    for batch in a.batches:
        llms = {name: engine(name, batch) for name in PROPOSERS}
        times = {name: [] for name in PROPOSERS}
        for llm in llms.values():
            measure(llm, min(batch, 2))  # warm up
            llm.engine.scheduler.spec_stats = SpecDecodingStats()
            llm.executor.proposer_time = ProposerTime()
        tokens = 0
        for _ in range(a.repeats):
            for name, llm in llms.items():
                wall, tokens = measure(llm, batch)
                times[name].append(wall)
        base = statistics.median(times["off"])
        for name, llm in llms.items():
            stats = llm.engine.scheduler.spec_stats
            ex = llm.executor
            rows.append(
                dict(
                    batch=batch,
                    proposer=name,
                    wall_s=statistics.median(times[name]),
                    out_tok_s=tokens / statistics.median(times[name]),
                    speedup=base / statistics.median(times[name]),
                    acceptance_rate=stats.acceptance_rate if name != "off" else None,
                    mean_acceptance_length=stats.mean_acceptance_length if name != "off" else None,
                    propose_s=ex.proposer_time.fit(),
                    table=stats.table(),
                )
            )
        print(
            f"batch {batch}: "
            + ", ".join(
                f"{r['proposer']} {r['out_tok_s']:.0f} tok/s x{r['speedup']:.2f}"
                for r in rows
                if r["batch"] == batch
            )
        )
    profile = (
        a.profile or Path("outputs/spec_decode/profiles") / a.hardware / "tinystories-260k.csv"
    )
    draft_profile = profile.with_name(f"tinystories-260k.first{DRAFT_LAYERS}.csv")
    for path, layers in ((profile, None), (draft_profile, DRAFT_LAYERS)):
        if path.exists():
            continue
        print(
            f"profiling stories260K (quick grid{f', first {layers} layers' if layers else ''}) ..."
        )
        args = EngineArgs(model=model_path(), threads=None if torch.cuda.is_available() else 1)
        model = engine_model("tinystories-260k", layers)
        run_profile(
            args, "quick", out_dir=path.parent.parent, hardware=a.hardware,
            model_name=model[2], model=model,
        )  # fmt: skip
    tokenizer = engine("off", 1)
    lens = [len(tokenizer._encode(p)) for p in prompts(max(a.batches))]
    with tempfile.TemporaryDirectory() as tmp:
        for r in rows:
            spec = PROPOSERS[r["proposer"]]
            table = None
            if spec:
                folder = Path(tmp) / f"{r['proposer']}-{r['batch']}"
                folder.mkdir()
                write_spec_acceptance(folder, r["table"])
                table = folder / "spec_acceptance.csv"
            r["sim_out_tok_s"] = simulated_tok_s(
                profile, a.hardware, r["batch"], lens[: r["batch"]], spec, table, r["propose_s"]
            )
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["proposer"] == "off")
        r["sim_speedup"] = r["sim_out_tok_s"] / base["sim_out_tok_s"]
    crossovers = {}
    for name in ("ngram", "draft_model"):
        for side, key in (("real", "speedup"), ("sim", "sim_speedup")):
            below = [r["batch"] for r in rows if r["proposer"] == name and r[key] < 1]
            crossovers[f"{name}_{side}"] = min(below) if below else None
    table = pd.DataFrame([{k: v for k, v in r.items() if k != "table"} for r in rows])
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print("crossover (first batch where speculation is slower):", crossovers)
    write_results(
        a.out,
        "spec_decode",
        rows,
        model="stories260K",
        output_tokens=OUTPUT,
        k=K,
        repeats=a.repeats,
        profile=str(profile),
        draft_profile=str(draft_profile),
        crossovers=crossovers,
    )


if __name__ == "__main__":
    main()
