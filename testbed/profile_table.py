"""The profile table (``profiles/<hardware>/<model>.csv``): the contract between
the profiler, which writes it, and the simulator's profile model, which reads it.

A table is ``# key: value`` header lines (where, when and how it was measured)
then CSV rows: one per grid point (``grid=point``), per replayed step
(``grid=replay`` or ``replay_sparse``) and per idle-probe sample
(``kind=idle_probe``). Pure pandas: a bare machine that only reads profiles
needs no torch.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

# Profile rows of replayed steps (the profiler's busy replay and its sparse one):
# one group, "replay", for the fit's weights and its level.
REPLAY_GRIDS = ("replay", "replay_sparse")


def read_profile_header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a profile table."""
    header = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
    return header


def profile_path(profiles_dir: str | Path, hardware: str, model: str) -> Path:
    return Path(profiles_dir) / hardware / f"{model}.csv"


def profile_machine(header: dict) -> str | None:
    """The machine a profile was measured on: its header's ``machine``, else its
    ``cpu`` (older tables), else None (tables that do not say)."""
    return header.get("machine") or header.get("cpu")


def profile_speed_moved(header: dict) -> float | None:
    """How much the machine's speed moved while a profile was measured: its header's
    ``speed_moved`` (the profiler's probe, its slowest stretch against its fastest,
    as a fraction); None where the header does not say (tables measured before it
    had the field, or with too few probe samples: ``n/a``)."""
    try:
        return float(header["speed_moved"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def write_profile(path: Path, header: dict, table: pd.DataFrame | list[dict]) -> None:
    table = pd.DataFrame(table) if isinstance(table, list) else table
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for k, v in header.items():
            f.write(f"# {k}: {v}\n")
        table.to_csv(f, index=False, float_format="%.9g")


# Header probes that merge_profiles averages over the passes.
PROBE_KEYS = (
    "speed_probe_s",
    "idle_probe_s",
    "reference_probe_s",
    "reference_probe_grid_s",
    "reference_probe_replay_s",
)


def merge_profiles(paths: list[Path], out: Path) -> Path:
    """One profile from several passes of the profiler over the same engine,
    measured at different times: every pass's rows (column ``pass``), so the fit
    averages the machine's speed over the passes. On a machine whose speed
    wanders over minutes (a shared VM), passes spread over an experiment's
    window predict that window better than one pass taken at its start."""
    if not paths:
        raise ValueError("merge_profiles: no profiles to merge")
    headers = [read_profile_header(Path(p)) for p in paths]
    keys = ("hardware", "model", "dtype", "block_size", "attention_backend", "machine", "cpu")
    for key in keys:
        seen = {h[key] for h in headers if key in h}  # (cpu, machine: not in older tables)
        if len(seen) > 1:
            differ = sorted(map(str, seen))
            raise ValueError(f"merge_profiles: the passes differ in {key}: {differ}")
    tables = [pd.read_csv(p, comment="#").assign(**{"pass": i}) for i, p in enumerate(paths)]
    header = dict(headers[0])
    header.update(
        passes=len(paths),
        date=f"{headers[0].get('date', '?')} to {headers[-1].get('date', '?')}",
        pass_dates=", ".join(h.get("date", "?") for h in headers),
    )
    for key in PROBE_KEYS:  # the passes' mean
        probes = [float(h[key].split()[0]) for h in headers if key in h]
        if len(probes) == len(headers):
            listed = ", ".join(f"{p:.6g}" for p in probes)
            header[key] = f"{statistics.fmean(probes):.6g} (passes: {listed})"
        else:
            header.pop(key, None)  # a mean over some passes would not match the rows
    moved = [profile_speed_moved(h) for h in headers]
    if None in moved:  # a pass that does not say: the merged table cannot either
        header.pop("speed_moved", None)
    else:  # the passes' largest: the merge holds every pass's rows
        listed = ", ".join(f"{m:.3g}" for m in moved)
        header["speed_moved"] = f"{max(moved):.3g} (the largest of the passes': {listed})"
    header["measured_by"] = f"{headers[0].get('measured_by', '?')}; {len(paths)} passes merged"
    write_profile(out, header, pd.concat(tables, ignore_index=True))
    return out
