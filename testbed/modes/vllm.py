"""``mode=vllm``: replay the requests on vLLM itself, with the run's policy inside
vLLM's scheduler (:class:`~testbed.vllm_backend.scheduler.PolicyScheduler`).

vLLM runs in its own environment (``.venv-vllm``, set up on first use by
:mod:`testbed.vllm_backend.install`), in a child process
(:mod:`testbed.vllm_backend.child`) that replays the requests on the wall clock
as ``mode=real`` does and hands back the same records; this process writes the
run folder, so that every mode's folder, metrics and W&B run look alike. The
model is the run's: its HF folder, or its seeded dummy weights written as one
(:mod:`testbed.engine.hf_export`, the same weights ``mode=real`` builds).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from testbed.bootstrap import ROOT
from testbed.build import engine_args, max_concurrency, run_model
from testbed.core import Request
from testbed.engine.device import cpu_name
from testbed.errors import InputError
from testbed.host import usable_cpus
from testbed.metrics import RunResult
from testbed.models import ModelSpec
from testbed.profile_table import profile_path, read_profile_header
from testbed.vllm_backend import install
from testbed.vllm_backend.support import FORGET_KEY, POLICY_KEY

# vLLM's CPU attention takes KV blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32
# Requests served before the replay and not measured: vLLM compiles and its
# caches warm on first use, and its first steps at a new size run slow.
WARMUP_PROMPTS = (16, 48, 100, 200, 300, 500, 800, 1200, 1600)


def run_vllm(
    cfg: DictConfig,
    requests: Sequence[Request],
    spec: ModelSpec,
    on_progress: Callable[[float, int], None] | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Replay ``requests`` on vLLM; the run's records and vLLM's fields of ``metrics.json``."""
    args = vllm_engine_args(cfg, spec)
    python = install.ensure()
    job = {
        "engine_args": args,
        "requests": list(requests),
        "warmup": warmup_requests(spec.vocab_size, cfg.seed, args["max_model_len"]),
        "max_wall_s": cfg.mode.max_wall_s,
    }
    payload = run_child(python, job, on_progress, cfg.mode.threads)
    result: RunResult = payload["result"]
    done = {r.request_id: r for r in result.requests}
    result.requests = [done.get(r.request_id, r) for r in requests]
    num_steps = max(payload["num_steps"], 1)
    served = [r for r in result.requests if r.num_cached_tokens >= 0]
    prompt = sum(r.num_prompt_tokens for r in served)
    extra = {
        "latency_model": "measured",
        "latency_model_source": f"vLLM {payload['vllm_version']} (PolicyScheduler)",
        "machine": cpu_name(),
        "vllm_version": payload["vllm_version"],
        "vllm_dtype": args["dtype"],
        "num_kv_blocks": args["num_gpu_blocks_override"],
        "prefix_cache_hit_rate": (
            sum(r.num_cached_tokens for r in served) / prompt if prompt else 0.0
        ),
        "scheduler_ms_per_step": 1e3 * payload["schedule_s"] / num_steps,
        "vllm_build_s": payload["build_s"],
        "vllm_warmup_s": payload["warmup_s"],
        "threads": payload["threads"],
        "partial": result.partial,
        "stop_reason": result.stop_reason,
        **vllm_speed(cfg, spec, result),
    }
    return result, extra


def vllm_speed(cfg: DictConfig, spec: ModelSpec, result: RunResult) -> dict[str, Any]:
    """The run's speed against vLLM's profile of its hardware and model (a table
    whose header says ``engine: vllm ...``, as ``experiments.vllm_fidelity profile``
    writes it, under ``profiles_dir``); nothing where the profile is another
    engine's: this project's engine's profile says nothing of vLLM's speed."""
    from testbed.modes.real import speed_vs_profile

    path = profile_path(cfg.profiles_dir, cfg.hardware.name, spec.name)
    if not path.exists() or not read_profile_header(path).get("engine", "").startswith("vllm"):
        return {}
    return speed_vs_profile(cfg, spec, result.steps)


def vllm_engine_args(cfg: DictConfig, spec: ModelSpec) -> dict[str, Any]:
    """vLLM ``EngineArgs`` fields for the run's engine settings, policy and model;
    settings vLLM (or the policy class) cannot honour are refused here, by name."""
    import torch  # only where a mode needs it

    from testbed.engine.factory import engine_kv_blocks
    from testbed.engine.hf_export import hf_folder

    a = engine_args(cfg)
    if a.speculative_config is not None:
        raise InputError("mode=vllm: engine.speculative is not passed to vLLM yet")
    if cfg.cluster.num_replicas > 1 or cfg.cluster.num_prefill > 0:
        raise InputError("mode=vllm: one vLLM engine only (cluster=single)")
    if max_concurrency(cfg) is not None:
        raise InputError("mode=vllm: closed-loop traces (trace=concurrency) are not replayed yet")
    if a.block_size % CPU_BLOCK_MULTIPLE:
        raise InputError(
            f"engine.block_size={a.block_size}: vLLM's CPU attention needs a multiple of "
            f"{CPU_BLOCK_MULTIPLE}; pass engine.block_size={CPU_BLOCK_MULTIPLE} (to every "
            "mode that is compared with this run)"
        )
    dtype = a.dtype or cfg.model.get("dtype") or "float32"
    # The real engine's own count on a CPU (its KV budget), so both engines hold as much.
    blocks = engine_kv_blocks(a, spec, dtype, torch.device("cpu"), measure=None)
    folder = hf_folder(run_model(cfg), cfg.seed)
    return {
        "model": str(folder),
        "dtype": dtype,
        "seed": cfg.seed,
        "block_size": a.block_size,
        "num_gpu_blocks_override": blocks,
        # Its memory for them (and the null block), not a share of the machine's:
        # vLLM's CPU worker otherwise asks for most of the free memory.
        "kv_cache_memory_bytes": (blocks + 1) * a.block_size * spec.kv_bytes_per_token(dtype),
        "max_model_len": a.max_model_len or spec.max_position_embeddings,
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "enable_chunked_prefill": a.enable_chunked_prefill,
        "enable_prefix_caching": a.enable_prefix_caching,
        "long_prefill_token_threshold": a.long_prefill_token_threshold,
        "additional_config": {
            POLICY_KEY: a.policy,
            FORGET_KEY: bool(cfg.mode.forget_uncomputed),
        },
    }


def warmup_requests(vocab: int, seed: int, max_model_len: int) -> list[Request]:
    """Requests that make vLLM compile and allocate before the replay: prompts of
    several lengths (those that fit), decoding together for a while."""
    from testbed.core import SamplingParams
    from testbed.workload import prompt_tokens

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    lengths = [n for n in WARMUP_PROMPTS if n + params.max_tokens <= max_model_len]
    return [
        Request(
            request_id=f"warmup-{i}",
            prompt_token_ids=prompt_tokens(10**6 + i, n, None, 512, vocab, seed),
            sampling_params=params,
        )
        for i, n in enumerate(lengths)
    ]


def run_child(
    python: Path,
    job: dict[str, Any],
    on_progress: Callable[[float, int], None] | None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run the replay in the vLLM environment (``threads``: its OpenMP threads; None:
    vLLM's choice); its payload. An interrupt here is passed to the child, whose
    partial result comes back (``result.error``)."""
    with tempfile.TemporaryDirectory(prefix="testbed-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.pkl", Path(tmp) / "out.pkl"
        with open(job_path, "wb") as f:
            pickle.dump(job, f)
        read, write = os.pipe()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "TESTBED_PROGRESS_FD": str(write),
        }
        if threads is not None:  # vLLM's CPU worker binds one thread to each core listed
            cores = sorted(usable_cpus())[:threads]
            env["OMP_NUM_THREADS"] = str(len(cores))
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        cmd = [str(python), "-m", "testbed.vllm_backend.child", str(job_path), str(out_path)]
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, pass_fds=(write,))
        os.close(write)
        reader = threading.Thread(target=_forward, args=(read, on_progress), daemon=True)
        reader.start()
        interrupted = None
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt as e:  # the child stops too and writes what it has
                interrupted = e
                proc.send_signal(signal.SIGINT)
        reader.join(timeout=5)
        if not out_path.exists():
            if interrupted is not None:
                raise interrupted
            raise RuntimeError(f"the vLLM replay failed (exit {code}); its output is above")
        with open(out_path, "rb") as f:
            payload = pickle.load(f)
    if interrupted is not None and payload["result"].error is None:
        payload["result"].error = interrupted
        payload["result"].partial = True
    return payload


def _forward(fd: int, on_progress: Callable[[float, int], None] | None) -> None:
    with os.fdopen(fd) as stream:
        for line in stream:
            if on_progress is not None:
                t, done = line.split()
                on_progress(float(t), int(done))
