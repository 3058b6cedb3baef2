"""ServeGen per-client statistics turned into a request trace.

ServeGen (Alibaba Bailian) publishes no requests, only per-client statistics:
per 10-minute window a rate and a fitted inter-arrival distribution
(``chunk-<id>-trace.csv``), and per 6-hour window length distributions
(``chunk-<id>-dataset.json``). We generate each client's requests from them,
as ServeGen's own generator does, with numpy only.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.loaders import parse_csv, read_lengths, read_text
from traces.schema import TraceError, make_trace
from traces.validate import validate

WINDOW_S = 600.0  # arrival statistics: one row per 10 minutes
_WINDOW_COLUMNS = ["start_s", "rate", "cv", "family", "shape", "scale"]
_FAMILIES = {"", "Gamma", "Weibull"}


def _client_id(path: Path) -> str:
    """ "chunk-12" for chunk-12-trace.csv."""
    return path.name.removesuffix("-trace.csv")


def _client_number(path: Path) -> int:
    return int(_client_id(path).removeprefix("chunk-"))


def _read_windows(path: Path) -> pd.DataFrame:
    """A client's window table, checked: numbers are numbers, families known."""
    win = parse_csv(path, header=None, names=_WINDOW_COLUMNS, dtype={"family": "str"})
    for column in ("start_s", "rate", "shape", "scale"):
        num = pd.to_numeric(win[column], errors="coerce")
        if len(bad := np.flatnonzero((num.isna() | (num < 0)).to_numpy())):
            i = int(bad[0])
            msg = f"not a number >= 0 ({win[column].iloc[i]!r})"
            raise TraceError(str(path), msg, row=i + 1, line=i + 1, field=column)
        win[column] = num.astype("float64")
    win["family"] = win["family"].fillna("").astype("str")
    if len(bad := np.flatnonzero(~win["family"].isin(_FAMILIES).to_numpy())):
        i = int(bad[0])
        msg = f"unknown distribution family {win['family'].iloc[i]!r} (Gamma, Weibull or empty)"
        raise TraceError(str(path), msg, row=i + 1, line=i + 1, field="family")
    return win


def _window_arrivals(row: Any, rate_scale: float, rng: np.random.Generator) -> np.ndarray:
    """One window's arrival times: its fitted gap distribution, rescaled to its rate.

    We draw round(rate x 600 s) arrivals (rounded at random, so the expected
    count is exact) and n+1 gaps from the fitted family, then rescale the gaps
    to fill the window: the window's mean rate matches, its burstiness stays.
    """
    expected = row.rate * rate_scale * WINDOW_S
    if not row.family or expected <= 0:
        return np.empty(0)
    n = int(expected) + int(rng.random() < expected % 1)
    if n == 0:
        return np.empty(0)
    if row.family == "Gamma":
        gaps = rng.gamma(row.shape, row.scale, size=n + 1)
    else:
        gaps = rng.weibull(row.shape, size=n + 1) * row.scale
    total = gaps.sum()
    gaps = gaps * (WINDOW_S / total) if total > 0 else np.full(n + 1, WINDOW_S / (n + 1))
    return row.start_s + np.cumsum(gaps)[:-1]


def _distribution(data: dict, path: Path, window: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) of one field in one 6-hour window of a dataset json."""
    try:
        table = ast.literal_eval(data[window][field])  # a dict literal: never eval()
        if not isinstance(table, dict):
            raise TypeError(f"a {type(table).__name__}, not a dict of value: probability")
        values = np.array(list(table), dtype="int64")
        p = np.array(list(table.values()), dtype="float64")
    except (KeyError, TypeError, ValueError, SyntaxError) as e:
        msg = f"window {window}: no readable distribution ({e!r})"
        raise TraceError(str(path), msg, field=field) from None
    if not table:
        raise TraceError(str(path), f"window {window}: empty distribution", field=field)
    return values, p / p.sum()  # the published probabilities sum to 1 only up to rounding


def _read_dataset(path: Path) -> dict[str, dict]:
    """A client's dataset json: an object of 6-hour windows (keyed by their start in
    seconds), each an object of distributions; anything else names the file."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        msg = f"not valid JSON ({e.msg}, column {e.colno})"
        raise TraceError(str(path), msg, line=e.lineno) from None
    if not isinstance(data, dict) or not data:
        raise TraceError(str(path), "not a JSON object of windows ({start_s: {...}, ...})")
    for key, window in data.items():
        try:
            float(key)
        except ValueError:
            raise TraceError(str(path), f"window {key!r} is not a number (its start, s)") from None
        if not isinstance(window, dict):
            raise TraceError(str(path), f"window {key!r} is not a JSON object of distributions")
    return data


def _dataset_lengths(
    path: Path, times: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths for arrivals at ``times``, from the client's dataset json."""
    data = _read_dataset(path)
    keys = sorted(data, key=float)
    window = np.searchsorted([float(k) for k in keys], times, side="right") - 1
    fields = set(data[keys[0]])
    prompt = np.zeros(len(times), dtype="int64")
    output = np.zeros(len(times), dtype="int64")

    def draw(w: int, field: str, n: int) -> np.ndarray:
        values, p = _distribution(data, path, keys[w], field)
        return rng.choice(values, size=n, p=p)

    for w in np.unique(window):  # only windows with requests: the others may be empty
        mine = window == w
        n = int(mine.sum())
        if "input_tokens" in fields:  # language and reasoning models
            prompt[mine] = draw(w, "input_tokens", n)
        elif "text_tokens" in fields:  # multimodal: text plus image tokens
            images = draw(w, "image_count", n) * draw(w, "image_tokens", n)
            prompt[mine] = draw(w, "text_tokens", n) + images
        else:
            raise TraceError(
                str(path), f"no input_tokens or text_tokens (fields: {sorted(fields)})"
            )
        output[mine] = draw(w, "output_tokens", n)
    return prompt, output


def load_servegen(
    folder: str | Path,
    duration_s: float = 600.0,
    start_s: float = 0.0,
    seed: int = 0,
    max_clients: int | None = None,
    rate_scale: float = 1.0,
    lengths_from: str | Path | None = None,
) -> pd.DataFrame:
    """Requests for ``[start_s, start_s + duration_s)`` of a ServeGen model folder.

    Each client (``tenant`` = its id, e.g. "chunk-12") gets arrivals from its
    10-minute windows (rates times ``rate_scale``) and lengths from its 6-hour
    dataset distributions, or, when ``lengths_from`` names a Sarathi length
    file, rows resampled from that file (the only option for the
    ``language/*`` folders, which ship arrival statistics only).
    ``max_clients`` keeps the clients with the most expected requests in the
    interval. Arrival times are relative to ``start_s``. Each client has its own
    random stream (from ``seed`` and its id), so dropping clients leaves the
    others' requests unchanged.
    """
    folder = Path(folder)
    paths = sorted(folder.glob("chunk-*-trace.csv"), key=_client_number)
    if not paths:
        raise FileNotFoundError(f"no ServeGen chunk-<id>-trace.csv files in {folder}")
    if duration_s <= 0 or start_s < 0 or rate_scale < 0 or (max_clients or 1) < 1:
        raise ValueError("need duration_s > 0, start_s >= 0, rate_scale >= 0, max_clients >= 1")
    end_s = start_s + duration_s
    clients = []
    for path in paths:
        win = _read_windows(path)
        covered = win["start_s"].max() + WINDOW_S
        if end_s > covered:
            raise ValueError(f"{path}: covers [0, {covered:g}) s, asked for up to {end_s:g} s")
        sel = win[(win["start_s"] < end_s) & (win["start_s"] + WINDOW_S > start_s)]
        overlap = np.minimum(sel["start_s"] + WINDOW_S, end_s) - np.maximum(sel["start_s"], start_s)
        clients.append((path, sel, float((sel["rate"] * overlap).sum())))
    if max_clients is not None:
        busiest = sorted(range(len(clients)), key=lambda k: -clients[k][2])[:max_clients]
        clients = [clients[k] for k in sorted(busiest)]

    lengths = None
    missing = [
        p for p, _, _ in clients if not p.with_name(f"{_client_id(p)}-dataset.json").exists()
    ]
    if lengths_from is None and missing:
        raise ValueError(
            f"{folder} has arrival statistics only (no {_client_id(missing[0])}-dataset.json): "
            "pass lengths_from=<a length file such as a Sarathi sharegpt csv> for the lengths"
        )
    if lengths_from is not None:
        lengths = read_lengths(lengths_from)
    parts = []
    for path, sel, _ in clients:
        cid = _client_id(path)
        rng = np.random.default_rng([seed, _client_number(path)])
        windows = [_window_arrivals(w, rate_scale, rng) for w in sel.itertuples(index=False)]
        t = np.concatenate([np.empty(0), *windows])
        t = t[(t >= start_s) & (t < end_s)]
        if lengths is not None:
            rows = rng.integers(len(lengths), size=len(t))
            prompt = lengths["prompt_tokens"].to_numpy()[rows]
            output = lengths["output_tokens"].to_numpy()[rows]
        else:
            prompt, output = _dataset_lengths(path.with_name(f"{cid}-dataset.json"), t, rng)
        parts.append(pd.DataFrame({"t": t, "p": prompt, "o": output, "tenant": cid}))
    merged = pd.concat(parts, ignore_index=True).sort_values(
        "t", kind="stable"
    )  # ties: client order
    df = make_trace(
        merged["t"].to_numpy() - start_s,
        merged["p"].to_numpy(),
        merged["o"].to_numpy(),
        tenant=merged["tenant"].tolist(),
        name=f"servegen_{folder.name}",
        source=str(folder),
        notes=[
            f"ServeGen {folder.name}: {len(clients)} clients, [{start_s:g}, {end_s:g}) s "
            f"re-zeroed to start_s, rate_scale {rate_scale:g}, seed {seed}"
            + (f", lengths from {lengths_from}" if lengths_from is not None else "")
        ],
    )
    return validate(df, folder)
