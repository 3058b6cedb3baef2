"""``hydra/launcher=ray`` (testbed/launchers/): sweeps of ``run.py`` on a Ray cluster
of this machine, on loopback (a head started here with two worker CPUs, two
nodes of one CPU each, or the sweep's own instance), against the same sweeps
with Hydra's basic launcher."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("ray", reason="hydra/launcher=ray needs the extra: pip install -e '.[ray]'")
pytest.importorskip(
    "hydra_plugins.hydra_ray_launcher",
    reason="hydra/launcher=ray needs the extra: pip install -e '.[ray]'",
)

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["logging=disabled", "progress=false", "plots=false"]
# Ray on loopback only (its processes bind 127.0.0.1, not this machine's other
# addresses), with a token of this test's own and no usage reports.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_USAGE_STATS_ENABLED": "0",
    "TESTBED_NO_BOOTSTRAP": "1",
}
# metrics.json fields that are the run's own wall-clock times, which no two runs share
WALL_CLOCK = ("wall_s", "sim_wall_s", "sim_requests_per_wall_s")
# Two policies that differ once requests queue (4 sequences at a time), and a bad
# request count that fails inside the job: two runs and two FAILED jobs.
SWEEP = ["policy=fcfs,sjf", "trace.num_requests=60,-3", "trace.rate=40", "engine.max_num_seqs=4"]

pytestmark = pytest.mark.slow


# Nodes of one cluster join by this machine's address, not loopback: Ray allows a
# second node only with its cluster mode on, and then binds where it can be reached.
CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **RAY_ENV, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_node(folder: Path, name: str, *args: str, extra_env=None) -> Iterator[None]:
    """``ray start --block`` with ``args`` and the variables ``extra_env`` (its output
    in ``folder/name.log``) until it says it started; stopped at the end."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    if ray_cli is None:
        pytest.skip("the ray command is not beside this Python: pip install -e '.[ray]'")
    log = folder / f"{name}.log"
    cmd = [ray_cli, "start", "--block", "--node-ip-address=127.0.0.1", *args]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env(**(extra_env or {})), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def head_args(folder: Path, port: int, cpus: int) -> list[str]:
    """A head's ``ray start`` arguments: ``cpus`` worker CPUs, no dashboard, its
    files in ``folder`` (a node joining it keeps its files there too)."""
    return [
        "--head",
        f"--port={port}",
        f"--num-cpus={cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={folder / 't'}",
    ]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory) -> Iterator[str]:
    """A Ray head on 127.0.0.1 with two worker CPUs (``ray start --head``), its
    address; stopped after the module's tests."""
    folder, port = tmp_path_factory.mktemp("ray"), free_port()
    with ray_node(folder, "head", *head_args(folder, port, cpus=2)):
        yield f"127.0.0.1:{port}"


@pytest.fixture
def two_nodes(tmp_path_factory) -> Iterator[str]:
    """A Ray cluster of two nodes on this machine, one worker CPU each: a head and
    a second node joining it (``ray start --address``; its own raylet and object
    store, as another machine's would be), the head's address."""
    folder, port = tmp_path_factory.mktemp("ray2"), free_port()
    with ray_node(folder, "head", *head_args(folder, port, cpus=1), extra_env=CLUSTER_ENV):
        address = f"127.0.0.1:{port}"  # Ray resolves it to this machine's address
        join = [f"--address={address}", "--num-cpus=1"]
        with ray_node(folder, "node", *join, extra_env=CLUSTER_ENV):
            yield address


def group_gone(pgid: int, wait_s: float = 60.0) -> bool:
    """Whether the process group ``pgid`` (a sweep and the Ray processes it started)
    has no process left, waiting up to ``wait_s`` for them to end."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def sweep(
    out: Path, *overrides: str, launcher: str = "basic", extra_env=None
) -> subprocess.CompletedProcess:
    """``python run.py -m`` with ``overrides`` into ``out``."""
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", f"hydra/launcher={launcher}"]
    cmd += [*QUIET, *overrides, f"hydra.sweep.dir={out}"]
    return subprocess.run(
        cmd, cwd=ROOT, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=600
    )


def summary(sweep_dir: Path) -> pd.DataFrame:
    """The sweep's sweep_summary.csv (``failed`` "" for the jobs that ran)."""
    table = pd.read_csv(sweep_dir / "sweep_summary.csv")
    failed = table["failed"].astype(object)
    return table.assign(failed=failed.where(failed.notna(), ""))


def metrics(sweep_dir: Path) -> dict[str, dict]:
    """Each job's metrics.json by folder name, without its wall-clock times."""
    runs = {}
    for path in sweep_dir.glob("*/metrics.json"):
        m = json.loads(path.read_text())
        runs[path.parent.name] = {k: v for k, v in m.items() if k not in WALL_CLOCK}
    return runs


def test_a_ray_sweep_summarizes_as_the_basic_launchers(tmp_path, ray_head):
    """Every field of sweep_summary.csv equal (its failed jobs and their reasons
    too), and every job's metrics but its wall-clock times; the summary holds no
    path, timestamp or wall time (its run column is the job's folder name)."""
    basic = sweep(tmp_path / "basic", *SWEEP)
    ray = sweep(
        tmp_path / "ray", *SWEEP, f"hydra.launcher.ray.init.address={ray_head}", launcher="ray"
    )
    for res in (basic, ray):
        assert res.returncode != 0  # the failed jobs end the sweep, as Hydra does
        assert "sweep_summary.csv" in res.stdout, res.stderr[-3000:]
    assert "Ray launcher: 4 jobs on 1 node, 2 CPUs" in ray.stderr + ray.stdout
    expected = summary(tmp_path / "basic")
    pd.testing.assert_frame_equal(summary(tmp_path / "ray"), expected)
    failed = expected[expected["failed"] != ""]
    assert len(failed) == 2 and len(expected) == 4
    assert failed["failed"].str.contains("InputError: .*num_requests must be >= 0").all()
    runs = metrics(tmp_path / "ray")
    assert runs == metrics(tmp_path / "basic") and len(runs) == 2
    assert {m["policy"] for m in runs.values()} == {"fcfs", "sjf"}
    assert len({m["ttft_s_p50"] for m in runs.values()}) == 2  # the policies differ
    assert "(job0 pid=" in ray.stdout + ray.stderr  # its output came from a Ray worker


def test_w_and_b_runs_of_a_ray_sweep_are_where_a_local_sweeps_are(tmp_path, ray_head):
    """W&B offline: each job's run in its own folder and the sweep's run in the sweep
    folder, as the basic launcher leaves them."""
    folders = {}
    for launcher, extra in (
        ("basic", []),
        ("ray", [f"hydra.launcher.ray.init.address={ray_head}"]),
    ):
        out = tmp_path / launcher
        res = sweep(
            out,
            "policy=fcfs,sjf",
            "trace.num_requests=60",
            "logging=offline",
            *extra,
            launcher=launcher,
            extra_env={"WANDB_MODE": "offline"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        folders[launcher] = sorted(
            str(p.parent.parent.relative_to(out)) for p in out.glob("**/wandb/offline-run-*/files")
        )
    assert folders["ray"] == folders["basic"] and len(folders["ray"]) == 3, folders


def test_a_sweep_on_two_nodes_runs_on_both_and_summarizes_as_the_basic_launchers(
    tmp_path, two_nodes
):
    """Two nodes of one CPU each: the four jobs (two runs, two that fail) go to both
    nodes, as the driver's log of where each ran says, and the summary and each
    job's metrics are the basic launcher's (as on one node)."""
    basic = sweep(tmp_path / "basic", *SWEEP)
    address = f"hydra.launcher.ray.init.address={two_nodes}"
    ray = sweep(tmp_path / "ray", *SWEEP, address, launcher="ray", extra_env=CLUSTER_ENV)
    out = ray.stderr + ray.stdout
    assert "Ray launcher: 4 jobs on 2 nodes, 2 CPUs" in out, out[-3000:]
    ran_on = dict(re.findall(r"#(\d+) ran on node (\w{8}) ", out))
    assert sorted(ran_on) == ["0", "1", "2", "3"] and len(set(ran_on.values())) == 2, ran_on
    assert "sweep_summary.csv" in basic.stdout
    pd.testing.assert_frame_equal(summary(tmp_path / "ray"), summary(tmp_path / "basic"))
    runs = metrics(tmp_path / "ray")
    assert runs == metrics(tmp_path / "basic") and len(runs) == 2


def test_a_job_whose_worker_dies_is_retried_once_then_failed(tmp_path, ray_head):
    """Job 0's worker is killed on its first try and it runs again; job 1's on both
    tries, and it is a FAILED row naming the death."""
    markers = tmp_path / "deaths"
    markers.mkdir()
    overrides = [
        "policy=custom",
        "policy._target_=tests.launchers.dying_policy.DiesAtFirst",
        "+policy.deaths=1,2",
        f"+policy.marker={markers}/job" + "${policy.deaths}",
        "trace.num_requests=40",
        "hydra.sweep.subdir=${hydra.job.num}",  # the marker's path kept out of folder names
        f"hydra.launcher.ray.init.address={ray_head}",
    ]
    res = sweep(tmp_path / "ray", *overrides, launcher="ray")
    assert res.returncode != 0 and "WorkerDied" in res.stderr, res.stderr[-3000:]
    assert len((markers / "job1").read_text().splitlines()) == 1  # killed once
    assert len((markers / "job2").read_text().splitlines()) == 2  # killed on both tries
    table = summary(tmp_path / "ray")
    assert list(table["run"]) == [0, 1]
    retried, dead = table.iloc[0], table.iloc[1]
    assert retried["failed"] == "" and retried["num_finished"] == 40
    assert dead["failed"].startswith("WorkerDied: the Ray worker running it died on each of its 2")
    assert dead["policy.deaths"] == 2  # the failed row names its settings


@pytest.mark.parametrize(
    "sig, group, status",
    [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_an_interrupt_cancels_the_sweep_and_summarizes_what_finished(tmp_path, sig, group, status):
    """Ctrl-C (SIGINT to the sweep's process group, its own Ray instance's processes
    included) or SIGTERM to the sweep process (a batch scheduler's stop), once job 0
    has finished and job 1's progress line shows it simulating: job 1 is cancelled
    and writes what it measured (partial), the summary is written, and the sweep
    exits with the signal's status."""
    out = tmp_path / "ray"
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=ray", *QUIET]
    cmd += ["progress=true", "trace.num_requests=40,400000", f"hydra.sweep.dir={out}"]
    cmd += ["hydra.sweep.subdir=j${hydra.job.num}"]
    cmd += ["hydra.launcher.ray.init.address=local", "hydra.launcher.ray.init.num_cpus=2"]
    cmd += ["hydra.launcher.ray.init.include_dashboard=false"]
    log = tmp_path / "sweep.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        started = re.compile(r"\d+/400000 requests finished")  # job 1's first progress line
        while not ((out / "j0" / "metrics.json").exists() and started.search(log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=300) == status, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert group_gone(proc.pid), "the sweep's own Ray instance outlived it"
    text = log.read_text()
    assert "cancelling 1 job(s)" in text and "interrupted" in text
    table = summary(out).set_index("run")
    assert table.loc["j0", "num_finished"] == 40 and not table.loc["j0", "partial"]
    j1 = table.loc["j1"]
    assert j1["partial"] and j1["num_finished"] < 400000, (j1.to_dict(), text[-3000:])
