"""The run directory's files: ``metrics.json``, ``requests.csv``, ``steps.csv``,
and the probes' samples where a real run took them.

``outputs.steps_format=parquet`` writes ``steps.parquet`` instead of
``steps.csv``. The same files in both modes, so that ``experiments/`` can join a simulated and
a real run of the same trace request by request (``docs/outputs.md``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.errors import InputError
from testbed.metrics.steplog import StepLog


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; absent values are null
    if isinstance(v, np.generic):
        return _jsonable(v.item())
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def write_metrics(run_dir: Path, metrics: dict[str, Any]) -> Path:
    path = run_dir / "metrics.json"
    path.write_text(json.dumps({k: _jsonable(v) for k, v in metrics.items()}, indent=2) + "\n")
    return path


PIECE_ROWS = 1 << 18  # steps are written this many rows at a time
STEPS_FORMATS = ("csv", "parquet")


def write_tables(
    run_dir: Path, requests: pd.DataFrame, steps: StepLog, steps_format: str = "csv"
) -> Path:
    """``requests.csv`` and the step log (``steps.csv`` or ``steps.parquet``, by
    ``steps_format``); returns the step log's path."""
    requests.to_csv(run_dir / "requests.csv", index=False)
    return write_steps(run_dir, steps, steps_format)


def write_steps(run_dir: Path, steps: StepLog, steps_format: str = "csv") -> Path:
    """The step log with a ``step`` number first, written with pyarrow a piece at a
    time (pandas' CSV writer takes seconds per million rows; a text copy of the
    whole log would take gigabytes)."""
    import pyarrow as pa

    if steps_format not in STEPS_FORMATS:
        raise ValueError(f"steps_format={steps_format!r}: one of {STEPS_FORMATS}")
    path = run_dir / f"steps.{steps_format}"
    writer, row = None, 0
    frames = steps.frames(PIECE_ROWS) if len(steps) else [steps.to_frame()]  # none: the columns
    try:
        for frame in frames:
            frame.insert(0, "step", np.arange(row, row + len(frame)))
            table = pa.Table.from_pandas(frame, preserve_index=False)
            writer = writer or _steps_writer(path, table.schema, steps_format)
            writer.write_table(table)
            row += len(frame)
    finally:
        if writer is not None:
            writer.close()
    return path


def _steps_writer(path: Path, schema, steps_format: str):
    if steps_format == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetWriter(path, schema)
    import pyarrow.csv as pacsv

    options = pacsv.WriteOptions(quoting_style="none", quoting_header="none")
    return pacsv.CSVWriter(path, schema, write_options=options)


def read_steps(run_dir: Path, columns: list[str] | None = None) -> pd.DataFrame:
    """A run's step log, whichever format it was written in."""
    parquet = run_dir / "steps.parquet"
    if parquet.exists():
        return pd.read_parquet(parquet, columns=columns)
    return pd.read_csv(run_dir / "steps.csv", usecols=columns)


def write_idle_probe(run_dir: Path, samples: list[tuple[float, float]]) -> None:
    """``idle_probe.csv``: when (run clock) the idle probe ran and how long it took."""
    frame = pd.DataFrame(samples, columns=["time_s", "probe_s"])
    frame.to_csv(run_dir / "idle_probe.csv", index=False, float_format="%.6g")


def write_reference_probe(run_dir: Path, table: pd.DataFrame) -> None:
    """``reference_probe.csv``: the reference probe's samples (see
    ``testbed.profiling.reference_probe.sample_table``)."""
    table.to_csv(run_dir / "reference_probe.csv", index=False, float_format="%.6g")


def write_spec_acceptance(run_dir: Path, table: list[dict]) -> None:
    """``spec_acceptance.csv``: speculative decoding per draft position (the
    simulator's acceptance model reads it: ``engine.speculative.acceptance_table``)."""
    columns = [
        "position",
        "offered",
        "proposed",
        "proposal_rate",
        "verified",
        "accepted",
        "acceptance_rate",
    ]
    pd.DataFrame(table, columns=columns).to_csv(
        run_dir / "spec_acceptance.csv", index=False, float_format="%.6g"
    )


CLAIM = ".run"  # created when a run starts in a folder, so that no second run writes there
SWEEP_ID = "TESTBED_SWEEP_ID"  # set by the sweep summary for its jobs (report/sweep.py)


_AHEAD: set[Path] = set()  # folders claimed for the run this process is about to start


def claim(run_dir: Path, ahead: bool = False) -> None:
    """Make ``run_dir`` this run's: create it and, atomically, its :data:`CLAIM`
    file (the sweep it belongs to, the process, the time). A folder another run
    has claimed is refused: two runs' files would mix in it. ``ahead``: claimed
    before Hydra writes into it (``report/claim_callback.py``), for the run about
    to start, whose own claim then takes it over once."""
    if run_dir.resolve() in _AHEAD:
        _AHEAD.discard(run_dir.resolve())
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(run_dir / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        owner = read_claim(run_dir)
        raise InputError(
            f"run directory {run_dir} already holds a run ({owner}): its files and this "
            "run's would mix; give this run another folder (hydra.run.dir=...)"
        ) from None
    with os.fdopen(fd, "w") as f:
        owner = {"sweep": os.environ.get(SWEEP_ID), "pid": os.getpid(), "started": time.time()}
        json.dump(owner, f)
    if ahead:
        _AHEAD.add(run_dir.resolve())


def release(run_dir: Path) -> None:
    """Give up this process's claim on ``run_dir``: a run refused for its input
    before it started leaves the folder free for the corrected run."""
    _AHEAD.discard(run_dir.resolve())
    if read_claim(run_dir).get("pid") == os.getpid():
        (run_dir / CLAIM).unlink(missing_ok=True)


def release_ahead() -> None:
    """Give up the claims made ahead of a run (see :func:`claim`)."""
    for run_dir in list(_AHEAD):
        release(run_dir)


def read_claim(run_dir: Path) -> dict[str, Any]:
    """What a run folder's :data:`CLAIM` says ({} where it has none or cannot be read)."""
    try:
        data = json.loads((run_dir / CLAIM).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def unwritable_output_dir(argv: list[str]) -> str | None:
    """Why the output folder a command line gives (``hydra.run.dir=``, or
    ``hydra.sweep.dir=`` with ``-m``) cannot be written, or None. Checked before
    Hydra starts: Hydra writes its log there first and would fail with an
    unrelated error (a folder given with ``${...}`` is Hydra's to resolve)."""
    sweep = "-m" in argv or "--multirun" in argv
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    for arg in argv:
        name, _, value = arg.partition("=")
        if name.lstrip("+") != key or "${" in value:
            continue
        path = Path(value)
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            return f"{key}={value}: that folder cannot be created or written ({e.strerror or e})"
    return None
