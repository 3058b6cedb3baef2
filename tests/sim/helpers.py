"""Small simulated setups shared by the simulator tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from policies import make_policy
from policies.routers import make_router
from testbed.config_schema import compose_config
from testbed.core import (
    EngineCore,
    KVCacheManager,
    Policy,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from testbed.hardware import HardwareSpec
from testbed.job import run_from_config
from testbed.models import ModelSpec
from testbed.sim.executor import SimExecutor
from testbed.sim.predictor import make_latency_model
from testbed.sim.simulator import Simulation

CONF = "conf"
ROOT = Path(__file__).resolve().parents[2]
QUIET = ["logging=disabled", "progress=false", "plots=false"]


def compose_cfg(*overrides: str):
    """The project's config with ``overrides``, as ``run.py`` would resolve it."""
    return compose_config(overrides)


def run(tmp_path: Path, *overrides: str, name: str = "run") -> dict:
    """A quiet run of the config with ``overrides``, in ``tmp_path / name``."""
    return run_from_config(compose_cfg(*QUIET, *overrides), tmp_path / name)


def run_and_signal(args: list[str], sig: int, run_dir: Path) -> tuple[int, str, str]:
    """``python run.py <args>`` with a progress bar, sent ``sig`` two seconds after
    the bar appears (the run is under way); its exit status, stdout and stderr."""
    cmd = [sys.executable, str(ROOT / "run.py"), *args, "progress=true", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "TESTBED_NO_BOOTSTRAP": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job (nohup ... &) ignores SIGINT, and so would the run.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # One reader thread per pipe: Popen.communicate would read stderr too, racing the
    # reader for the last lines ("interrupted").
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), ""))),
        threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), ""))),
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 300
    while "req" not in "".join(err) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    for reader in readers:
        reader.join(timeout=30)
    return proc.returncode, "".join(out), "".join(err)


def latency_model(model: str = "llama3-8b", hardware: str = "h200", choice: str = "roofline"):
    """The spec-sheet roofline of a model on a GPU (``choice``: another latency model)."""
    m = OmegaConf.to_container(OmegaConf.load(f"{CONF}/model/{model}.yaml"))
    hw = OmegaConf.to_container(OmegaConf.load(f"{CONF}/hardware/{hardware}.yaml"))
    spec = ModelSpec.from_hf_config(m["hf_config"], name=model)
    return make_latency_model(spec, HardwareSpec.from_config(hw), m["dtype"], None, choice=choice)


def random_requests(n: int, rate: float = 5.0, seed: int = 0, shared: bool = True) -> list[Request]:
    """Poisson arrivals, mixed lengths, three tenants, some shared prefixes."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        n_in = rng.randint(16, 2500)
        hashes = None
        if shared and rng.random() < 0.5:  # one of two shared 1,024-token system prompts
            n_in = max(n_in, 1100)
            hashes = (rng.randrange(2), *(10_000 + 10 * i + k for k in range(n_in // 512)))
        out.append(
            Request(
                request_id=f"r{i}",
                num_prompt_tokens=n_in,
                target_output_tokens=rng.randint(1, 500),
                sampling_params=SamplingParams(max_tokens=None, ignore_eos=True),
                arrival_time=t,
                tenant=f"t{i % 3}",
                priority=i % 2,
                ttft_slo_s=rng.choice([0.5, 2.0]),
                prefix_hash_ids=hashes,
            )
        )
    return out


def simulate(
    requests,
    policy="fcfs",
    fast_forward=True,
    num_blocks=20_000,
    replicas=1,
    router="least_outstanding",
    max_concurrency=None,
    **sched,
):
    """A simulation of ``requests`` (``max_concurrency``: a closed loop of that many
    clients); its result and its engines."""
    lat = latency_model()
    engines = []
    cfg = dict(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=8192) | sched

    def make_engine(i, clock):
        kv = KVCacheManager(num_blocks, 16, True)
        if isinstance(policy, Policy):  # one replica's own
            pol = policy
        else:
            pol = make_policy(policy) if isinstance(policy, str) else make_policy(dict(policy))
        engines.append(
            EngineCore(Scheduler(SchedulerConfig(**cfg), kv, pol), SimExecutor(lat), clock)
        )
        return engines[-1]

    sim = Simulation(
        requests,
        make_engine,
        lat,
        num_replicas=replicas,
        router=make_router(router),
        fast_forward=fast_forward,
        keep_tokens=True,
        max_concurrency=max_concurrency,
    )
    return sim.run(), engines


def observable(requests):
    return [
        (
            r.request_id,
            r.status,
            r.first_scheduled_time,
            r.first_token_time,
            r.finish_time,
            tuple(r.token_times or ()),
            r.num_preemptions,
            r.num_cached_tokens,
            r.num_output_tokens,
        )
        for r in requests
    ]
