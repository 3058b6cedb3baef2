"""Speed traces: the machine's speed over simulated time scales every step."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from policies import make_policy
from testbed.core import EngineCore, KVCacheManager, Scheduler, SchedulerConfig
from testbed.errors import InputError
from testbed.sim.executor import SimExecutor
from testbed.sim.simulator import Simulation
from testbed.sim.speed import SpeedTrace
from tests.sim.helpers import latency_model, observable, random_requests, run


def simulate(requests, speed=None, model=None, fast_forward=True, policy="fcfs", blocks=20_000):
    lat = model or latency_model()

    def make_engine(i, clock):
        sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=8192),
            KVCacheManager(blocks, 16, True),
            make_policy(policy),
        )
        return EngineCore(sched, SimExecutor(lat, speed=speed, clock=clock), clock)

    return Simulation(requests, make_engine, lat, fast_forward=fast_forward).run()


def predicted(steps: pd.DataFrame, model) -> np.ndarray:
    """The latency model's prediction of each logged step's composition."""
    return np.array(
        [
            model.predict(
                int(r.num_reqs),
                int(r.num_prefill_tokens + r.num_decode_tokens),
                float(r.attn_pairs),
                int(r.kv_tokens),
                int(r.max_kv),
            )
            for r in steps.itertuples()
        ]
    )


def wandering(duration_s: float, width_s: float, seed: int = 0) -> SpeedTrace:
    rng = random.Random(seed)
    n = int(duration_s / width_s) + 1
    return SpeedTrace.from_windows(width_s, [rng.uniform(0.5, 2.0) for _ in range(n)])


def test_latency_scale_multiplies_every_factor_of_a_trace_and_alone_is_one_factor():
    trace = SpeedTrace([5.0, 6.0], [2.0, 0.5]).scaled(1.5)
    assert [trace.at(t) for t in (0.0, 5.0, 6.0)] == [1.5, 3.0, 0.75]
    assert trace.min_factor == 0.75
    alone = SpeedTrace.constant(1.7)
    assert [alone.at(t) for t in (-1.0, 0.0, 1e6)] == [1.7] * 3 and alone.min_factor == 1.7
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="latency_scale must be positive"):
            SpeedTrace.constant(bad)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "vtc"])
@pytest.mark.parametrize("blocks", [20_000, 700], ids=["roomy", "tight"])
def test_the_fast_path_applies_a_wandering_speed_as_stepping_does(policy, blocks):
    base = simulate(random_requests(250), policy=policy, blocks=blocks)
    speed = wandering(base.duration_s * 2, 0.37)
    fast = simulate(random_requests(250), speed, policy=policy, blocks=blocks)
    slow = simulate(random_requests(250), speed, fast_forward=False, policy=policy, blocks=blocks)
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())
    assert fast.num_jumped_steps > 0
    assert observable(fast.requests) != observable(base.requests)


def test_each_step_takes_the_factor_at_its_start():
    model = latency_model()
    base = simulate(random_requests(200))
    change = base.duration_s / 3
    result = simulate(random_requests(200), SpeedTrace([0.0, change], [1.0, 2.5]))
    steps = result.steps.to_frame()
    steps = steps[steps["num_reqs"] > 0]
    ratio = steps["latency_s"].to_numpy() / predicted(steps, model)
    before = steps["start_s"].to_numpy() < change
    assert before.sum() > 10 and (~before).sum() > 10
    assert ratio[before] == pytest.approx(1.0, rel=1e-9)
    assert ratio[~before] == pytest.approx(2.5, rel=1e-9)
    # Until the change, the run is the one without a trace.
    b = base.steps.to_frame()
    first = b[b["start_s"] < change]
    assert steps.iloc[: len(first)]["latency_s"].tolist() == first["latency_s"].tolist()
    assert result.duration_s > base.duration_s


def test_scale_matches_stepping_across_many_changes():
    speed = wandering(10.0, 0.05, seed=3)
    lat = np.random.default_rng(0).uniform(0.001, 0.2, 300)
    t, stepped = 0.25, []
    for x in lat:
        stepped.append(speed.at(t) * x)
        t += stepped[-1]
    assert speed.scale(0.25, lat).tolist() == stepped


def test_before_the_first_row_the_speed_is_one():
    speed = SpeedTrace([5.0, 6.0], [2.0, 3.0])
    assert [speed.at(t) for t in (0.0, 4.99, 5.0, 5.5, 6.0, 1e9)] == [1, 1, 2, 2, 3, 3]
    assert speed.min_factor == 1.0


def test_a_csv_round_trips_and_comments_are_skipped(tmp_path):
    speed = SpeedTrace.from_windows(10.0, [1.0, 1.25, 0.8])
    path = speed.to_csv(tmp_path / "speed.csv", note="measured somewhere\nwindows of 10 s")
    back = SpeedTrace.from_csv(path)
    assert back.starts == [0.0, 10.0, 20.0] and back.speeds == [1.0, 1.25, 0.8]
    assert "speed.csv (3 rows, 0.8-1.25)" in back.describe()


@pytest.mark.parametrize(
    "text, message",
    [
        ("start_s\n0\n", "header: no column speed"),
        ("start_s,speed\n", "no rows"),
        ("start_s,speed\n0,1\n10,fast\n", "row 2 (line 3), field 'speed': not a number: 'fast'"),
        ("start_s,speed\n0,1\n,2\n", "row 2 (line 3), field 'start_s': not a number"),
        ("start_s,speed\n0,1\n10,2\n10,3\n", "row 3 (line 4), field 'start_s': 10.0 must be"),
        # comment and blank lines are not rows, but count as lines
        ("# slow\nstart_s,speed\n0,1\n\n10,0\n", "row 2 (line 5), field 'speed': 0.0 must be"),
        ("start_s,speed\n0,1\n10,0\n", "row 2 (line 3), field 'speed': 0.0 must be positive"),
        ("start_s,speed\n0,nan\n", "row 1 (line 2), field 'speed': nan must be positive"),
    ],
)
def test_a_bad_speed_trace_names_its_file_row_and_field(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.csv") as err:
        SpeedTrace.from_csv(path)
    assert message in str(err.value)


def test_a_speed_trace_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match=r"row 2, field speed: -1\.0 must be positive"):
        SpeedTrace([0.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError, match="row 2, field start_s"):
        SpeedTrace.from_windows(0.0, [1.0, 2.0])
    with pytest.raises(ValueError, match="one speed per start"):
        SpeedTrace([0.0], [])


def test_a_missing_speed_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.csv does not exist"):
        SpeedTrace.from_csv(tmp_path / "nowhere.csv")


def test_a_run_with_a_speed_trace_says_so_and_slows_where_the_trace_does(tmp_path):
    one = ["trace.num_requests=1", "trace.prompt.min=300", "trace.prompt.max=300"]
    base = run(tmp_path, *one, name="base")
    steps = pd.read_csv(tmp_path / "base" / "steps.csv")
    # The change halfway between two steps' starts: the trace's CSV keeps 6 decimals,
    # so a change placed at a step's own start could round to either side of it.
    k = len(steps) // 2
    half = round(float(steps["start_s"].iloc[k - 1] + steps["start_s"].iloc[k]) / 2, 6)
    path = SpeedTrace([half], [3.0]).to_csv(tmp_path / "speed.csv")
    slow = run(tmp_path, *one, f"mode.speed_trace={path}", name="slow")
    assert base["speed_trace"] is None and slow["speed_trace"].startswith("speed trace speed.csv")
    later = pd.read_csv(tmp_path / "slow" / "steps.csv")
    assert len(later) == len(steps)
    ratio = later["latency_s"].to_numpy() / steps["latency_s"].to_numpy()
    after = steps["start_s"].to_numpy() >= half
    assert ratio[~after] == pytest.approx(1.0, rel=1e-6)
    assert ratio[after] == pytest.approx(3.0, rel=1e-6)
    # latency_scale on top: every step 2x, and 3x more from the change on (which
    # the slower steps now reach sooner in steps).
    both = run(tmp_path, *one, f"mode.speed_trace={path}", "mode.latency_scale=2", name="both")
    assert both["speed_trace"] == slow["speed_trace"] and both["latency_scale"] == 2.0
    twice = pd.read_csv(tmp_path / "both" / "steps.csv")
    factor = np.where(twice["start_s"].to_numpy() >= half, 6.0, 2.0)
    assert len(twice) == len(steps) and (factor == 6.0).sum() > (factor == 2.0).sum()
    expected = factor * steps["latency_s"].to_numpy()
    assert twice["latency_s"].to_numpy() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(InputError, match=r"mode\.speed_trace=.*missing\.csv does not exist"):
        run(tmp_path, *one, f"mode.speed_trace={tmp_path / 'missing.csv'}", name="bad")
    bad = tmp_path / "bad.csv"
    bad.write_text("start_s,speed\n0,fast\n")
    with pytest.raises(InputError, match=r"bad\.csv, row 1 \(line 2\), field 'speed'"):
        run(tmp_path, *one, f"mode.speed_trace={bad}", name="bad-row")
