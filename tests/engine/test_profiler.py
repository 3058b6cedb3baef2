"""The profiler end to end on the CPU (quick grid): the table the simulator fits."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from testbed.engine.device import machine_name
from testbed.job import run_from_config
from testbed.profile_table import profile_machine, profile_speed_moved, read_profile_header
from testbed.profiling.fit_report import FIT_WARN, fit_check
from testbed.profiling.grid import GRIDS, Point
from testbed.profiling.progress import duration, point_work, seconds_left
from testbed.profiling.steadiness import (
    SPEED_MOVED_WARN,
    samples_per_pause,
    speed_header,
    speed_line,
    speed_moved,
)
from testbed.sim.profile_model import ProfileModel
from tests.sim.helpers import compose_cfg


def test_profile_mode_writes_a_table_with_its_provenance_and_speed_probe(tmp_path, capsys):
    out = run_from_config(
        compose_cfg(
            "mode=profile",
            "mode.grid=quick",
            "mode.repeats=3",
            "mode.warmup=1",
            "mode.replay_requests=6",
            "mode.replay_sparse_requests=0",  # its own test below
            f"profiles_dir={tmp_path}",
        )
    )
    path = tmp_path / "cpu" / "dummy-llama.csv"
    assert out["profile"] == str(path)
    header = read_profile_header(path)
    keys = ("device", "machine", "cpu", "date", "torch", "model", "dtype", "block_size")
    for key in (*keys, "measured_by"):
        assert header.get(key), key
    assert header["machine"] == machine_name(torch.device("cpu")) == header["cpu"]
    probe, before, after = (float(v.strip("(),")) for v in header["speed_probe_s"].split())
    assert probe == pytest.approx((before + after) / 2, rel=1e-4)
    assert 0 < before < 1 and 0 < after < 1
    table = pd.read_csv(path, comment="#")
    points = table[table["grid"] == "point"]
    assert len(points) == len(GRIDS["quick"])
    assert (points["latency_min_s"] <= points["latency_s"]).all()
    assert (points["latency_s"] <= points["latency_max_s"]).all()
    assert (table[table["grid"] == "replay"]["latency_s"] > 0).all()
    assert len(table[table["grid"] == "replay"]) > 6  # a step per chunk and decode
    # The idle probe: one sample after each point (and more in the replay's gaps),
    # their median in the header; they are not steps, so the fit leaves them out.
    idle = table[table["kind"] == "idle_probe"]
    between = idle[idle["grid"] == "between_points"]
    assert len(between) == samples_per_pause(len(GRIDS["quick"])) * len(GRIDS["quick"]) >= 64
    assert (idle["latency_s"] > 0).all() and idle["num_reqs"].isna().all()
    # Then 40 with the engine idle after the replay, as a run samples it.
    after = idle[idle["grid"].isin(["replay_gaps", "after_replay"])]
    assert len(after) >= 40
    median, *words = header["idle_probe_s"].split()  # "<s> (median of <n> samples; ..."
    assert float(median) == pytest.approx(idle["latency_s"].median(), rel=1e-4)
    assert int(words[2].rstrip(";")) == len(idle)
    # How much the machine's speed moved, from those samples between points; how
    # long it took; and, printed, the grid's progress and the speed's verdict.
    assert profile_speed_moved(header) == pytest.approx(
        speed_moved(between["latency_s"])[0], rel=1e-2
    )
    total, *phases = header["duration_s"].replace(",", "").strip("()").split()
    assert phases[0] == "(grid" and float(phases[1]) <= float(total)
    printed = capsys.readouterr().out
    n = len(GRIDS["quick"])
    assert f"[{n}/{n}] decodes" in printed and f"grid: {n} points in " in printed
    assert "profiled in " in printed and "machine's speed" in printed.split("wrote")[-1]
    # The point after a cached prefix of 256 tokens computes only its 64 new ones.
    cached = points[points["prefix_tokens"] > 0]
    assert len(cached) == 1 and (cached[["num_tokens", "max_kv"]].values == [64, 320]).all()
    # Decode steps cost more with more requests: 16 clearly more than 1 (on CPU, 1 and 4
    # cost about the same, the weights' read dominating, so noise can order those two
    # either way: a clean-clone run measured 8.93 ms for 1 and 8.77 ms for 4); the
    # fit's own error is small.
    plain = (points["prefill_tokens"] == 0) & (points["drafts"] == 0)
    decodes = points[plain].sort_values("decode_batch")
    assert list(decodes["decode_batch"]) == [1, 4, 16]
    assert decodes["latency_s"].iloc[-1] > 1.2 * decodes["latency_s"].iloc[0]
    # A verification step: 4 decoders, each its last token and 3 drafts (16 tokens).
    drafts = points[points["drafts"] > 0]
    assert len(drafts) == 1 and (drafts[["num_reqs", "num_tokens"]].values == [4, 16]).all()
    assert ProfileModel(path).fit_rel_error < 0.25
    assert out["fit_rel_error"] == pytest.approx(ProfileModel(path).fit_rel_error)


def test_fit_check_warns_when_a_profiles_points_disagree(tmp_path):
    from tests.sim.test_latency import write_profile

    rng = np.random.default_rng(1)
    truth = np.array([2e-3, 1e-4, 2e-6, 1e-10, 5e-9])  # overheads, tokens, pairs, kv

    def profile(name: str, speed_spread: float):
        rows = []
        for reqs in (1, 2, 4, 8, 16, 32, 64):
            for tokens_per in (1, 32, 256):
                ctx = int(rng.integers(64, 4096))
                t, p, k = reqs * tokens_per, reqs * tokens_per * (ctx + tokens_per / 2), reqs * ctx
                speed = 1 + speed_spread * rng.uniform(-1, 1)  # the machine's, per point
                rows.append((reqs, t, p, k, truth @ [1, reqs, t, p, k] * speed))
        write_profile(tmp_path / name, rows)
        return fit_check(tmp_path / name)

    err, line = profile("steady.csv", 0.01)
    assert err < FIT_WARN and "WARNING" not in line and f"{err:.1%}" in line
    err, line = profile("moving.csv", 0.4)
    assert err > FIT_WARN and f"{err:.1%}" in line and "WARNING: over 5%" in line
    # With the header's speed_moved (profiles from before it have none: as above),
    # a poor fit names the machine's speed as its likely cause where it moved, and
    # a good fit still warns that it moved.
    moved, steady = "0.31 (the probe's stretches)", "0.06 (the probe's stretches)"
    for name in ("steady.csv", "moving.csv"):
        text = (tmp_path / name).read_text()
        for tag, value in (("moved", moved), ("steady", steady)):
            (tmp_path / f"{tag}-{name}").write_text(f"# speed_moved: {value}\n{text}")
    _, line = fit_check(tmp_path / "moved-moving.csv")
    assert "WARNING: over 5%" in line and "likely cause is the machine's speed" in line
    assert "WARNING: the machine's speed moved while it was profiled" in line and "31%" in line
    _, line = fit_check(tmp_path / "steady-moving.csv")
    assert "WARNING: over 5%" in line and "likely cause" not in line
    assert "no move of the machine's speed" in line and "machine's speed steady" in line
    _, line = fit_check(tmp_path / "moved-steady.csv")
    assert "WARNING: over 5%" not in line and "WARNING: the machine's speed moved" in line
    _, line = fit_check(tmp_path / "steady-steady.csv")
    assert "WARNING" not in line and "machine's speed steady while profiled" in line


def test_the_probes_stretches_tell_a_machine_whose_speed_moved_from_a_steady_one():
    # Samples of a probe step of 10 ms, scattered by the probe's own repeat noise
    # (5%, and a tenth of them 50% slow: a co-tenant's moment), in time order.
    rng = np.random.default_rng(3)

    def probe(n: int, speed) -> np.ndarray:
        noise = 1 + 0.05 * rng.standard_normal(n) + 0.5 * (rng.random(n) < 0.1)
        return 0.01 * noise * speed

    steady = probe(87, 1.0)
    step = probe(87, np.where(np.arange(87) < 40, 1.0, 1.35))  # 35% slower from a point on
    drift = probe(87, np.linspace(1.0, 1.3, 87))  # slowing down throughout
    burst = probe(87, np.where((np.arange(87) // 11) == 3, 1.6, 1.0))  # one stretch slow
    assert speed_moved(steady)[0] < 0.1 < SPEED_MOVED_WARN
    for moving in (step, drift, burst):
        assert speed_moved(moving)[0] > SPEED_MOVED_WARN
    assert speed_moved(steady)[1] == 8  # stretches of 10 or 11 samples
    assert speed_moved(steady[:15]) is None and speed_moved(steady[:16])[1] == 2
    # The verdict: a warning naming how much and what to do for the moving ones only.
    assert "WARNING" not in speed_line(speed_moved(steady)[0])
    assert "took 89 times as long in its slowest stretch" in speed_line(88.0)
    line = speed_line(speed_moved(step)[0])
    assert line.startswith("WARNING: the machine's speed moved")
    assert f"{speed_moved(step)[0]:.0%} longer" in line and "on a quiet machine" in line
    # The header: the larger of the probes' first, each probe's after; n/a without enough.
    header = speed_header(steady, step)["speed_moved"]
    assert float(header.split()[0]) == pytest.approx(speed_moved(step)[0], abs=1e-3)
    assert "idle probe between grid points" in header and "reference probe" in header
    assert profile_speed_moved({"speed_moved": header}) == float(header.split()[0])
    header = speed_header(steady[:8])["speed_moved"]
    assert header.startswith("n/a (") and "8 samples, too few" in header
    assert profile_speed_moved({"speed_moved": header}) is None
    assert profile_speed_moved({}) is None  # a profile from before the field
    # A short grid takes more samples after each point, to have its 8 stretches.
    assert samples_per_pause(87) == 1 and samples_per_pause(8) == 8 and samples_per_pause(0) >= 1


@pytest.mark.parametrize("moving", [False, True])
def test_the_profiler_warns_at_its_end_where_its_probe_saw_the_speed_move(
    tmp_path, monkeypatch, capsys, moving
):
    from testbed.engine.args import EngineArgs
    from testbed.profiling import profiler
    from testbed.profiling.fit_report import report_profile

    calls = []

    def after_pause(self) -> float:
        """The machine as the probe would see it: from the 33rd sample on, 40%
        slower where it moves (the grid's samples are the first 64)."""
        calls.append(1)
        return 0.01 * (1.4 if moving and len(calls) > 32 else 1.0)

    monkeypatch.setattr(profiler.IdleProbe, "after_pause", after_pause)
    path = profiler.run_profile(
        EngineArgs(model="dummy-llama", device="cpu"),
        [(1, 64, 0), (0, 0, 32)],
        repeats=2,
        warmup=1,
        out_dir=tmp_path,
        hardware="cpu",
        replay_requests=2,
    )
    moved = profile_speed_moved(read_profile_header(path))
    assert moved == pytest.approx(0.4 if moving else 0.0)
    capsys.readouterr()
    report_profile(path)
    printed = capsys.readouterr().out.splitlines()
    warning = [line for line in printed if "WARNING: the machine's speed moved" in line]
    if moving:
        assert len(warning) == 1 and "40% longer" in warning[0]
        assert "Profile again on a quiet machine" in warning[0]
    else:
        assert not warning and any("machine's speed steady" in line for line in printed)


def test_the_grids_time_left_is_estimated_from_the_points_measured():
    # Each point's seconds: per token computed and per point (the idle probe's
    # pauses); the decode points grow along the grid, so the rest costs more than
    # the points so far at their mean.
    points = [Point(*g) for g in GRIDS["default"]]
    work = [point_work(p, 7) for p in points]
    seconds = [2e-5 * w + 0.3 for w in work]
    assert seconds_left(work[:2], seconds[:2], sum(work[2:]), len(work) - 2) is None
    for done in (3, 10, 40):
        left = seconds_left(work[:done], seconds[:done], sum(work[done:]), len(work) - done)
        assert left == pytest.approx(sum(seconds[done:]), rel=1e-6)
        assert left > np.mean(seconds[:done]) * (len(work) - done)
    assert seconds_left(work, seconds, 0, 0) == 0.0
    assert point_work(Point(64, 2000, 0), 7) == 64 * 2000 + 7 * 64
    assert point_work(Point(0, 0, 256, 1024), 7) == 1024 + 7 * 256
    assert [duration(s) for s in (42.4, 185, 3720)] == ["42 s", "3 min 5 s", "1 h 2 min"]


def test_merged_passes_fit_the_mean_speed_and_keep_every_row(tmp_path):
    """Passes measured at different times merge into one table whose fit lies
    between theirs: the machine's speed averaged over the passes."""
    import numpy as np

    from testbed.profile_table import merge_profiles, write_profile

    rng = np.random.default_rng(1)
    reqs = rng.integers(1, 64, 40)
    tokens = reqs * rng.integers(1, 64, 40)
    rows = pd.DataFrame(
        dict(
            kind="step",
            grid="replay",
            num_reqs=reqs,
            num_tokens=tokens,
            attn_pairs=tokens * 300,
            kv_tokens=reqs * 300,
            max_kv=300,
        )
    )
    base = 2e-3 + 1e-4 * reqs + 2e-5 * tokens
    paths = []
    for i, (speed, probe) in enumerate(((1.0, 0.09), (1.1, 0.099))):
        header = dict(
            device="test", hardware="cpu1", model="m", dtype="float32", block_size=16,
            attention_backend="ref", date=f"2026-11-30 0{i}:00:00 UTC",
            speed_probe_s=f"{probe} ({probe}, {probe})", measured_by="test",
            idle_probe_s=f"{probe / 8} (median of 9 samples)",
            reference_probe_s=f"{probe / 4} (median of 99 samples beside the busy engine)",
            reference_probe_replay_s=f"{probe / 5} (median of 50 samples)",
            speed_moved=f"{0.05 + 0.2 * i:g} (the probe's stretches)",
        )  # fmt: skip
        paths.append(tmp_path / str(i) / "cpu1" / "m.csv")
        write_profile(paths[-1], header, rows.assign(latency_s=base * speed))
    merged = merge_profiles(paths, tmp_path / "merged" / "cpu1" / "m.csv")
    header = read_profile_header(merged)
    assert header["passes"] == "2" and "01:00:00" in header["pass_dates"]
    assert float(header["speed_probe_s"].split()[0]) == pytest.approx(0.0945)
    assert float(header["idle_probe_s"].split()[0]) == pytest.approx(0.0945 / 8)
    assert float(header["reference_probe_s"].split()[0]) == pytest.approx(0.0945 / 4)
    assert float(header["reference_probe_replay_s"].split()[0]) == pytest.approx(0.0945 / 5)
    assert "reference_probe_grid_s" not in header  # in no pass: none merged
    assert profile_speed_moved(header) == pytest.approx(0.25)  # the passes' largest
    table = pd.read_csv(merged, comment="#")
    assert len(table) == 2 * len(rows) and sorted(table["pass"].unique()) == [0, 1]
    features = (32, 512, 512 * 300, 32 * 300, 300)
    fast, slow, mean = (ProfileModel(p).predict(*features) for p in (*paths, merged))
    assert slow == pytest.approx(1.1 * fast, rel=1e-3)
    assert fast < mean < slow and mean == pytest.approx(1.05 * fast, rel=0.01)
    other = tmp_path / "other" / "cpu" / "m.csv"
    write_profile(
        other, dict(read_profile_header(paths[0]), hardware="cpu"), rows.assign(latency_s=base)
    )
    with pytest.raises(ValueError, match="differ in hardware"):
        merge_profiles([paths[0], other], tmp_path / "bad.csv")
    # Passes on two kinds of CPU do not merge; a pass from before the header named
    # its CPU merges with one that does.
    cpus = []
    for cpu in ("AMD EPYC, AVX2", "Some Xeon, AVX512"):
        cpus.append(tmp_path / cpu[:3] / "cpu1" / "m.csv")
        header = dict(read_profile_header(paths[0]), cpu=cpu)
        write_profile(cpus[-1], header, rows.assign(latency_s=base))
    with pytest.raises(ValueError, match="differ in cpu"):
        merge_profiles(cpus, tmp_path / "bad.csv")
    merge_profiles([paths[0], cpus[0]], tmp_path / "ok.csv")
    # Nor on two GPUs (machine), with the same host CPU.
    gpus = []
    for gpu in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
        gpus.append(tmp_path / gpu[-4:] / "gpu" / "m.csv")
        header = dict(read_profile_header(paths[0]), machine=gpu, cpu="AMD EPYC, AVX2")
        write_profile(gpus[-1], header, rows.assign(latency_s=base))
    with pytest.raises(ValueError, match="differ in machine"):
        merge_profiles(gpus, tmp_path / "bad.csv")
    assert profile_machine(read_profile_header(gpus[0])) == "NVIDIA H200"
    assert profile_machine({"cpu": "AMD EPYC, AVX2"}) == "AMD EPYC, AVX2"  # a 12-02 table
    assert profile_machine({}) is None


@pytest.mark.parametrize("stop", ["point", "replay"])
def test_an_interrupted_profile_writes_what_it_measured_apart(tmp_path, monkeypatch, stop):
    # Stopped part-way (Ctrl-C, or SIGTERM from a timeout), the profiler writes the
    # rows it measured to <model>.partial.csv, which the simulator never reads, says
    # how far it got, and re-raises; no <model>.csv appears.
    from testbed.engine.args import EngineArgs
    from testbed.profiling import profiler
    from testbed.profiling import replay_steps as replay_module

    measure = profiler.measure_point
    calls = []

    def stopping_point(*args, **kwargs):
        calls.append(args[6] < 1000)  # grid points; the speed probe's are 1000 on
        if stop == "point" and sum(calls) == 3:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    real_replay = replay_module.replay

    def failing_replay(engine, requests, **kwargs):
        seen = []

        def on_step(res):
            kwargs["on_step"](res)
            seen.append(1)
            if len(seen) == 4:
                raise RuntimeError("broken step")

        return real_replay(engine, requests, **{**kwargs, "on_step": on_step})

    monkeypatch.setattr(profiler, "measure_point", stopping_point)
    monkeypatch.setattr(replay_module, "replay", failing_replay)
    expected = KeyboardInterrupt if stop == "point" else RuntimeError
    with pytest.raises(expected):
        profiler.run_profile(
            EngineArgs(model="dummy-llama", device="cpu"),
            GRIDS["quick"],
            repeats=2,
            warmup=1,
            out_dir=tmp_path,
            hardware="cpu",
            replay_requests=6,
        )
    assert not (tmp_path / "cpu" / "dummy-llama.csv").exists()
    path = tmp_path / "cpu" / "dummy-llama.partial.csv"
    header = read_profile_header(path)
    table = pd.read_csv(path, comment="#")
    points = table[table["grid"] == "point"]
    replayed = table[table["grid"] == "replay"]
    if stop == "point":
        assert (
            header["partial"]
            == f"interrupted after 2 of {len(GRIDS['quick'])} grid points and 0 replay steps"
        )
        assert len(points) == 2 and replayed.empty
    else:
        assert header["partial"].startswith("failed (RuntimeError('broken step'))")
        assert header["partial"].endswith(
            f"after {len(GRIDS['quick'])} of {len(GRIDS['quick'])} grid points and 4 replay steps"
        )
        assert len(points) == len(GRIDS["quick"]) and len(replayed) == 4
    assert (table[table["kind"] != "idle_probe"]["latency_s"] > 0).all()
    assert header["model"] == "dummy-llama" and "speed_probe_s" in header


def test_the_auto_grid_is_the_gpu_grid_on_a_gpu_and_the_default_elsewhere():
    from testbed.profiling.grid import grid_points

    assert grid_points("auto", "cpu") == ("default", GRIDS["default"])
    assert grid_points("auto", "cuda")[0] == "gpu"
    assert grid_points("quick", "cuda") == ("quick", GRIDS["quick"])
    with pytest.raises(ValueError, match="unknown profile grid 'big'"):
        grid_points("big", "cpu")
    gpu = GRIDS["gpu"]
    # The engine's default batch limit, contexts past 2000, batch mixes of 64;
    # every point of the default grid, and no point of more than 256k cached tokens.
    assert max(g[0] for g in gpu) == 256 and max(g[1] for g in gpu) == 4096
    assert (64, 256, 1024) in gpu and set(GRIDS["default"]) <= set(gpu)
    assert max(g[0] * g[1] for g in gpu) <= 2**18
    # Prefills after a cached prefix, in every grid (the quick one's too).
    for grid in GRIDS.values():
        assert any(len(g) == 4 and g[3] > 0 and g[2] > 0 for g in grid)


def test_the_grid_interleaves_decode_points_and_points_with_a_prefill():
    # A drift of the machine's speed over a pass then moves both kinds alike.
    from testbed.profiling.grid import interleave

    assert interleave([1, 2, 3, 4], ["a", "b"]) == [1, "a", 2, 3, "b", 4]
    assert interleave([], ["a"]) == ["a"] and interleave([1], []) == [1]
    for name, grid in GRIDS.items():
        prefill = [g[2] > 0 for g in grid]
        half = len(grid) // 2
        share = sum(prefill) / len(grid)
        assert abs(sum(prefill[:half]) / half - share) < 0.1, name
    assert GRIDS["gpu"][: len(GRIDS["default"])] == GRIDS["default"]  # cut short: these first


def test_the_profilers_kv_cache_holds_each_point_not_the_largest_batch_at_the_longest_context():
    # A grid of many short decoders and a few long ones: the cache holds the
    # larger of the two (on a GPU, 256 decoders of 1024 tokens and 4 of 4096
    # need 35 GB of an 8B model's cache, not 137 GB), and every point is measured
    # as asked, none of its decoders preempted.
    from testbed.engine.args import EngineArgs
    from testbed.engine.factory import build_engine
    from testbed.profiling.grid import Point, fit_args
    from testbed.profiling.measure import measure_point

    grid = [Point(24, 200, 0), Point(2, 1500, 0), Point(0, 0, 1200), Point(4, 200, 600)]
    args = EngineArgs(model="dummy-llama", device="cpu", block_size=16)
    fit_args(args, grid, repeats=2, warmup=1)
    per_point = [-(-(p.context + 40) // 16) * p.decode_batch for p in grid]
    assert max(per_point) <= args.num_kv_blocks < 1.5 * max(per_point) + 100
    assert args.num_kv_blocks < 24 * 1500 // 16  # the old bound: largest batch x longest
    assert args.max_model_len >= 1500 and args.max_num_batched_tokens >= 25 + 1200
    engine, executor, cfg = build_engine(args)
    for i, p in enumerate(grid):
        row = measure_point(engine, executor, p, 2, 1, cfg.vocab_size, i)
        assert row["num_reqs"] == p.decode_batch + (p.prefill_tokens > 0)
        assert row["num_tokens"] == p.decode_batch + p.prefill_tokens
    assert engine.scheduler.num_preemptions == 0


def test_a_packed_point_prefills_its_tokens_as_that_many_prompts_in_one_step():
    # A burst's step: many short prompts at once, alone and beside decodes.
    from testbed.engine.args import EngineArgs
    from testbed.engine.factory import build_engine
    from testbed.profiling.grid import PACKED_POINTS, Point, fit_args
    from testbed.profiling.measure import measure_point

    assert all(Point(*g) in map(lambda x: Point(*x), GRIDS["default"]) for g in PACKED_POINTS)
    grid = [Point(0, 0, 100, 0, 0, 7), Point(5, 64, 90, 0, 0, 9)]
    assert grid[0].prompt_lens() == [15, 15, 14, 14, 14, 14, 14] and grid[0].label() == "0x0+100/7"
    args = EngineArgs(model="dummy-llama", device="cpu", block_size=16)
    fit_args(args, grid, repeats=2, warmup=1)
    assert args.max_num_seqs >= 14
    engine, executor, cfg = build_engine(args)
    for i, p in enumerate(grid):
        row = measure_point(engine, executor, p, 2, 1, cfg.vocab_size, i)
        assert row["prefills"] == p.prefills
        assert row["num_reqs"] == p.decode_batch + p.prefills
        assert row["num_tokens"] == p.decode_batch + p.prefill_tokens
        lens = p.prompt_lens()
        decode_pairs = p.decode_batch * (p.context + 1)
        assert row["attn_pairs"] == pytest.approx(
            sum(n * (n + 1) / 2 for n in lens) + decode_pairs, rel=0.05
        )
    assert engine.scheduler.num_preemptions == 0


def test_a_prefill_after_a_cached_prefix_computes_only_its_new_tokens():
    # What a trace with prefix sharing produces: attention over a long cached
    # context beside few tokens computed, which no prefill from scratch shows.
    from dataclasses import replace

    from testbed.engine.args import EngineArgs
    from testbed.engine.factory import build_engine
    from testbed.profiling.grid import Point, fit_args
    from testbed.profiling.measure import measure_point

    grid = [Point(0, 0, 48, 320), Point(3, 64, 32, 512)]
    args = EngineArgs(model="dummy-llama", device="cpu", block_size=16)
    fit_args(args, grid, repeats=2, warmup=1)
    assert args.max_model_len >= 512 + 32 + 1 and not args.enable_prefix_caching
    plain, executor, cfg = build_engine(args)
    with pytest.raises(ValueError, match="0x0\\+48@320: needs an engine with prefix caching"):
        measure_point(plain, executor, grid[0], 2, 1, cfg.vocab_size, 0)
    engine, executor, _ = build_engine(replace(args, enable_prefix_caching=True), model=None)
    for i, p in enumerate(grid):
        row = measure_point(engine, executor, p, 2, 1, cfg.vocab_size, i)
        assert row["prefix_tokens"] == p.prefix_tokens
        assert row["num_reqs"] == p.decode_batch + 1
        assert row["num_tokens"] == p.decode_batch + p.prefill_tokens  # the prefix is not
        n, c = p.prefill_tokens, p.prefix_tokens
        assert row["attn_pairs"] >= n * (c + (n + 1) / 2)  # (and the decodes' pairs)
        assert row["max_kv"] == c + n and row["kv_tokens"] >= c + n
    assert engine.scheduler.num_preemptions == 0


def test_a_profile_past_its_grid_time_limit_skips_the_rest_names_them_and_still_replays(tmp_path):
    from testbed.engine.args import EngineArgs
    from testbed.profiling.profiler import run_profile

    path = run_profile(
        EngineArgs(model="dummy-llama", device="cpu"),
        "quick",
        repeats=2,
        warmup=1,
        out_dir=tmp_path,
        hardware="cpu",
        replay_requests=6,
        sparse_requests=1,  # and one more at the sparse replay's rate
        max_grid_s=1e-9,  # past it once the first point is measured
    )
    assert path == tmp_path / "cpu" / "dummy-llama.csv"  # a profile, not a partial one
    header = read_profile_header(path)
    n = len(GRIDS["quick"])
    assert header["grid"].startswith(f"quick (1 of {n} points; skipped at the 1e-09 s limit")
    assert header["grid"].endswith(
        "1x128+0, 0x0+256, 4x128+0, 4x128+128, 16x128+0, 0x0+64@256, 4x128+0~3, 0x0+256/8)"
    )
    table = pd.read_csv(path, comment="#")
    assert (table["grid"] == "point").sum() == 1 and (table["grid"] == "replay").sum() > 6
    sparse = table[table["grid"] == "replay_sparse"]
    assert len(sparse) > 1 and (sparse["num_reqs"] == 1).all()  # one request, alone
    assert ProfileModel(path).fit_rel_error < 0.5  # the replay's steps still fit


def test_the_sparse_replay_decodes_small_batches_across_contexts():
    """The replay at the default rate fills the batch (one request decodes alone
    only at the end); the sparse one runs its requests mostly alone, so its
    one-request decodes cover each request's whole context range."""
    from testbed.engine.args import EngineArgs
    from testbed.engine.factory import build_engine
    from testbed.profiling.replay_steps import SPARSE_RATE, measure_replay

    engine, _, cfg = build_engine(EngineArgs(model="dummy-llama", device="cpu"))
    rows = measure_replay(
        engine, 3, cfg.vocab_size, seed=4321, rate=SPARSE_RATE, name="s", grid="replay_sparse"
    )
    steps = pd.DataFrame([r for r in rows if r["kind"] == "step"])
    assert (steps["grid"] == "replay_sparse").all()
    decodes = steps[steps["prefill_tokens"] == 0]
    assert len(decodes) > 100
    assert (decodes["num_reqs"] <= 2).mean() >= 0.5
    alone = decodes[decodes["num_reqs"] == 1]
    assert alone["max_kv"].max() - alone["max_kv"].min() > 150
