"""vLLM's side of the comparison: the replay tool and the venv it runs in.

The tool (``vllm_steps.py``) lives in ``$TESTBED_VLLM_REPLAY_DIR`` (default
``../shared/tools/vllm_replay`` beside the checkout); its venv's python is
``$TESTBED_VLLM_REPLAY_PYTHON`` (default ``~/.cache/vllm-replay-venv/bin/python``,
where the tool's ``setup.sh`` puts it). vLLM runs in a subprocess of that
python, through ``vllm_shim.py``, which adds per-request priorities and data
and, with ``Settings.vllm_class``, builds that scheduler class (a testbed policy
inside vLLM, ``testbed.vllm_backend``) with the policy's spec.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("vllm_shim.py")
STOCK_POLICIES = ("fcfs", "priority")  # vLLM's own --scheduling-policy choices
POLICY_CLASS = "testbed.vllm_backend.scheduler.PolicyScheduler"


def tool_dir() -> Path:
    default = ROOT.parent / "shared" / "tools" / "vllm_replay"
    return Path(os.environ.get("TESTBED_VLLM_REPLAY_DIR", str(default)))


def replay_python() -> Path:
    default = Path.home() / ".cache" / "vllm-replay-venv" / "bin" / "python"
    return Path(os.environ.get("TESTBED_VLLM_REPLAY_PYTHON", str(default)))


def missing() -> str | None:
    """Why vLLM's side cannot run here (with how to set it up), or None."""
    tool, py = tool_dir(), replay_python()
    if not (tool / "vllm_steps.py").is_file():
        return (
            f"vLLM replay tool not found at {tool} "
            "(set TESTBED_VLLM_REPLAY_DIR to the folder holding vllm_steps.py)"
        )
    if not py.is_file():
        return (
            f"vLLM replay venv not found at {py}: build it once with "
            f"`bash {tool / 'setup.sh'}` (a few minutes, about 2 GB), or set "
            "TESTBED_VLLM_REPLAY_PYTHON to the python it printed"
        )
    return None


@cache
def tool_module() -> ModuleType:
    """``vllm_steps.py`` imported here (its module level needs only the standard
    library): its stream reader and token factory feed our side the same inputs."""
    path = tool_dir() / "vllm_steps.py"
    spec = importlib.util.spec_from_file_location("vllm_steps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Settings:
    """One engine configuration, in the replay tool's terms."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    num_gpu_blocks: int = 128  # vLLM's count: one of them is its null block
    block_size: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    reserve_full_isl: bool = True
    policy: str = "fcfs"  # a bundled policy's name (stock vLLM: fcfs or priority)
    policy_args: str = "{}"  # its constructor's arguments, as JSON
    vllm_class: str | None = None  # vLLM's scheduler_cls running the policy; None: stock
    # With vllm_class: unfind a same-step victim's uncomputed blocks, as our KV manager does.
    forget_uncomputed: bool = False
    max_model_len: int | None = None
    step_time_s: float | None = None  # for streams with arrival_s
    seed: int = 0

    def policy_spec(self) -> dict:
        """The policy as a ``policies.make_policy`` mapping."""
        try:
            args = json.loads(self.policy_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"policy_args is not JSON ({e}): {self.policy_args!r}") from e
        if not isinstance(args, dict):
            raise ValueError(f"policy_args must be a JSON object, got {self.policy_args!r}")
        return {"name": self.policy, **args}

    def tool_args(self) -> list[str]:
        if self.vllm_class is None and (
            self.policy not in STOCK_POLICIES or self.policy_args.strip() not in ("", "{}")
        ):
            raise ValueError(
                f"policy {self.policy!r} with arguments {self.policy_args}: stock vLLM has "
                f"only {STOCK_POLICIES} without arguments; run it inside vLLM with vllm_class"
            )

        def flag(name: str, on: bool) -> str:
            return f"--{name}" if on else f"--no-{name}"

        args = [
            f"--max-num-batched-tokens={self.max_num_batched_tokens}",
            f"--max-num-seqs={self.max_num_seqs}",
            f"--num-gpu-blocks={self.num_gpu_blocks}",
            f"--block-size={self.block_size}",
            flag("enable-chunked-prefill", self.enable_chunked_prefill),
            flag("enable-prefix-caching", self.enable_prefix_caching),
            f"--long-prefill-token-threshold={self.long_prefill_token_threshold}",
            flag("reserve-full-isl", self.reserve_full_isl),
            f"--policy={self.policy if self.vllm_class is None else 'fcfs'}",
            f"--seed={self.seed}",
        ]
        if self.max_model_len is not None:
            args.append(f"--max-model-len={self.max_model_len}")
        if self.step_time_s is not None:
            args.append(f"--step-time-s={self.step_time_s}")
        if self.vllm_class is not None:  # read by vllm_shim.py, not by the tool
            args.append(f"--testbed-policy={json.dumps(self.policy_spec())}")
            args.append(f"--scheduler-cls={self.vllm_class}")
            if self.forget_uncomputed:
                args.append("--testbed-forget-uncomputed=1")
        return args


@dataclass(frozen=True)
class ReferenceRun:
    steps_csv: Path
    ms_per_step: float | None  # vLLM's schedule + update per step, as the tool measured it


def run_vllm(stream: Path, settings: Settings, out_dir: Path) -> ReferenceRun:
    """Replay ``stream`` through vLLM's scheduler; its per-step CSV and cost."""
    why = missing()
    if why:
        raise RuntimeError(why)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = out_dir / "vllm_steps.csv"
    cmd = [
        str(replay_python()),
        str(SHIM),
        str(tool_dir()),
        f"--requests={stream}",
        f"--out={steps}",
        *settings.tool_args(),
    ]
    # The policy class and the policies import from the checkout (pure Python).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode not in (0, 2):  # 2: some requests never finished (still compared)
        sys.stderr.write(done.stderr)
        raise RuntimeError(f"vLLM replay failed (exit {done.returncode}): {' '.join(cmd)}")
    found = re.search(r"schedule\+update ([0-9.]+) ms/step", done.stderr)
    return ReferenceRun(steps, float(found.group(1)) if found else None)
