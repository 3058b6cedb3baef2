"""The step log: pieces for writing that add up to the whole log."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.metrics.steplog import StepLog
from testbed.report.rundir import write_tables


def a_log(replicas: int = 1, seed: int = 0, spill_rows: int = 1 << 20) -> StepLog:
    """Single steps and jumps (runs of rows sharing their integer columns)."""
    rng = np.random.default_rng(seed)
    log, t = StepLog(spill_rows), 0.0
    for _ in range(60):
        replica = int(rng.integers(replicas))
        if rng.random() < 0.5:
            log.add(replica, t, 0.01, 3, 40, 2, 0.1, 1, 3, 0, 100.0, 200.0, 50.0)
            t += 0.01
            continue
        k = int(rng.integers(1, 9))
        starts = t + 0.02 * np.arange(k)
        n = int(rng.integers(1, 5))
        after = n - int(rng.integers(0, 2))
        kv = 100.0 + np.arange(1, k + 1, dtype=np.float64)
        log.add_decode_steps(replica, starts, np.full(k, 0.02), n, kv / 1e3, 0, after, kv, kv)
        t += 0.02 * k
    return log


@pytest.mark.parametrize("rows", [1, 3, 7, 64, 10_000])
def test_the_pieces_are_the_whole_log(rows):
    log = a_log()
    whole = log.to_frame()
    pieces = list(log.frames(rows))
    assert all(len(p) <= rows for p in pieces)
    pd.testing.assert_frame_equal(pd.concat(pieces, ignore_index=True), whole)


def test_several_replicas_come_ordered_whole():
    log = a_log(replicas=3)
    (frame,) = log.frames(5)
    pd.testing.assert_frame_equal(frame, log.to_frame())
    assert frame["start_s"].is_monotonic_increasing


@pytest.mark.parametrize("steps_format", ["csv", "parquet"])
@pytest.mark.parametrize("piece_rows", [5, 1 << 20])
def test_the_step_file_is_the_log_in_pieces_or_whole(
    tmp_path, monkeypatch, piece_rows, steps_format
):
    from testbed.report import rundir

    monkeypatch.setattr(rundir, "PIECE_ROWS", piece_rows)
    log = a_log(seed=1)
    requests = pd.DataFrame({"request_id": ["a", "b"]})
    path = write_tables(tmp_path, requests, log, steps_format)
    assert path.name == f"steps.{steps_format}"
    whole = log.to_frame()
    whole.insert(0, "step", np.arange(len(whole)))
    # every value round-trips exactly (floats as their shortest exact text in CSV,
    # where a whole float reads back as an integer)
    back = rundir.read_steps(tmp_path)
    pd.testing.assert_frame_equal(
        back, whole, check_exact=True, check_dtype=steps_format == "parquet"
    )
    empty = StepLog()
    write_tables(tmp_path, requests, empty, steps_format)
    back = rundir.read_steps(tmp_path)
    assert list(back.columns)[:2] == ["step", "replica"] and len(back) == 0
    if steps_format == "csv":
        assert (tmp_path / "steps.csv").read_text().splitlines()[0].startswith("step,replica,")


@pytest.mark.parametrize("spill_rows", [1, 5, 16])
@pytest.mark.parametrize("replicas", [1, 3])
def test_rows_moved_to_files_read_back_as_they_were_logged(spill_rows, replicas):
    kept, spilled = a_log(replicas, seed=2), a_log(replicas, seed=2, spill_rows=spill_rows)
    assert spilled._dir is not None and len(spilled) == len(kept)
    assert len(spilled._floats["start_s"]) < spill_rows  # the rest is on disk
    pd.testing.assert_frame_equal(spilled.to_frame(), kept.to_frame())
    for rows in (3, 1 << 20):
        for a, b in zip(spilled.frames(rows), kept.frames(rows), strict=True):
            pd.testing.assert_frame_equal(a, b)
        names = ["start_s", "num_reqs"]
        for a, b in zip(spilled.pieces(names, rows), kept.pieces(names, rows), strict=True):
            assert all(np.array_equal(a[n], b[n]) for n in names)


def test_the_files_go_with_the_log():
    import gc

    log = a_log(spill_rows=4)
    folder = log._dir
    assert folder.exists()
    del log
    gc.collect()
    assert not folder.exists()
