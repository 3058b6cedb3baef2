"""Transforms of a trace: rate and time scaling, windows, heads, samples, length
caps, and seeded tenants and priority classes for traces that have none.

Each returns a new trace (the input is left alone) with the attrs carried
over and one line appended to ``attrs["notes"]`` saying what was done. Random
transforms take a seed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traces.schema import DEFAULTS, with_rows


def mean_rate(df: pd.DataFrame) -> float:
    """Requests per second: one over the mean inter-arrival gap, (n - 1) / span."""
    t = df["arrival_s"].to_numpy()
    if len(t) < 2 or t[-1] <= t[0]:
        raise ValueError(f"trace {df.attrs.get('name')!r}: a rate needs two distinct arrivals")
    return (len(t) - 1) / float(t[-1] - t[0])


def _scaled(df: pd.DataFrame, factor: float, note: str) -> pd.DataFrame:
    out = with_rows(df, df.copy(), note)
    out["arrival_s"] = df["arrival_s"].to_numpy() * factor
    return out


def scale_prompts(df: pd.DataFrame, factor: float) -> pd.DataFrame:
    """Multiply prompt lengths by ``factor`` (for a model with a shorter context),
    keeping which requests share which prefix blocks: the tokens per hash id
    scale too, so ``factor * hash_block_tokens`` must be a whole number."""
    if not 0 < factor <= 1:
        raise ValueError(f"prompt scale must be in (0, 1], got {factor}")
    block = df.attrs.get("hash_block_tokens", 512) * factor
    if df["prefix_hash_ids"].notna().any() and block != int(block):
        raise ValueError(f"prompt scale {factor:g} makes hash blocks of {block:g} tokens: "
                         "choose a factor that keeps them whole")  # fmt: skip
    out = with_rows(df, df.copy(), f"scaled prompt lengths by {factor:g}")
    out["prompt_tokens"] = np.maximum(1, np.ceil(df["prompt_tokens"] * factor)).astype("int64")
    out.attrs["hash_block_tokens"] = int(block)
    return out


def scale_time(df: pd.DataFrame, factor: float) -> pd.DataFrame:
    """Multiply every arrival time by ``factor`` (> 1 slows the trace down)."""
    if not factor > 0:
        raise ValueError(f"time scale factor must be > 0, got {factor}")
    return _scaled(df, factor, f"scaled arrival times by {factor:g}")


def scale_to_rate(df: pd.DataFrame, rate: float) -> pd.DataFrame:
    """Rescale arrival times so that the mean rate (see :func:`mean_rate`) is ``rate`` req/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    before = mean_rate(df)
    return _scaled(df, before / rate, f"rescaled arrivals from {before:.4g} to {rate:g} req/s")


def window(df: pd.DataFrame, start_s: float = 0.0, end_s: float | None = None) -> pd.DataFrame:
    """Requests arriving in [start_s, end_s), re-zeroed so that start_s becomes 0.0.

    Times are shifted by start_s, not by the first arrival, so an idle stretch
    at the start of the window is kept.
    """
    t = df["arrival_s"]
    keep = (t >= start_s) & (t < (end_s if end_s is not None else np.inf))
    out = with_rows(
        df,
        df[keep],
        f"window [{start_s:g}, {'end' if end_s is None else f'{end_s:g}'}) s: "
        f"kept {int(keep.sum())} of {len(df)} requests, re-zeroed",
    )
    out["arrival_s"] = out["arrival_s"] - start_s
    return out


def head(df: pd.DataFrame, n: int) -> pd.DataFrame:
    """The first ``n`` requests."""
    if n < 0:
        raise ValueError(f"head needs n >= 0, got {n}")
    return with_rows(df, df.iloc[:n], f"kept the first {min(n, len(df))} of {len(df)} requests")


def sample(
    df: pd.DataFrame, n: int | None = None, frac: float | None = None, seed: int = 0
) -> pd.DataFrame:
    """A random subset of ``n`` requests (or a fraction ``frac``), in arrival order.

    Arrival times are kept, so sampling thins the trace: its rate drops by the
    same fraction.
    """
    if (n is None) == (frac is None):
        raise ValueError("sample needs exactly one of n and frac")
    k = round(frac * len(df)) if frac is not None else int(n)
    if not 0 <= k <= len(df):
        raise ValueError(f"cannot sample {k} of {len(df)} requests without replacement")
    rows = np.sort(np.random.default_rng(seed).choice(len(df), size=k, replace=False))
    return with_rows(df, df.iloc[rows], f"sampled {k} of {len(df)} requests, seed {seed}")


def cap_lengths(df: pd.DataFrame, max_model_len: int) -> pd.DataFrame:
    """Cap prompts at max_model_len - 1 and prompt + output at max_model_len.

    A request longer than the model's context would be rejected by the engine;
    capping keeps it, shortened, and says so: the note counts the capped
    requests and a boolean ``capped`` column marks them (only if any were).
    Prefix hash ids past the capped prompt are dropped.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    prompt = np.minimum(df["prompt_tokens"].to_numpy(), max_model_len - 1)
    output = np.minimum(df["output_tokens"].to_numpy(), max_model_len - prompt)
    prompt_capped = prompt < df["prompt_tokens"].to_numpy()
    output_capped = output < df["output_tokens"].to_numpy()
    capped = prompt_capped | output_capped
    note = (
        f"capped {int(capped.sum())} requests at max_model_len={max_model_len} "
        f"({int(prompt_capped.sum())} prompts, {int(output_capped.sum())} outputs)"
    )
    out = with_rows(df, df.copy(), note)
    if not capped.any():
        return out
    out["prompt_tokens"] = prompt
    out["output_tokens"] = output
    block = int(df.attrs.get("hash_block_tokens", 512))
    out["prefix_hash_ids"] = [
        ids if ids is None else ids[: -(-int(p) // block)]
        for ids, p in zip(df["prefix_hash_ids"], prompt)
    ]
    out["capped"] = capped | (df["capped"].to_numpy() if "capped" in df.columns else False)
    return out


def _assigned(df: pd.DataFrame, column: str, values, note: str) -> pd.DataFrame:
    """``df`` with ``column`` replaced by ``values``; the note says whether the
    trace had values of its own (anything but the schema's default)."""
    default = DEFAULTS[column]
    own = df[column].notna() if pd.isna(default) else df[column] != default
    if own.any():
        note += " (replacing the trace's own)"
    out = with_rows(df, df.copy(), note)  # index 0..n-1, as ``values``
    out[column] = values
    return out


def assign_tenants(df: pd.DataFrame, num_tenants: int, seed: int = 0) -> pd.DataFrame:
    """Give each request one of ``num_tenants`` tenants (``t0``, ``t1``, ...), drawn
    with Zipf weights 1/(k+1): ``t0`` sends the most, as a heavy tenant does, so a
    fairness policy (vtc) has someone to hold back. For traces with no tenants
    (Azure, Mooncake); a trace's own tenants are replaced, and the note says so."""
    if not num_tenants >= 1:
        raise ValueError(f"tenants must be >= 1, got {num_tenants}")
    weights = 1.0 / np.arange(1, num_tenants + 1)
    picks = np.random.default_rng(seed).choice(num_tenants, len(df), p=weights / weights.sum())
    names = pd.Series([f"t{k}" for k in picks], dtype="str")
    note = f"assigned {num_tenants} Zipf-weighted tenants, seed {seed}"
    return _assigned(df, "tenant", names, note)


def assign_slos(
    df: pd.DataFrame, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> pd.DataFrame:
    """Give every request the TTFT and TPOT SLOs given (seconds; None leaves that
    column as it is): for goodput and SLO attainment on traces that carry none."""
    for name, value in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
        if value is not None and not float(value) > 0:
            raise ValueError(f"{name}={value}: must be > 0")
    out = df
    for column, value in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
        if value is not None:
            out = _assigned(out, column, np.full(len(out), float(value)), f"{column} {value:g} s")
    return out


def assign_priorities(df: pd.DataFrame, num_classes: int, seed: int = 0) -> pd.DataFrame:
    """Give each request a priority class in ``0 .. num_classes - 1`` (0 is the
    most urgent), uniformly at random, seeded; a trace's own are replaced."""
    if not num_classes >= 1:
        raise ValueError(f"priority classes must be >= 1, got {num_classes}")
    rng = np.random.default_rng(seed + 1)  # independent of the tenants' draw
    classes = rng.integers(0, num_classes, len(df)).astype("int64")
    note = f"assigned {num_classes} uniform priority classes, seed {seed}"
    return _assigned(df, "priority", classes, note)
