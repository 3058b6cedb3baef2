"""Writing a trace in our own CSV format, the one :func:`traces.loaders.load_csv` reads."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from traces.schema import COLUMNS, DEFAULT_HASH_BLOCK_TOKENS


def _one_line(text: object) -> str:
    return " ".join(str(text).splitlines())  # a comment must stay on its line


def export_csv(df: pd.DataFrame, path: str | Path) -> Path:
    """Write ``df`` to ``path`` so that ``load_csv(path)`` gives back an identical trace.

    The file starts with ``# name:``, ``# source:``, ``# hash_block_tokens:`` and
    one ``# note:`` line per note, then a header and one row per request. Floats
    are written with repr precision (shortest exact form), NaN SLOs as empty
    cells, ``prefix_hash_ids`` as space-separated ints (empty for None).
    Returns the path.
    """
    path = Path(path)
    attrs = df.attrs
    lines = [
        f"# name: {_one_line(attrs.get('name', path.stem))}",
        f"# source: {_one_line(attrs.get('source', 'unknown'))}",
        f"# hash_block_tokens: {int(attrs.get('hash_block_tokens', DEFAULT_HASH_BLOCK_TOKENS))}",
        *(f"# note: {_one_line(note)}" for note in attrs.get("notes", [])),
    ]
    columns = [*COLUMNS, *(["capped"] if "capped" in df.columns else [])]
    out = df[columns].copy()
    out["prefix_hash_ids"] = [
        "" if ids is None else " ".join(map(str, ids)) for ids in df["prefix_hash_ids"]
    ]
    for column in ("arrival_s", "ttft_slo_s", "tpot_slo_s"):
        out[column] = [repr(float(x)) if x == x else "" for x in df[column]]  # x != x: NaN
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(lines) + "\n")
        out.to_csv(f, index=False, lineterminator="\n")
    return path
