"""Checking a trace and converting it to the schema's dtypes.

Every loader builds a raw frame (values as they are in the file), then calls
:func:`validate`, which raises a :class:`~traces.schema.TraceError` naming the
file, row and field of the first problem, or returns the typed trace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from traces.schema import COLUMNS, DEFAULT_HASH_BLOCK_TOKENS, DEFAULTS, REQUIRED, TraceError

_TOKEN_COLUMNS = ("prompt_tokens", "output_tokens")
_SLO_COLUMNS = ("ttft_slo_s", "tpot_slo_s")
_EXTRA_COLUMNS = ("capped",)  # added by cap_lengths, kept through export and load


class _Where:
    """Turns a row position into the TraceError that names file, row, line and field."""

    def __init__(
        self,
        source: str,
        lines: Sequence[int] | None,
        header_lines: int,
        fields: Mapping[str, str],
    ) -> None:
        self.source, self.lines, self.header_lines, self.fields = (
            source,
            lines,
            header_lines,
            fields,
        )

    def error(self, message: str, i: int | None, column: str) -> TraceError:
        field = self.fields.get(column, column)
        if i is None:  # a problem with the header itself (or, without one, the whole file)
            row, line = ("header", self.header_lines) if self.header_lines else (None, None)
        elif self.lines is not None:
            row, line = i + 1, int(self.lines[i])
        else:
            row, line = i + 1, i + 1 + self.header_lines
        return TraceError(self.source, message, row=row, line=line, field=field)


def _show(value: object) -> str:
    """repr of a value as the file had it (numpy scalars shown as plain Python numbers)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _first(mask: pd.Series | np.ndarray) -> int | None:
    hits = np.flatnonzero(np.asarray(mask, dtype=bool))
    return int(hits[0]) if len(hits) else None


def _numbers(df: pd.DataFrame, column: str, where: _Where, required: bool) -> pd.Series:
    """The column as float64, raising on values that are not numbers (or missing, if required)."""
    raw = df[column]
    if pd.api.types.is_bool_dtype(raw):
        raw = raw.astype("int64")
    num = pd.to_numeric(raw, errors="coerce").astype("float64")
    if (i := _first(num.isna() & raw.notna())) is not None:
        raise where.error(f"not a number ({_show(raw.iloc[i])})", i, column)
    if (i := _first(np.isinf(num))) is not None:
        raise where.error(f"not a finite number ({_show(raw.iloc[i])})", i, column)
    if required and (i := _first(num.isna())) is not None:
        raise where.error("missing value (empty or NaN)", i, column)
    return num


def _integers(num: pd.Series, column: str, where: _Where) -> pd.Series:
    if (i := _first(num.notna() & (num % 1 != 0))) is not None:
        raise where.error(f"not a whole number ({_show(num.iloc[i])})", i, column)
    return num


def _hash_ids(values: pd.Series, where: _Where) -> list[tuple[int, ...] | None]:
    """Each value as a tuple of ints, or None (lists are accepted and converted)."""
    out: list[tuple[int, ...] | None] = []
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and np.isnan(v)):
            out.append(None)
            continue
        if not isinstance(v, tuple | list) or not all(
            isinstance(x, int | np.integer) and not isinstance(x, bool) for x in v
        ):
            raise where.error(f"not a sequence of integers ({v!r})", i, "prefix_hash_ids")
        out.append(tuple(int(x) for x in v))
    return out


def validate(
    df: pd.DataFrame,
    source: str | object,
    *,
    lines: Sequence[int] | None = None,
    header_lines: int = 1,
    fields: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Check a raw trace frame and return it as a typed trace.

    ``df`` holds at least the required columns (``arrival_s``, ``prompt_tokens``,
    ``output_tokens``) with values as read (strings are fine); optional columns
    missing or empty get their defaults. Checks, raising on the first problem:
    no unknown columns, numbers are finite numbers, no missing required values,
    whole token counts > 0, arrival times >= 0 and non-decreasing, SLOs > 0 where
    given, whole priorities, prefix hash ids sequences of ints.

    Row i of ``df`` is reported as data row i+1 at file line ``lines[i]``, or
    ``i + 1 + header_lines`` when ``lines`` is None. ``fields`` maps schema
    column names to the file's own names for the messages (e.g.
    ``{"prompt_tokens": "ContextTokens"}``). The returned frame keeps
    ``df.attrs``, filling in ``source``, ``name``, ``hash_block_tokens`` and
    ``notes`` where absent.
    """
    src = str(source)
    where = _Where(src, lines, header_lines, fields or {})
    for column in REQUIRED:
        if column not in df.columns:
            present = ", ".join(map(str, df.columns)) or "none"
            raise where.error(f"missing column (columns present: {present})", None, column)
    for column in df.columns:
        if column not in COLUMNS and column not in _EXTRA_COLUMNS:
            known = ", ".join([*COLUMNS, *_EXTRA_COLUMNS])
            raise where.error(f"unknown column (known columns: {known})", None, str(column))

    arrival = _numbers(df, "arrival_s", where, required=True)
    if (i := _first(np.diff(arrival.to_numpy()) < 0)) is not None:
        prev, cur = arrival.iloc[i], arrival.iloc[i + 1]
        msg = f"arrival times must be non-decreasing: {_show(cur)} comes after {_show(prev)}"
        msg += f" (row {i + 1})"
        raise where.error(msg, i + 1, "arrival_s")
    if (i := _first(arrival < 0)) is not None:
        raise where.error(
            f"arrival time must be >= 0 (got {_show(arrival.iloc[i])})", i, "arrival_s"
        )
    cols: dict[str, object] = {"arrival_s": arrival}
    for column in _TOKEN_COLUMNS:
        num = _integers(_numbers(df, column, where, required=True), column, where)
        if (i := _first(num <= 0)) is not None:
            raise where.error(f"must be > 0 (got {int(num.iloc[i])})", i, column)
        cols[column] = num
    for column in _SLO_COLUMNS:
        if column in df.columns:
            num = _numbers(df, column, where, required=False)
            if (i := _first(num <= 0)) is not None:
                raise where.error(f"must be > 0 when given (got {_show(num.iloc[i])})", i, column)
            cols[column] = num
    if "priority" in df.columns:
        num = _integers(_numbers(df, "priority", where, required=False), "priority", where)
        cols["priority"] = num.fillna(DEFAULTS["priority"])
    if "tenant" in df.columns:
        tenant = df["tenant"].astype("object")
        cols["tenant"] = tenant.where(tenant.notna() & (tenant != ""), DEFAULTS["tenant"])
    if "prefix_hash_ids" in df.columns:
        cols["prefix_hash_ids"] = _hash_ids(df["prefix_hash_ids"], where)

    out = pd.DataFrame(index=range(len(df)))
    for column, dtype in COLUMNS.items():
        values = cols.get(column)
        if values is None:
            out[column] = pd.Series([DEFAULTS[column]] * len(df), dtype=dtype)
        elif dtype == "object":
            out[column] = pd.Series(values, dtype="object")
        else:
            out[column] = pd.Series(np.asarray(values), dtype=dtype)
    if "capped" in df.columns:
        # read back from a CSV as bools, or as strings when some cells are empty
        out["capped"] = [str(v).strip().lower() in ("true", "1") for v in df["capped"]]
    out.attrs = dict(df.attrs)
    out.attrs.setdefault("name", "trace")
    out.attrs.setdefault("source", src)
    out.attrs["hash_block_tokens"] = int(
        out.attrs.get("hash_block_tokens", DEFAULT_HASH_BLOCK_TOKENS)
    )
    out.attrs["notes"] = list(out.attrs.get("notes", []))
    return out
