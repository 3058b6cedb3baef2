"""A vLLM server that a benchmark drives command by command, in vLLM's environment:
``<.venv-vllm python> -m testbed.vllm_backend.offline ADDRESS``.

The benchmark's process (the project's environment, without vLLM) starts it
through :class:`OfflineVllm`, which listens at ``ADDRESS``; the server connects
back (its key in ``TESTBED_VLLM_AUTHKEY``) and serves pickled command dicts,
``{"cmd": name, **fields}``, until ``stop``. Each reply is the command's dict
with ``ok=True``, or ``ok=False`` with the error's traceback.

- ``build(engine_args, warmup)``: ``vllm.LLM`` with its engine core in this
  process, warmed up on ``warmup`` (testbed requests of several prompt lengths:
  vLLM compiles per shape, and its first steps at a new size run slow);
  ``build_s``, ``warmup_s``, ``vllm_version``, ``torch_version``, ``threads``.
- ``generate(prompts, outputs)``: greedy, every request added at once, each run
  to its output length; ``seconds``, ``token_ids``, ``steps``.
- ``breakdown(prompts, outputs, profile_steps)``: the same run with wall-clock
  wrappers on the engine's parts (:class:`StepTimers`), summed by step kind;
  then a second start of it whose first ``profile_steps`` steps run under
  ``torch.profiler``, which splits the compiled forward pass into attention,
  linear and other ops (:func:`forward_split`).
- ``replay(requests, max_wall_s)``: the requests at their arrival times on
  :class:`~testbed.vllm_backend.engine.VllmEngine` (built and warmed up on first
  use, beside the ``LLM``), as ``mode=vllm``'s child does; the ``RunResult``.
- ``stop``.

The server ignores SIGINT: the client stops it (an interrupted benchmark).
"""

from __future__ import annotations

import copy
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from testbed.bootstrap import ROOT

AUTHKEY_ENV = "TESTBED_VLLM_AUTHKEY"
FORWARD_LABEL = "testbed_forward"  # the profiler's name of a forward pass, ".<kind>" after it
# Ops of a forward pass as torch.profiler names them (namespace dropped), by part;
# the first match on the way down from the pass counts, with all it calls.
LINEAR_OPS = frozenset({"onednn_mm", "onednn_scaled_mm", "mm", "addmm", "linear", "matmul"})
ATTENTION_MARKS = ("attention", "attn", "kv_cache")  # kernels, vLLM's custom ops, cache writes
COMMANDS = ("build", "generate", "breakdown", "replay")


# --- the client, in the benchmark's process ---


class OfflineVllm:
    """One server process (``python``: the vLLM environment's; its output to
    ``log``) and its connection; :meth:`call` sends a command and returns its
    reply, or raises ``RuntimeError`` with the server's traceback."""

    def __init__(self, python: Path, log: Path | None = None) -> None:
        key = secrets.token_bytes(16)
        self.log = log or Path(tempfile.mkstemp(prefix="vllm-offline-", suffix=".log")[1])
        self._listener = Listener(family="AF_UNIX", authkey=key)
        server_env = {
            **os.environ,
            AUTHKEY_ENV: key.hex(),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        cmd = [str(python), "-m", "testbed.vllm_backend.offline", self._listener.address]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=server_env, cwd=ROOT, stdout=out, stderr=out)
        self._busy = False
        self.conn = self._accept()

    def _accept(self) -> Connection:
        conns: list[Connection] = []
        waiter = threading.Thread(target=lambda: conns.append(self._listener.accept()), daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(timeout=0.2)
            if self.proc.poll() is not None and not conns:
                self._listener.close()
                raise RuntimeError(f"the vLLM server exited ({self.proc.returncode})" + self.tail())
        return conns[0]

    def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        self._busy = True
        self.conn.send({"cmd": cmd, **fields})
        try:
            reply = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the vLLM server died during {cmd!r}" + self.tail()) from None
        self._busy = False
        if not reply.pop("ok"):
            raise RuntimeError(f"vLLM server, {cmd!r}: {reply['error']}")
        return reply

    def tail(self, lines: int = 30) -> str:
        """The end of the server's log, to show beside an error."""
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"; the end of its log ({self.log}):\n" + "\n".join(text)

    def close(self) -> None:
        """Stop the server: by ``stop`` where it is idle, else (a command cut short
        by an interrupt) by a signal."""
        if self.proc.poll() is None and not self._busy:
            try:
                self.conn.send({"cmd": "stop"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.conn.close()
        self._listener.close()


# --- the server, in vLLM's environment ---


def op_part(name: str) -> str | None:
    """``attention``, ``linear`` or None (neither) for a profiler event's name."""
    op = name.rsplit("::", 1)[-1]
    if any(mark in op for mark in ATTENTION_MARKS):
        return "attention"
    return "linear" if op in LINEAR_OPS else None


def forward_split(events: Iterable[Any]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From torch.profiler events (``name``, ``cpu_children``, ``cpu_time_total`` in
    microseconds), per step kind: the labelled forward passes' seconds and passes,
    and the seconds of their attention and linear ops (the outermost that match,
    with all they call); and each matched op's seconds, by name."""
    kinds: dict[str, dict[str, float]] = {}
    names: dict[str, float] = defaultdict(float)
    for e in events:
        if not e.name.startswith(FORWARD_LABEL + "."):
            continue
        s = kinds.setdefault(
            e.name.removeprefix(FORWARD_LABEL + "."),
            {"forward": 0.0, "attention": 0.0, "linear": 0.0, "passes": 0},
        )
        s["forward"] += e.cpu_time_total / 1e6
        s["passes"] += 1
        stack = list(e.cpu_children)
        while stack:
            child = stack.pop()
            part = op_part(child.name)
            if part is None:
                stack.extend(child.cpu_children)
            else:
                s[part] += child.cpu_time_total / 1e6
                names[child.name] += child.cpu_time_total / 1e6
    return kinds, dict(names)


class StepTimers:
    """Wall-clock wrappers on one ``vllm.LLM``'s parts, seconds summed by step kind
    (``decode``, ``prefill``, ``mixed``, as the benchmark's StepBreakdown): the step
    (:meth:`step`, ``LLMEngine.step``), the scheduler's ``schedule`` and
    ``update_from_output``, the model runner's ``execute_model`` (input preparation,
    forward pass, LM head), its ``_model_forward`` and ``sample_tokens`` (sampling
    and its bookkeeping), and the model's ``compute_logits``. With ``label``, each
    forward pass is a profiler range named after its kind."""

    WRAPPED = (
        ("scheduler", "schedule", "schedule"),
        ("scheduler", "update_from_output", "update"),
        ("runner", "execute_model", "execute"),
        ("runner", "_model_forward", "forward"),
        ("runner", "sample_tokens", "sample"),
        ("model", "compute_logits", "logits"),
    )

    def __init__(self, llm, label: bool = False) -> None:
        core = llm.llm_engine.engine_core.engine_core  # in this process: an EngineCore
        self.engine = llm.llm_engine
        self.scheduler = core.scheduler
        self.runner = core.model_executor.driver_worker.worker.model_runner
        self.model = self.runner.model
        self.label = label
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self._parts: dict[str, float] = defaultdict(float)
        self._kind: str | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> StepTimers:
        for owner, attr, part in self.WRAPPED:
            obj = getattr(self, owner)
            self._saved.append((obj, attr, obj.__dict__.get(attr)))
            setattr(obj, attr, self._timed(getattr(obj, attr), part))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, own in reversed(self._saved):
            if own is None:
                delattr(obj, attr)  # the class's method again
            else:
                setattr(obj, attr, own)
        self._saved.clear()

    def _timed(self, inner, part: str):
        import torch

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                if part == "forward" and self.label:
                    with torch.profiler.record_function(f"{FORWARD_LABEL}.{self._kind}"):
                        return inner(*args, **kwargs)
                out = inner(*args, **kwargs)
                if part == "schedule":
                    self._kind = self._step_kind(out)
                return out
            finally:
                self._parts[part] += time.perf_counter() - t0

        return timed

    def _step_kind(self, out) -> str | None:
        """The step's kind from what was scheduled (``schedule`` has already advanced
        each request's computed tokens); None for a step with no tokens."""
        prefill = decode = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            p = min(n, max(0, req.num_prompt_tokens - (req.num_computed_tokens - n)))
            prefill, decode = prefill + p, decode + n - p
        if prefill + decode == 0:
            return None
        return "decode" if prefill == 0 else "prefill" if decode == 0 else "mixed"

    def step(self) -> list:
        self._parts.clear()
        self._kind = None
        t0 = time.perf_counter()
        outputs = self.engine.step()
        total = time.perf_counter() - t0
        if self._kind is not None:
            s = self.seconds[self._kind]
            for part, seconds in self._parts.items():
                s[part] += seconds
            s["step"] += total
            self.steps[self._kind] += 1
        return outputs


class Server:
    """The commands, on one ``vllm.LLM`` and (for ``replay``) one ``VllmEngine``."""

    def __init__(self) -> None:
        self.llm = None
        self.engine_args: dict[str, Any] = {}
        self.warmup: list = []
        self.replayer = None
        self._calls = 0

    def build(self, engine_args: dict[str, Any], warmup: Sequence) -> dict[str, Any]:
        import torch
        import vllm

        t0 = time.perf_counter()
        self.llm = vllm.LLM(**engine_args, skip_tokenizer_init=True)
        built = time.perf_counter()
        self.engine_args, self.warmup = dict(engine_args), list(warmup)
        self._run(
            [r.prompt_token_ids for r in warmup], [r.sampling_params.max_tokens for r in warmup]
        )
        return {
            "build_s": built - t0,
            "warmup_s": time.perf_counter() - built,
            "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
        }

    def _add(self, prompts, outputs) -> dict[str, int]:
        """Add every request (greedy, each run to its output length); vLLM's request
        id of each, to its index in ``prompts``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._calls += 1
        index = {}
        for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
            params = SamplingParams(
                temperature=0,
                max_tokens=n,
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            prompt = {"prompt_token_ids": list(prompt)}
            index[engine.add_request(f"g{self._calls}-{i}", prompt, params)] = i
        return index

    def _run(self, prompts, outputs, step=None) -> tuple[float, list[list[int]], int]:
        """Every request added at once, stepped to the end from a cold prefix cache:
        seconds, each request's tokens (in ``prompts``' order), steps."""
        engine = self.llm.llm_engine
        engine.reset_prefix_cache()
        step = step or engine.step
        tokens, steps = [[] for _ in prompts], 0
        t0 = time.perf_counter()
        index = self._add(prompts, outputs)
        while engine.has_unfinished_requests():
            for out in step():
                tokens[index[out.request_id]] = list(out.outputs[0].token_ids)
            steps += 1
        return time.perf_counter() - t0, tokens, steps

    def generate(self, prompts, outputs) -> dict[str, Any]:
        seconds, tokens, steps = self._run(prompts, outputs)
        return {"seconds": seconds, "token_ids": tokens, "steps": steps}

    def breakdown(self, prompts, outputs, profile_steps: int = 64) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        with StepTimers(self.llm) as timers:
            seconds, _, _ = self._run(prompts, outputs, step=timers.step)
        # A second start of the same run, its first steps profiled, the rest dropped.
        engine = self.llm.llm_engine
        engine.reset_prefix_cache()
        ids = list(self._add(prompts, outputs))
        labelled = StepTimers(self.llm, label=True)
        with labelled, profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                if not engine.has_unfinished_requests():
                    break
                labelled.step()
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        kinds, names = forward_split(prof.events())
        return {
            "seconds": {k: dict(v) for k, v in timers.seconds.items()},
            "steps": dict(timers.steps),
            "run_s": seconds,
            "forward_ops": kinds,
            "op_seconds": names,
            "profiled_steps": sum(labelled.steps.values()),
        }

    def replay(self, requests, max_wall_s: float | None = None) -> dict[str, Any]:
        from testbed.core import WallClock
        from testbed.engine.replay import replay
        from testbed.vllm_backend.engine import VllmEngine
        from testbed.vllm_backend.support import FORGET_KEY, POLICY_KEY

        built = 0.0
        if self.replayer is None:
            t0 = time.perf_counter()
            policy = {POLICY_KEY: "fcfs", FORGET_KEY: False}  # our engine's default
            args = {**self.engine_args, "additional_config": policy}
            self.replayer = VllmEngine(args, WallClock())
            for req in copy.deepcopy(self.warmup):
                self.replayer.add_request(req)
            while self.replayer.has_unfinished_requests():
                self.replayer.step()
            built = time.perf_counter() - t0
        engine = self.replayer
        engine.reset_prefix_cache()
        engine.schedule_s, before = 0.0, engine._num_steps
        result = replay(engine, requests, None, max_wall_s)
        if result.error is not None:  # vLLM's exception classes stay here
            result.error = RuntimeError(repr(result.error))
        return {
            "result": result,
            "num_steps": engine._num_steps - before,
            "schedule_s": engine.schedule_s,
            "build_s": built,
        }


def serve(address: str) -> int:
    """Connect to the benchmark at ``address`` and serve its commands until ``stop``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here
    os.environ.setdefault("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    server = Server()
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the benchmark went away
            return 1
        cmd = msg.pop("cmd")
        if cmd == "stop":
            return 0
        try:
            if cmd not in COMMANDS:
                raise ValueError(f"unknown command {cmd!r}; known: {', '.join(COMMANDS)}, stop")
            reply = {"ok": True, **getattr(server, cmd)(**msg)}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        conn.send(reply)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
