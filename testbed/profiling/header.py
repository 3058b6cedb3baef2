"""The profile table's header: where, when and how a profile was measured."""

from __future__ import annotations

import platform
import time

import torch

from testbed.engine.args import EngineArgs
from testbed.engine.device import cpu_name, machine_name
from testbed.kernels import describe
from testbed.profiling.measure import SAMPLING


def profile_header(
    args: EngineArgs,
    replay_args: EngineArgs,
    executor,
    hardware: str,
    name: str,
    repeats: int,
    warmup: int,
) -> dict:
    """Where, when and how a profile was measured."""
    device = executor.device
    machine = machine_name(device)
    return {
        "device": machine
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
        + (f", pinned to cores {sorted(args.cpus)}" if args.cpus is not None else ""),
        "machine": machine,
        "cpu": cpu_name(),
        "hardware": hardware,
        "model": name,
        "dtype": str(next(executor.model.parameters()).dtype).removeprefix("torch."),
        "tensor_parallel": 1,
        "block_size": args.block_size,
        "attention_backend": type(executor.backend).__name__
        if not hasattr(executor.backend, "__name__")
        else describe(executor.backend),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "repeats": repeats,
        "warmup": warmup,
        "sampling": ", ".join(f"{k}={v}" for k, v in SAMPLING.items()),
        "replay_engine": f"max_num_seqs={replay_args.max_num_seqs}, "
        f"max_num_batched_tokens={replay_args.max_num_batched_tokens}, "
        f"prefix_caching={replay_args.enable_prefix_caching}",
        "measured_by": "testbed.profiling (python run.py mode=profile)",
    }
