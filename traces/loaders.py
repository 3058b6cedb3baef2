"""Loaders for the public trace formats and for our own CSV format.

Each loader reads a file into a raw frame, passes it through
:func:`traces.validate.validate` (so bad rows fail with file, row and field)
and returns a typed trace. Real arrival times are shifted so that the first
request arrives at 0.0. ServeGen statistics, which need a generator rather
than a loader, are turned into traces by :mod:`traces.servegen`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.schema import COLUMNS, DEFAULT_HASH_BLOCK_TOKENS, REQUIRED, TraceError
from traces.synthetic import arrivals
from traces.validate import validate

__all__ = [
    "load_azure",
    "load_csv",
    "load_lengths",
    "load_mooncake",
    "parse_csv",
    "read_lengths",
    "read_text",
]

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
MOONCAKE_STEP_S = 3.0  # the conversation trace's timestamp quantum
# Floats must come back bit-for-bit: pandas 3 parses exactly by default (and
# deprecates the option); pandas 2's default parser can be off by an ulp.
_EXACT_FLOATS = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped). A file that is
    not text, such as a binary given as a trace, or that cannot be read (a folder)
    is a TraceError naming it and the line of its first bad byte."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise  # as every loader's missing file is: run_trace names it
    except OSError as e:
        raise TraceError(str(path), f"cannot read it ({e.strerror or e})") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        at = f"byte 0x{data[e.start]:02x} at offset {e.start}"
        msg = f"not UTF-8 text ({at}); a trace is a UTF-8 text file"
        raise TraceError(str(path), msg, line=line) from None


def parse_csv(path: Path, text: str | None = None, **kwargs: Any) -> pd.DataFrame:
    """pd.read_csv of ``text`` (default: the file's, :func:`read_text`), parse
    errors raised as a one-line TraceError."""
    if text is None:
        text = read_text(path)
    try:
        return pd.read_csv(io.StringIO(text), **kwargs)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise TraceError(str(path), f"cannot parse as CSV: {' '.join(str(e).split())}") from None


def _require(raw: pd.DataFrame, path: Path, columns: tuple[str, ...], header_line: int = 1) -> None:
    for column in columns:
        if column not in raw.columns:
            present = ", ".join(map(str, raw.columns))
            msg = f"missing column (columns present: {present})"
            raise TraceError(str(path), msg, row="header", line=header_line, field=column)


def load_azure(path: str | Path) -> pd.DataFrame:
    """An Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps carry 7 fractional digits (100 ns), more than strptime's ``%f``
    takes; pandas' ISO 8601 parser reads all of them, vectorised.
    """
    path = Path(path)
    raw = parse_csv(path, dtype={"TIMESTAMP": "str"})
    _require(raw, path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    ts = pd.to_datetime(raw["TIMESTAMP"], format="ISO8601", errors="coerce")
    if len(bad := np.flatnonzero(ts.isna().to_numpy())):
        i = int(bad[0])
        msg = f"not a timestamp ({raw['TIMESTAMP'].iloc[i]!r})"
        raise TraceError(str(path), msg, row=i + 1, line=i + 2, field="TIMESTAMP")
    frame = pd.DataFrame(
        {
            "arrival_s": (ts - ts.iloc[0]).dt.total_seconds() if len(ts) else [],
            "prompt_tokens": raw["ContextTokens"],
            "output_tokens": raw["GeneratedTokens"],
        }
    )
    frame.attrs.update(name=path.stem, source=str(path))
    fields = {"arrival_s": "TIMESTAMP", "prompt_tokens": "ContextTokens"}
    return validate(frame, path, fields={**fields, "output_tokens": "GeneratedTokens"})


def _read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """The objects of a JSON Lines file and the line each came from (blank lines skipped)."""
    rows: list[dict] = []
    lines: list[int] = []
    # Universal newlines, as open() reads text: a line ends at \n, \r\n or \r.
    with io.StringIO(read_text(path), newline=None) as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                msg = f"not valid JSON ({e.msg}, column {e.colno})"
                raise TraceError(str(path), msg, row=len(rows) + 1, line=lineno) from None
            if not isinstance(obj, dict):
                msg = f"not a JSON object ({text.strip()[:40]!r})"
                raise TraceError(str(path), msg, row=len(rows) + 1, line=lineno)
            rows.append(obj)
            lines.append(lineno)
    return rows, lines


def load_mooncake(path: str | Path, spread: str = "keep", seed: int = 0) -> pd.DataFrame:
    """A Mooncake FAST'25 JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids`` of 512-token blocks, which become ``prefix_hash_ids``).

    The conversation trace's timestamps come in ~3 s steps. ``spread="keep"``
    replays those bursts as they are; ``spread="uniform"`` spreads each group of
    equal timestamps uniformly (seeded) over the gap to the next distinct
    timestamp (3 s after the last), keeping the file's order within the group,
    and then re-zeroes so the first request is at 0.0. Use it on quantised
    traces only: on fine-grained ones it jitters every arrival within its gap.
    """
    if spread not in ("keep", "uniform"):
        raise ValueError(f"spread must be 'keep' or 'uniform', got {spread!r}")
    path = Path(path)
    rows, lines = _read_jsonl(path)
    raw = pd.DataFrame(
        {
            "arrival_s": [r.get("timestamp") for r in rows],  # ms until validated
            "prompt_tokens": [r.get("input_length") for r in rows],
            "output_tokens": [r.get("output_length") for r in rows],
            "prefix_hash_ids": pd.Series([r.get("hash_ids") for r in rows], dtype="object"),
        }
    )
    raw.attrs.update(name=path.stem, source=str(path), hash_block_tokens=MOONCAKE_BLOCK_TOKENS)
    fields = {"arrival_s": "timestamp", "prompt_tokens": "input_length"}
    fields |= {"output_tokens": "output_length", "prefix_hash_ids": "hash_ids"}
    df = validate(raw, path, lines=lines, header_lines=0, fields=fields)
    t = df["arrival_s"].to_numpy() / 1000.0
    t = t - t[0] if len(t) else t
    if spread == "uniform" and len(t):
        t = _spread_uniform(t, np.random.default_rng(seed))
        df.attrs["notes"].append(
            f"spread requests with equal timestamps uniformly over the gap to the next "
            f"(last: {MOONCAKE_STEP_S:g} s), seed {seed}"
        )
    df["arrival_s"] = t
    return df


def _spread_uniform(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Spread each run of equal (sorted) times uniformly up to the next distinct time."""
    starts, group = np.unique(t, return_inverse=True)
    gap = np.diff(starts, append=starts[-1] + MOONCAKE_STEP_S)
    u = rng.random(len(t))
    # Sorting by (group, u) hands the k-th smallest draw of a group to its k-th
    # request: the file's order within a group survives.
    u = u[np.lexsort((u, group))]
    out = t + u * gap[group]
    return out - out[0]


def read_lengths(path: str | Path) -> pd.DataFrame:
    """The rows of a Sarathi/Vidur length file (``num_prefill_tokens``,
    ``num_decode_tokens``) as a validated trace with every arrival at 0.0."""
    path = Path(path)
    raw = parse_csv(path)
    _require(raw, path, ("num_prefill_tokens", "num_decode_tokens"))
    frame = pd.DataFrame(
        {
            "arrival_s": np.zeros(len(raw)),
            "prompt_tokens": raw["num_prefill_tokens"],
            "output_tokens": raw["num_decode_tokens"],
        }
    )
    frame.attrs.update(name=path.stem, source=str(path))
    fields = {"prompt_tokens": "num_prefill_tokens", "output_tokens": "num_decode_tokens"}
    return validate(frame, path, fields=fields)


def load_lengths(
    path: str | Path,
    num_requests: int | None = None,
    rate: float = 1.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> pd.DataFrame:
    """A Sarathi/Vidur length file (``num_prefill_tokens``, ``num_decode_tokens``) with
    synthetic arrivals (``arrival`` "poisson" or "gamma" with ``cv``) at ``rate`` req/s.

    All rows in file order by default; ``num_requests`` samples rows (seeded):
    without replacement when the file has enough, else with replacement.
    """
    df = read_lengths(path)  # checked row by row before sampling, so errors name file rows
    attrs, rows_in_file = df.attrs, len(df)
    r_sample, r_arrival = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    notes = []
    if num_requests is not None:
        replace = num_requests > rows_in_file
        rows = r_sample.choice(rows_in_file, size=num_requests, replace=replace)
        df = df.iloc[rows].reset_index(drop=True)
        how = "with" if replace else "without"
        notes.append(
            f"sampled {num_requests} of {rows_in_file} rows {how} replacement, seed {seed}"
        )
    df["arrival_s"] = arrivals(len(df), rate, arrival, cv, r_arrival)
    notes.append(f"{arrival} arrivals at {rate:g} req/s (cv {cv:g}), seed {seed}")
    df.attrs = {**attrs, "notes": notes}
    return df


def _header(text: str) -> tuple[dict[str, str], list[str], int]:
    """Leading ``# key: value`` comment lines -> (attrs, notes, number of comment lines)."""
    meta: dict[str, str] = {}
    notes: list[str] = []
    count = 0
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        count += 1
        key, sep, value = line[1:].partition(":")
        key, value = key.strip(), value.strip()
        if sep and key == "note":
            notes.append(value)
        elif sep and key in ("name", "source", "hash_block_tokens"):
            meta[key] = value
    return meta, notes, count


def _int_meta(path: Path, meta: dict[str, str], key: str, default: int) -> int:
    try:
        return int(meta.get(key, default))
    except ValueError:
        raise TraceError(str(path), f"comment '# {key}: {meta[key]}' is not an integer") from None


def _parse_hash_ids(values: pd.Series, path: Path, lines: list[int] | None, skip: int) -> list:
    out: list[tuple[int, ...] | None] = []
    for i, v in enumerate(values):
        if pd.isna(v) or not str(v).strip():
            out.append(None)
            continue
        try:
            out.append(tuple(int(x) for x in str(v).split()))
        except ValueError:
            line = lines[i] if lines else i + 1 + skip
            msg = f"not space-separated integers ({v!r})"
            raise TraceError(
                str(path), msg, row=i + 1, line=line, field="prefix_hash_ids"
            ) from None
    return out


class _DataLines(Sequence[int]):
    """The file line of each data row (pandas skips blank lines), counted only when
    an error message names one (a million-row file's lines are not kept)."""

    def __init__(self, text: str, skip: int, num_rows: int) -> None:
        self._text, self._skip, self._num_rows = text, skip, num_rows
        self._lines: list[int] | None = None

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, i):
        if self._lines is None:
            rows = enumerate(self._text.splitlines())
            lines = [i + 1 for i, s in rows if i > self._skip and s.strip()]
            # Where the count differs, data row i is at line i + 1 + the header's lines.
            self._lines = lines if len(lines) == self._num_rows else []
        if not self._lines:
            return range(self._skip + 2, self._skip + 2 + self._num_rows)[i]
        return self._lines[i]


def load_csv(path: str | Path) -> pd.DataFrame:
    """Our own trace CSV, as written by :func:`traces.export.export_csv`.

    Optional leading ``#`` comment lines (``# name: ...``, ``# source: ...``,
    ``# hash_block_tokens: ...``, ``# note: ...`` become attrs; others are
    ignored), then a header with ``arrival_s,prompt_tokens,output_tokens`` and
    optionally ``tenant,priority,ttft_slo_s,tpot_slo_s,prefix_hash_ids``
    (space-separated ints, empty for none) and ``capped``. Empty cells take the
    defaults; unknown columns are an error.
    """
    path = Path(path)
    text = read_text(path)
    meta, notes, skip = _header(text)
    numeric = [c for c, dtype in COLUMNS.items() if dtype in ("float64", "int64")]
    na = {c: ["", "nan", "NaN"] for c in numeric} | {"tenant": [""], "prefix_hash_ids": [""]}
    raw = parse_csv(
        path,
        text,
        skiprows=skip,
        dtype={"tenant": "str", "prefix_hash_ids": "str"},
        keep_default_na=False,
        na_values=na,
        **_EXACT_FLOATS,
    )
    _require(raw, path, REQUIRED, header_line=skip + 1)
    lines = _DataLines(text, skip, len(raw))
    if "prefix_hash_ids" in raw.columns:
        raw["prefix_hash_ids"] = pd.Series(
            _parse_hash_ids(raw["prefix_hash_ids"], path, lines, skip + 1), dtype="object"
        )
    raw.attrs.update(
        name=meta.get("name", path.stem),
        source=meta.get("source", str(path)),
        hash_block_tokens=_int_meta(path, meta, "hash_block_tokens", DEFAULT_HASH_BLOCK_TOKENS),
        notes=notes,
    )
    return validate(raw, path, lines=lines, header_lines=skip + 1)
