"""Synthetic traces: arrival processes, length distributions, tenant mixes, shared prefixes.

Everything is drawn from numpy Generators seeded by the caller, so a seed fixes
the whole trace. :func:`synthetic_trace` with its defaults is the project's
embedded default trace: small enough for a quick CPU run of a tiny model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.schema import DEFAULT_HASH_BLOCK_TOKENS, make_trace
from traces.validate import validate

#: A length sampler: (count, rng) -> int64 array of lengths.
Sampler = Callable[[int, np.random.Generator], np.ndarray]

DEFAULT_PROMPT: dict[str, Any] = {"dist": "lognormal", "mean": 256, "cv": 1.0, "max": 1024}
DEFAULT_OUTPUT: dict[str, Any] = {"dist": "lognormal", "mean": 128, "cv": 1.0, "max": 512}
#: An interactive tenant with SLOs and a batch tenant without, half the traffic each.
DEFAULT_TENANTS: tuple[dict[str, Any], ...] = (
    {"name": "interactive", "weight": 0.5, "priority": 0, "ttft_slo_s": 2.0, "tpot_slo_s": 0.2},
    {"name": "batch", "weight": 0.5, "priority": 1},
)
_TENANT_KEYS = {"name", "weight", "priority", "ttft_slo_s", "tpot_slo_s", "rate_scale"}
_TENANT_KEYS |= {"prompt", "output"}  # per-tenant length specs override the trace's


def arrivals(
    n: int,
    rate: float,
    process: str = "poisson",
    cv: float = 1.0,
    rng: np.random.Generator | int | None = None,
) -> np.ndarray:
    """``n`` arrival times in seconds, the first at 0.0, at a mean of ``rate`` req/s.

    ``process="poisson"`` draws exponential gaps; ``"gamma"`` draws Gamma gaps
    with coefficient of variation ``cv`` (cv=1 is Poisson, cv>1 bursty, cv=0
    evenly spaced).
    """
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    rng = np.random.default_rng(rng)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    elif process == "gamma":
        if cv < 0:
            raise ValueError(f"cv must be >= 0, got {cv}")
        if cv == 0:
            gaps = np.full(max(n - 1, 0), 1.0 / rate)
        else:
            shape = 1.0 / cv**2  # Gamma(k, theta) has CV 1/sqrt(k) and mean k*theta
            gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    else:
        raise ValueError(f"unknown arrival process {process!r}: use 'poisson' or 'gamma'")
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def fixed(value: int) -> Sampler:
    """Always ``value`` tokens."""
    return lambda n, rng: np.full(n, int(value), dtype="int64")


def uniform(lo: int, hi: int) -> Sampler:
    """Whole numbers uniform in [lo, hi], both ends included."""
    if not 0 < lo <= hi:
        raise ValueError(f"uniform lengths need 0 < lo <= hi, got lo={lo}, hi={hi}")
    return lambda n, rng: rng.integers(lo, hi, size=n, endpoint=True).astype("int64")


def lognormal(mean: float, sigma: float | None = None, cv: float | None = None) -> Sampler:
    """Log-normal lengths with the given mean (of the lengths, not of their log).

    Give the spread as ``sigma`` (of the log) or as ``cv`` (of the lengths:
    sigma^2 = ln(1 + cv^2)). Rounded to whole tokens, at least 1.
    """
    if (sigma is None) == (cv is None):
        raise ValueError("lognormal lengths need exactly one of sigma and cv")
    if not mean > 0:
        raise ValueError(f"lognormal mean must be > 0, got {mean}")
    s = float(sigma) if sigma is not None else math.sqrt(math.log1p(float(cv) ** 2))
    mu = math.log(mean) - s * s / 2  # so that E[X] = exp(mu + s^2/2) = mean
    return lambda n, rng: np.maximum(np.rint(rng.lognormal(mu, s, size=n)), 1).astype("int64")


def zipf(a: float, max: int) -> Sampler:
    """Zipf lengths on 1..max: P(k) proportional to k^-a (any a > 0; bounded, so no tail cut)."""
    if not a > 0 or max < 1:
        raise ValueError(f"zipf needs a > 0 and max >= 1, got a={a}, max={max}")
    p = np.arange(1, int(max) + 1, dtype="float64") ** -float(a)
    p /= p.sum()
    return lambda n, rng: rng.choice(len(p), size=n, p=p).astype("int64") + 1


def resample(path: str | Path, column: str) -> Sampler:
    """Lengths drawn with replacement from ``column`` of a CSV file (e.g. a Sarathi length file)."""
    values = pd.read_csv(path, usecols=[column])[column].to_numpy("int64")
    if len(values) == 0 or values.min() <= 0:
        raise ValueError(f"{path}: column {column!r} must hold lengths > 0")
    return lambda n, rng: rng.choice(values, size=n)


def length_sampler(spec: Mapping[str, Any]) -> Sampler:
    """A sampler from a spec dict such as ``{"dist": "lognormal", "mean": 512, "cv": 1.0}``.

    ``dist`` is one of fixed (value), uniform (lo, hi), lognormal (mean and
    sigma or cv), zipf (a, max) or file (path, column). Every spec may add
    ``min`` and ``max`` to clip the lengths (min defaults to 1).
    """
    spec = dict(spec)
    dist = spec.pop("dist", None)
    lo = spec.pop("min", 1)
    # For zipf "max" is the distribution's own bound; for the others it only clips.
    hi = spec.get("max") if dist == "zipf" else spec.pop("max", None)
    makers: dict[str, Callable[..., Sampler]] = {
        "fixed": fixed,
        "uniform": uniform,
        "lognormal": lognormal,
        "zipf": zipf,
        "file": resample,
    }
    if dist not in makers:
        raise ValueError(
            f"length spec {spec}: 'dist' must be one of {sorted(makers)}, got {dist!r}"
        )
    try:
        base = makers[dist](**spec)
    except TypeError as e:  # unknown or missing keys
        raise ValueError(f"bad {dist!r} length spec {spec}: {e}") from None
    return lambda n, rng: np.clip(base(n, rng), lo, hi).astype("int64")


def _check_keys(what: str, given: Mapping[str, Any], allowed: set[str]) -> None:
    if unknown := set(given) - allowed:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _prefix_ids(
    prompt: np.ndarray, which: np.ndarray, num_prefixes: int, shared_blocks: int, block_tokens: int
) -> list[tuple[int, ...]]:
    """Hash ids for every prompt block: shared ids for a shared prefix, fresh ids for the rest.

    One id per ``block_tokens`` of prompt, the last possibly partial (the
    Mooncake convention). ``which[i]`` is request i's shared prefix or -1.
    """
    next_id = num_prefixes * shared_blocks  # ids below are the shared prefixes' blocks
    out = []
    for n_tokens, w in zip(prompt.tolist(), which.tolist()):
        n_blocks = -(-n_tokens // block_tokens)
        shared = list(range(w * shared_blocks, (w + 1) * shared_blocks)) if w >= 0 else []
        fresh = list(range(next_id, next_id + n_blocks - len(shared)))
        next_id += len(fresh)
        out.append(tuple(shared + fresh))
    return out


def _shared_prefix(
    prompt: np.ndarray, spec: Mapping[str, Any], block_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, list[tuple[int, ...]], str]:
    """Put one of N shared prefixes in front of a fraction of the prompts.

    Returns the longer prompt lengths, every request's hash ids and a note.
    """
    _check_keys("shared_prefix", spec, {"num_prefixes", "tokens", "fraction"})
    num, tokens = int(spec["num_prefixes"]), int(spec["tokens"])
    if tokens < block_tokens or num < 1:
        raise ValueError(
            f"shared_prefix {dict(spec)}: need num_prefixes >= 1 and tokens >= "
            f"hash_block_tokens ({block_tokens}), or no whole block could be shared"
        )
    has = rng.random(len(prompt)) < float(spec.get("fraction", 1.0))
    which = np.where(has, rng.integers(num, size=len(prompt)), -1)
    prompt = prompt + np.where(has, tokens, 0)
    blocks = tokens // block_tokens  # a partial last prefix block mixes in unique tokens
    ids = _prefix_ids(prompt, which, num, blocks, block_tokens)
    return (
        prompt,
        ids,
        f"{int(has.sum())} prompts start with one of {num} shared {tokens}-token prefixes",
    )


def synthetic_trace(
    num_requests: int = 200,
    rate: float = 2.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    prompt: Mapping[str, Any] | None = None,
    output: Mapping[str, Any] | None = None,
    tenants: Sequence[Mapping[str, Any]] | None = None,
    seed: int = 0,
    shared_prefix: Mapping[str, Any] | None = None,
    hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS,
    name: str = "synthetic",
) -> pd.DataFrame:
    """A synthetic trace, fully determined by its arguments and ``seed``.

    Arrivals follow ``arrival`` ("poisson" or "gamma" with ``cv``) at ``rate``
    req/s. ``prompt``/``output`` are length specs (see :func:`length_sampler`;
    default: log-normal, mean 256 capped at 1024, and mean 128 capped at 512).
    ``tenants`` is a list of dicts with ``name``, ``weight``, and optionally
    ``priority``, ``ttft_slo_s``, ``tpot_slo_s``, ``rate_scale`` and their own
    ``prompt``/``output`` specs; each request draws its tenant with probability
    proportional to weight x rate_scale, so ``rate_scale`` multiplies one
    tenant's rate (and the total rate grows accordingly). None gives two tenants,
    "interactive" (priority 0, with SLOs) and "batch" (priority 1, none); pass
    ``[{"name": "default"}]`` for one. ``shared_prefix`` = ``{"num_prefixes": N,
    "tokens": T, "fraction": f}`` puts one of N shared T-token system prompts in
    front of a fraction f of the prompts (their length grows by T) and gives
    every request ``prefix_hash_ids`` of ``hash_block_tokens``-token blocks.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    tenants = [dict(t) for t in (DEFAULT_TENANTS if tenants is None else tenants)]
    if not tenants:
        raise ValueError("tenants must list at least one tenant (or be None for the default two)")
    for t in tenants:
        _check_keys(f"tenant {t.get('name')!r}", t, _TENANT_KEYS)
    share = np.array([t.get("weight", 1.0) * t.get("rate_scale", 1.0) for t in tenants], float)
    weights = np.array([t.get("weight", 1.0) for t in tenants], float)
    if (share < 0).any() or share.sum() <= 0:
        raise ValueError(f"tenant weights x rate_scales must be >= 0 with a positive sum: {share}")
    total_rate = rate * share.sum() / weights.sum()

    # Independent streams, so that changing e.g. the output spec leaves the arrivals alone.
    r_arrival, r_tenant, r_prompt, r_output, r_prefix = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)
    )
    n = num_requests
    arrival_s = arrivals(n, total_rate, arrival, cv, r_arrival)
    who = r_tenant.choice(len(tenants), size=n, p=share / share.sum())
    prompt_len = np.zeros(n, dtype="int64")
    output_len = np.zeros(n, dtype="int64")
    for k, t in enumerate(tenants):
        mine, count = who == k, int((who == k).sum())
        prompt_len[mine] = length_sampler(t.get("prompt", prompt or DEFAULT_PROMPT))(
            count, r_prompt
        )
        output_len[mine] = length_sampler(t.get("output", output or DEFAULT_OUTPUT))(
            count, r_output
        )

    notes = [f"{n} requests, {arrival} arrivals at {total_rate:g} req/s (cv {cv:g}), seed {seed}"]
    hash_ids = None
    if shared_prefix is not None:
        prompt_len, hash_ids, note = _shared_prefix(
            prompt_len, shared_prefix, hash_block_tokens, r_prefix
        )
        notes.append(note)

    df = make_trace(
        arrival_s,
        prompt_len,
        output_len,
        tenant=[tenants[k].get("name", f"tenant{k}") for k in who],
        priority=[tenants[k].get("priority", 0) for k in who],
        ttft_slo_s=[tenants[k].get("ttft_slo_s", math.nan) for k in who],
        tpot_slo_s=[tenants[k].get("tpot_slo_s", math.nan) for k in who],
        prefix_hash_ids=hash_ids,
        name=name,
        source="synthetic",
        hash_block_tokens=hash_block_tokens,
        notes=notes,
    )
    return validate(df, "synthetic")
