"""The trace schema: one row per request, sorted by arrival.

Every loader, generator and transform in :mod:`traces` returns a DataFrame with
exactly the columns of :data:`COLUMNS` (plus ``capped`` after
:func:`traces.transforms.cap_lengths` capped something) and ``df.attrs``
holding ``name``, ``source``, ``hash_block_tokens`` and ``notes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

#: Column name -> dtype. ``str`` is pandas' string dtype (``object`` before pandas 3).
COLUMNS: dict[str, str] = {
    "arrival_s": "float64",
    "prompt_tokens": "int64",
    "output_tokens": "int64",
    "tenant": "str",
    "priority": "int64",
    "ttft_slo_s": "float64",
    "tpot_slo_s": "float64",
    "prefix_hash_ids": "object",  # a tuple of ints per row, or None
}
REQUIRED: tuple[str, ...] = ("arrival_s", "prompt_tokens", "output_tokens")
#: Filled in where a source does not say.
DEFAULTS: dict[str, Any] = {
    "tenant": "default",
    "priority": 0,
    "ttft_slo_s": math.nan,
    "tpot_slo_s": math.nan,
    "prefix_hash_ids": None,
}
#: Tokens per prefix hash id when a source does not say (the Mooncake block size).
DEFAULT_HASH_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A bad value in a trace file, named by file, row and field.

    ``row`` is the 1-based *data* row (the first request is row 1; headers and
    comment lines are not counted) and ``line`` the 1-based line of the file
    where that row sits, so that an editor's "go to line" finds it.
    ``row="header"`` names the header; either may be None when unknown.
    """

    def __init__(
        self,
        source: str,
        message: str,
        *,
        row: int | str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.source, self.row, self.line, self.field = str(source), row, line, field
        where = [self.source]
        if row is not None:
            where.append(f"{'' if row == 'header' else 'row '}{row}")
            if line not in (None, row):
                where[-1] += f" (line {line})"
        elif line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(", ".join(where) + ": " + message)


def _column(values: Any, n: int, default: Any) -> Any:
    """``values`` as a column of length n, or n copies of ``default`` when None."""
    return [default] * n if values is None else values


def make_trace(
    arrival_s: Sequence[float] | np.ndarray,
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    tenant: Sequence[str] | np.ndarray | None = None,
    priority: Sequence[int] | np.ndarray | None = None,
    ttft_slo_s: Sequence[float] | np.ndarray | None = None,
    tpot_slo_s: Sequence[float] | np.ndarray | None = None,
    prefix_hash_ids: Sequence[tuple[int, ...] | None] | None = None,
    *,
    name: str,
    source: str,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    notes: Sequence[str] = (),
) -> pd.DataFrame:
    """Build a trace from columns, filling defaults for the optional ones.

    Values are converted to the schema's dtypes but not checked: loaders pass
    their result through :func:`traces.validate.validate`.
    """
    n = len(arrival_s)
    df = pd.DataFrame(
        {
            "arrival_s": np.asarray(arrival_s, dtype="float64"),
            "prompt_tokens": np.asarray(prompt_tokens, dtype="int64"),
            "output_tokens": np.asarray(output_tokens, dtype="int64"),
            "tenant": pd.Series(_column(tenant, n, DEFAULTS["tenant"]), dtype="str"),
            "priority": np.asarray(_column(priority, n, DEFAULTS["priority"]), dtype="int64"),
            "ttft_slo_s": np.asarray(_column(ttft_slo_s, n, math.nan), dtype="float64"),
            "tpot_slo_s": np.asarray(_column(tpot_slo_s, n, math.nan), dtype="float64"),
            "prefix_hash_ids": pd.Series(_column(prefix_hash_ids, n, None), dtype="object"),
        }
    )
    set_attrs(df, name=name, source=source, hash_block_tokens=hash_block_tokens, notes=notes)
    return df


def set_attrs(
    df: pd.DataFrame,
    *,
    name: str,
    source: str,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    notes: Sequence[str] = (),
) -> pd.DataFrame:
    """Set the trace's attrs in place (a fresh notes list) and return ``df``."""
    df.attrs.update(
        name=str(name),
        source=str(source),
        hash_block_tokens=int(hash_block_tokens),
        notes=list(notes),
    )
    return df


def empty_trace(name: str = "empty", source: str = "synthetic") -> pd.DataFrame:
    """A trace with no requests (the right columns and dtypes)."""
    return make_trace([], [], [], name=name, source=source)


def with_rows(df: pd.DataFrame, rows: pd.DataFrame, note: str | None = None) -> pd.DataFrame:
    """``rows`` (derived from ``df``) with df's attrs and ``note`` appended to the notes.

    The index is reset so that row i is always the i-th request.
    """
    out = rows.reset_index(drop=True)
    out.attrs = {**df.attrs, "notes": [*df.attrs.get("notes", []), *([note] if note else [])]}
    return out
