"""Our engine against vLLM's CPU build on the same weights: offline throughput,
where step time goes, and online latency on a trace.

Workloads (seed 0, every request runs to its output length), on the dummy Llama
of ``engine_throughput.py`` (8 layers, hidden 512, 8 heads, 4 KV heads,
vocabulary 8000), in each ``--dtypes`` precision:

- ``short``: 48 requests, prompts of 32-256 tokens, outputs of 16-160;
- ``long``: nano-vllm's shape, prompts and outputs uniform in [100, 1024], 32 requests;
- ``tiny``: 4 short requests, a smoke test of this script.

Both engines take 64 sequences and 2048 tokens a step, KV blocks of 32 tokens
(vLLM's CPU attention takes multiples of 32), as many blocks (our engine's CPU
budget, 512 MiB) and a thread on every core (vLLM binds one to each). vLLM
loads our dummy weights written as an HF folder (``testbed.engine.hf_export``)
and runs in its own environment (``.venv-vllm``), one server process per
precision kept across rounds
(``testbed/vllm_backend/offline.py``); where that environment is not set up,
our engine runs alone and the output says how to set it up.

Offline: ``--repeats`` rounds of every engine and precision, ours first in even
rounds and vLLM first in odd ones, so that a drift of the machine reaches both;
each run follows a short warm-up and a second's pause (vLLM binds one OpenMP
thread to each core, and anything else running slows it badly, so the other
side must be idle and its spinning threads asleep; each run records the cores
that other processes kept busy, and warns). Reported: median seconds and
output tok/s, each round's tok/s, ours over vLLM by round and of the medians,
how many requests' greedy outputs agree, and where step time goes (one more
untimed run each: ours through ``StepBreakdown``, vLLM through wall-clock
wrappers and a ``torch.profiler`` window that splits its compiled forward pass
by op).

Online: the first ``--online-requests`` requests of Azure conv (``trace=azure_conv``
from the shared traces folder, lengths capped at the model's 2048 as
``trace.max_model_len`` does) at 70% of capacity, per precision: the offline
request throughput of the slower engine in that precision on those requests.
In each precision both engines replay the same arrivals
(``testbed.engine.replay``; vLLM through ``VllmEngine`` with the fcfs policy,
as ``mode=vllm``); TTFT, TPOT, E2E and throughput as ``testbed.metrics``
defines them, medians over ``--online-repeats`` rounds.

    python benchmarks/engine_vs_vllm.py [--workloads short long] [--dtypes float32 bfloat16]
        [--repeats 3] [--online-requests 100] [--online-repeats 1] [--no-online]
        [--out benchmarks/results/engine_vs_vllm.json]

An interrupt (Ctrl-C) stops the vLLM servers and writes what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import signal
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import write_results
from engine_throughput import SHORT_MODEL, run_ours, workload
from engine_throughput import WORKLOADS as THROUGHPUT_WORKLOADS
from step_breakdown import PARTS, StepBreakdown

from testbed.core import Request
from testbed.engine.llm import LLM
from testbed.engine.replay import replay
from testbed.host import cpu_fields, usable_cores, usable_cpus
from testbed.metrics import RunResult
from testbed.metrics.summary import summarize
from testbed.threads import TICK_S, cpu_ticks, thread_settings
from testbed.workload import to_requests
from traces import load_trace

WORKLOADS = {
    "short": THROUGHPUT_WORKLOADS["short"],
    "long": {**THROUGHPUT_WORKLOADS["nano"], "model": SHORT_MODEL, "requests": 32},
    "tiny": dict(model=SHORT_MODEL, requests=4, prompt=(16, 64), output=(4, 12)),
}
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=2048, block_size=32)
MAX_LEN = SHORT_MODEL["hf_config"]["max_position_embeddings"]
VOCAB = SHORT_MODEL["hf_config"]["vocab_size"]
SEED = 0
TRACE = "azure_conv"
LOAD = 0.7  # of capacity, the online arrival rate
QUIET_S = 1.0  # the pause before each measured run, for the other side's threads to sleep
BUSY_WARNING = 0.2  # cores kept busy by other processes during a run, past which it says so
WARMUP = 4  # requests of a short run before each measured one
ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
ONLINE = ("ttft_s_p50", "ttft_s_p99", "tpot_s_mean", "tpot_s_p50", "e2e_s_mean", "e2e_s_p50")
ONLINE += ("throughput_req_s", "throughput_output_tok_s", "num_finished", "duration_s")


class OtherLoad:
    """The cores that processes other than the measured ones kept busy, on average,
    over a ``with`` block (``cores``; nan where ``/proc`` cannot be read): vLLM's
    bound threads slow badly beside any other work, so a busy machine shows here
    rather than as a slow engine."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.cores = pids, float("nan")

    def _now(self) -> tuple[float, float, float]:
        busy, own = cpu_ticks(usable_cpus())  # own: this process, all its threads
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            own += (int(stat[11]) + int(stat[12])) * TICK_S  # utime, stime
        return time.perf_counter(), busy, own

    def __enter__(self) -> OtherLoad:
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        (t0, busy0, own0), (t1, busy1, own1) = self._start, self._now()
        others = (busy1 - busy0) - (own1 - own0)  # clock ticks: rounded to 0.001 core
        self.cores = round(max(0.0, others) / (t1 - t0), 3) if t1 > t0 else float("nan")


class Engines:
    """Our engine in each precision (in this process) and vLLM's (a server each).
    Each measured run starts after a pause, with the other side idle, and records
    the load that others put on the machine meanwhile (``last_load``).

    Our engine runs one thread per usable core, as vLLM binds one to each: its
    default governor (``testbed/threads.py``) would count the vLLM server's work
    between runs as another process's and take fewer."""

    def __init__(self, dtypes: list[str]) -> None:
        self.dtypes = dtypes
        self.ours = {
            d: LLM(SHORT_MODEL, dtype=d, seed=SEED, threads=usable_cores(), **ENGINE)
            for d in dtypes
        }
        self.vllm: dict[str, Any] = {}
        self.vllm_info: dict[str, Any] = {}
        self.last_load = float("nan")

    @property
    def sides(self) -> list[str]:
        return ["ours", "vllm"] if self.vllm else ["ours"]

    def order(self, round_: int) -> list[str]:
        return self.sides if round_ % 2 == 0 else self.sides[::-1]

    @contextlib.contextmanager
    def measured(self, side: str, dtype: str):
        """Pause (the other side's spinning threads go to sleep), then watch the
        machine over the block; warn where others kept it busy."""
        time.sleep(QUIET_S)
        pids = [self.vllm[dtype].proc.pid] if side == "vllm" else []
        with OtherLoad(pids) as load:
            yield
        self.last_load = load.cores
        if load.cores > BUSY_WARNING:
            print(
                f"  WARNING: other processes kept {load.cores:.2f} cores busy during "
                f"{side} {dtype}'s run: its time is not the engine's alone"
            )

    def start_vllm(self) -> str | None:
        """One vLLM server per precision, built and warmed up; None, or why vLLM is
        skipped (its environment is not set up)."""
        from testbed.engine.hf_export import hf_folder
        from testbed.models import resolve_model
        from testbed.modes.vllm import warmup_requests
        from testbed.vllm_backend import install
        from testbed.vllm_backend.offline import OfflineVllm

        if not install.ready():
            return f"vLLM skipped: {install.VENV} is not set up; run `{install.COMMAND}`"
        folder = hf_folder(resolve_model(SHORT_MODEL), SEED)
        warmup = warmup_requests(VOCAB, SEED, MAX_LEN)
        for dtype, llm in self.ours.items():
            blocks = llm.engine.scheduler.kv.num_blocks
            args = dict(
                model=str(folder),
                dtype=dtype,
                seed=SEED,
                max_model_len=MAX_LEN,
                **ENGINE,
                # As many blocks as ours (and the null block): vLLM's CPU worker
                # otherwise asks for most of the free memory.
                num_gpu_blocks_override=blocks,
                kv_cache_memory_bytes=(blocks + 1)
                * ENGINE["block_size"]
                * resolve_model(SHORT_MODEL).spec().kv_bytes_per_token(dtype),
            )
            server = OfflineVllm(install.python())
            self.vllm[dtype] = server
            print(f"[vllm {dtype}] building (log: {server.log}) ...", flush=True)
            self.vllm_info[dtype] = server.call("build", engine_args=args, warmup=warmup)
        return None

    def generate(self, side: str, dtype: str, prompts, outputs) -> tuple[float, list[list[int]]]:
        """Seconds and each request's tokens of one measured offline run (after a
        warm-up of a few short requests)."""
        warm = min(WARMUP, len(prompts))
        if side == "ours":
            llm = self.ours[dtype]
            with self.measured(side, dtype):
                run_ours(llm, prompts[:warm], [8] * warm)
                llm.engine.scheduler.kv.reset_prefix_cache()  # the warm-up shares prompts
                return run_ours(llm, prompts, outputs)
        server = self.vllm[dtype]
        with self.measured(side, dtype):
            server.call("generate", prompts=prompts[:warm], outputs=[8] * warm)
            out = server.call("generate", prompts=prompts, outputs=outputs)
        return out["seconds"], out["token_ids"]

    def breakdown(self, side: str, dtype: str, prompts, outputs) -> tuple[dict, dict]:
        """Where one more run's step time goes, as ``StepBreakdown.summary()``, and
        for vLLM how it was split (:func:`vllm_shares`)."""
        with self.measured(side, dtype):
            if side == "vllm":
                raw = self.vllm[dtype].call("breakdown", prompts=prompts, outputs=outputs)
                return vllm_shares(raw)
            llm = self.ours[dtype]
            warm = min(WARMUP, len(prompts))
            run_ours(llm, prompts[:warm], [8] * warm)
            llm.engine.scheduler.kv.reset_prefix_cache()
            with StepBreakdown(llm) as b:
                run_ours(llm, prompts, outputs)
            return b.summary(), {}

    def prepare_replays(self) -> None:
        """Build and warm up each vLLM server's replay engine, before any is timed."""
        for dtype, server in self.vllm.items():
            out = server.call("replay", requests=[])
            self.vllm_info[dtype]["replay_engine_build_s"] = out["build_s"]

    def replay(self, side: str, dtype: str, requests: list[Request]) -> tuple[RunResult, dict]:
        """One online replay; its records, and for vLLM its scheduler's time per step."""
        if side == "vllm":
            with self.measured(side, dtype):
                out = self.vllm[dtype].call("replay", requests=requests)
            per_step = out["schedule_s"] / max(out["num_steps"], 1)
            return out["result"], {"scheduler_ms_per_step": 1e3 * per_step}
        engine = self.ours[dtype].engine
        engine.scheduler.kv.reset_prefix_cache()
        with self.measured(side, dtype):
            result = replay(engine, requests)
        if result.error is not None:  # an interrupt, or a failure: the run stops
            raise result.error
        return result, {}

    def close(self) -> None:
        for server in self.vllm.values():
            try:
                server.close()
            except OSError as e:  # the others are stopped all the same
                print(f"WARNING: stopping a vLLM server: {e!r}")


def vllm_shares(raw: dict[str, Any]) -> tuple[dict, dict]:
    """vLLM's parts of step time (``offline.Server.breakdown``'s wall-clock sums) in
    ``PARTS``, as ``StepBreakdown.summary()``: its forward pass split by the
    profiled window's attention and linear shares of the same step kind (or of
    all its passes, where the window had none of that kind); and the split's
    details (the scheduler's own share of the control plane's, the window, the
    ops that matched)."""
    ops = raw["forward_ops"]
    every = {p: sum(k[p] for k in ops.values()) for p in ("forward", "attention", "linear")}
    b = StepBreakdown(None)
    for kind, s in raw["seconds"].items():
        split = ops.get(kind) or every
        forward = s.get("forward", 0.0)
        part = b.seconds[kind]
        for op in ("attention", "linear"):  # nan where no forward pass was profiled
            part[op] = forward * split[op] / split["forward"] if split["forward"] else math.nan
        part["other_forward"] = forward - part["attention"] - part["linear"]
        part["lm_head_sampling"] = s.get("logits", 0.0) + s.get("sample", 0.0)
        part["prepare"] = s.get("execute", 0.0) - forward - s.get("logits", 0.0)
        part["control_plane"] = s["step"] - s.get("execute", 0.0) - s.get("sample", 0.0)
        part["total"] = s["step"]
        b.steps[kind] = raw["steps"][kind]
    summary = b.summary()
    scheduler = sum(s.get("schedule", 0.0) + s.get("update", 0.0) for s in raw["seconds"].values())
    detail = dict(
        scheduler_share=scheduler / summary["all"]["seconds"] if summary["all"]["seconds"] else 0.0,
        profiled_steps=raw["profiled_steps"],
        profiled_forward=ops,
        op_seconds=raw["op_seconds"],
    )
    return summary, detail


@dataclass
class Measured:
    """Everything measured so far (an interrupted run reports it)."""

    offline: dict[tuple, list[float]] = field(default_factory=lambda: defaultdict(list))
    offline_load: dict[tuple, list[float]] = field(default_factory=lambda: defaultdict(list))
    tokens: dict[tuple, list[list[int]]] = field(default_factory=dict)
    breakdown: dict[tuple, tuple[dict, dict]] = field(default_factory=dict)
    capacity: dict[tuple, float] = field(default_factory=dict)
    online: dict[tuple, list[dict]] = field(default_factory=lambda: defaultdict(list))
    online_info: dict[str, Any] = field(default_factory=dict)
    online_rates: dict[str, dict] = field(default_factory=dict)  # by dtype


def run_offline(engines: Engines, name: str, repeats: int, m: Measured) -> None:
    spec = WORKLOADS[name]
    prompts, outputs = workload(spec["requests"], spec["prompt"], spec["output"], VOCAB, SEED)
    for r in range(repeats):
        for side in engines.order(r):
            for dtype in engines.dtypes:
                seconds, tokens = engines.generate(side, dtype, prompts, outputs)
                m.offline[name, side, dtype].append(seconds)
                m.offline_load[name, side, dtype].append(engines.last_load)
                m.tokens.setdefault((name, side, dtype), tokens)
                print(f"  {name} round {r} {side} {dtype}: {sum(outputs) / seconds:.0f} tok/s")
    for side in engines.sides:
        for dtype in engines.dtypes:
            m.breakdown[name, side, dtype] = engines.breakdown(side, dtype, prompts, outputs)


def online_requests(n: int, rate: float | None = None) -> tuple[list[Request], list[str]]:
    """Azure conv's first ``n`` requests with token ids, capped at the model's
    length, at their arrival times rescaled to ``rate`` req/s where given; and
    what the loader did to the trace (its notes)."""
    trace = load_trace(TRACE, num_requests=n, max_model_len=MAX_LEN, rate=rate)
    reqs = to_requests(trace, with_tokens=True, vocab_size=VOCAB, seed=SEED)
    return reqs, list(trace.attrs.get("notes", []))


def missing_trace(n: int) -> str | None:
    """Why the online part cannot run (the trace's file is not there), or None."""
    try:
        online_requests(n)
    except FileNotFoundError as e:
        print(f"online skipped: trace {TRACE}: {e}")
        return f"online skipped: trace {TRACE}: {e}"
    return None


def run_online(engines: Engines, n: int, repeats: int, m: Measured) -> None:
    """Capacity offline on the trace's requests, then both engines at ``LOAD`` of
    it, in each precision: the slower engine's capacity in that precision, so that
    no precision replays past what either engine sustains."""
    reqs, _ = online_requests(n)
    prompts = [r.prompt_token_ids for r in reqs]
    outputs = [r.sampling_params.max_tokens for r in reqs]
    for side in engines.sides:
        for dtype in engines.dtypes:
            m.capacity[side, dtype] = len(reqs) / engines.generate(side, dtype, prompts, outputs)[0]
    m.online_info.update(requests=len(reqs), load=LOAD)
    arrivals = {}
    for dtype in engines.dtypes:
        slower = min(engines.sides, key=lambda s: m.capacity[s, dtype])
        rate = LOAD * m.capacity[slower, dtype]
        arrivals[dtype], notes = online_requests(n, rate)
        m.online_rates[dtype] = dict(
            capacity_req_s=m.capacity[slower, dtype],
            capacity_from=slower,
            rate_req_s=rate,
            trace_notes=notes,
        )
        print(
            f"  online {dtype}: capacity {m.capacity[slower, dtype]:.2f} req/s ({slower}), "
            f"replaying at {rate:.2f}"
        )
    engines.prepare_replays()
    for r in range(repeats):
        for side in engines.order(r):
            for dtype in engines.dtypes:
                result, extra = engines.replay(side, dtype, copy.deepcopy(arrivals[dtype]))
                metrics = summarize(result)
                extra["other_load_cores"] = engines.last_load
                m.online[side, dtype].append({k: metrics[k] for k in ONLINE} | extra)
                print(
                    f"  online round {r} {side} {dtype}: TPOT {metrics['tpot_s_mean'] * 1e3:.1f} ms"
                )


def offline_rows(engines: Engines, m: Measured) -> list[dict]:
    rows = []
    for (name, side, dtype), times in m.offline.items():
        spec = WORKLOADS[name]
        _, outputs = workload(spec["requests"], spec["prompt"], spec["output"], VOCAB, SEED)
        tokens = sum(outputs)
        row = dict(
            kind="offline",
            workload=name,
            engine=side,
            dtype=dtype,
            requests=spec["requests"],
            prompt=list(spec["prompt"]),
            output=list(spec["output"]),
            output_tokens=tokens,
            seconds=statistics.median(times),
            rounds_s=times,
            tok_s=tokens / statistics.median(times),
            rounds_tok_s=[tokens / t for t in times],
            other_load_cores_by_round=m.offline_load[name, side, dtype],
        )
        row["breakdown"], detail = m.breakdown.get((name, side, dtype), ({}, {}))
        if detail:
            row["breakdown_detail"] = detail
        other = m.offline.get((name, "vllm", dtype))
        if side == "ours" and other:
            row["vs_vllm"] = statistics.median(other) / row["seconds"]  # tok/s ratio
            row["vs_vllm_by_round"] = [v / t for t, v in zip(times, other)]
            ours, theirs = m.tokens[name, "ours", dtype], m.tokens[name, "vllm", dtype]
            row["same_greedy_outputs"] = sum(a == b for a, b in zip(ours, theirs))
        if side == "ours":
            row |= thread_settings(engines.ours[dtype].executor.threads)
        else:
            row |= dict(threads=engines.vllm_info[dtype]["threads"])
        rows.append(row)
    return rows


def online_rows(m: Measured) -> list[dict]:
    rows = []
    for (side, dtype), rounds in m.online.items():
        medians = {k: statistics.median(r[k] for r in rounds) for k in ONLINE}
        rows.append(
            dict(
                kind="online",
                trace=TRACE,
                engine=side,
                dtype=dtype,
                **m.online_info,
                **m.online_rates.get(dtype, {}),
                offline_capacity_req_s=m.capacity.get((side, dtype)),
                **medians,
                rounds=rounds,
            )
        )
    for (side, dtype), req_s in m.capacity.items():
        if (side, dtype) not in m.online:  # measured, never replayed (interrupted)
            rows.append(
                dict(
                    kind="capacity",
                    trace=TRACE,
                    engine=side,
                    dtype=dtype,
                    offline_capacity_req_s=req_s,
                )
            )
    return rows


def table(head: list[str], lines: list[list[str]], left: int = 3) -> None:
    """Columns as wide as their widest cell, the first ``left`` left-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    for line in [head, *lines]:
        cells = [
            f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in enumerate(zip(line, widths))
        ]
        print("  ".join(cells))


def print_tables(rows: list[dict]) -> None:
    offline = [r for r in rows if r["kind"] == "offline"]
    key = ("workload", "dtype", "engine")
    print()
    table(
        [*key, "seconds", "out tok/s", "ours/vLLM", "rounds (tok/s)"],
        [
            [*(r[k] for k in key), f"{r['seconds']:.2f}", f"{r['tok_s']:.1f}"]
            + [f"{r['vs_vllm']:.2f}x" if "vs_vllm" in r else ""]
            + [" ".join(f"{t:.0f}" for t in r["rounds_tok_s"])]
            for r in offline
        ],
    )
    print("\nshare of step time, all steps / decode-only steps:")
    table(
        [*key, "kind", "steps", *(p[:9] for p in PARTS)],
        [
            [*(r[k] for k in key), kind, str(r["breakdown"][kind]["steps"])]
            + [f"{r['breakdown'][kind][p]:.1%}" for p in PARTS]
            for r in offline
            for kind in ("all", "decode")
            if kind in r["breakdown"]
        ],
        left=4,
    )
    online = [r for r in rows if r["kind"] == "online"]
    if online:
        print(f"\nonline ({TRACE}, 70% of each precision's capacity), ms (E2E: s):")
        ms = ONLINE[:4]
        table(
            ["dtype", "engine", "req/s", *ms, "e2e_s_mean", "e2e_s_p50", "out tok/s"],
            [
                [r["dtype"], r["engine"], f"{r['rate_req_s']:.2f}"]
                + [f"{1e3 * r[k]:.1f}" for k in ms]
                + [f"{r[k]:.2f}" for k in ("e2e_s_mean", "e2e_s_p50")]
                + [f"{r['throughput_output_tok_s']:.1f}"]
                for r in online
            ],
            left=2,
        )


def environment(engines: Engines, skipped: str | None) -> dict[str, Any]:
    flags = set(cpu_fields().get("flags", "").split())
    vllm = (
        {"skipped": skipped}
        if skipped
        else {
            "version": next(iter(engines.vllm_info.values()), {}).get("vllm_version"),
            "builds": engines.vllm_info,
        }
    )
    return dict(
        torch=torch.__version__,
        cores=usable_cores(),
        isa={f: f in flags for f in ISA_FLAGS},
        vllm=vllm,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["short", "long"], choices=list(WORKLOADS))
    ap.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    ap.add_argument("--repeats", type=int, default=3, help="offline rounds of every engine")
    ap.add_argument("--online-requests", type=int, default=100)
    ap.add_argument("--online-repeats", type=int, default=1)
    ap.add_argument("--no-online", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/engine_vs_vllm.json")
    args = ap.parse_args()
    m, engines, skipped, online_skipped = Measured(), None, None, None
    interrupted, failure = False, None
    try:
        engines = Engines(args.dtypes)
        skipped = engines.start_vllm()
        if skipped:
            print(skipped)
        for name in args.workloads:
            run_offline(engines, name, args.repeats, m)
        online_skipped = "--no-online" if args.no_online else missing_trace(args.online_requests)
        if online_skipped is None:
            run_online(engines, args.online_requests, args.online_repeats, m)
    except KeyboardInterrupt:
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not lose the results
        print("\ninterrupted: stopping the vLLM servers, then writing what was measured")
    except Exception as e:  # written too, then raised
        failure = e
    finally:
        if engines is not None:
            engines.close()
    rows = (offline_rows(engines, m) if engines else []) + online_rows(m)
    print_tables(rows)
    write_results(
        args.out,
        "engine_vs_vllm",
        rows,
        environment=environment(engines, skipped) if engines else {},
        vllm_skipped=skipped,
        online_skipped=online_skipped,
        interrupted=interrupted,
        error=repr(failure) if failure else None,
        repeats=args.repeats,
        online_repeats=args.online_repeats,
        engine=ENGINE,
        model=SHORT_MODEL["name"],
    )
    if failure is not None:
        raise failure
    if interrupted:
        sys.exit(130)  # as a shell reports an interrupted command


if __name__ == "__main__":
    main()
