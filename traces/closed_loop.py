"""Closed-loop workloads: a fixed number of clients, each sending its next
request when its last one ends (``vllm bench serve --max-concurrency C
--request-rate inf``, the form most published serving numbers take).

A closed-loop trace is an ordinary trace whose rows are its requests in the
order they are sent, marked by ``attrs["max_concurrency"]`` (C, the number of
clients). Its ``arrival_s`` column is 0 throughout: the first C rows are sent
at 0, and when each later row is sent (as a client frees) only a run can tell
(:class:`testbed.workload.ClosedLoop`), which stamps it as the request's arrival.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.loaders import read_lengths
from traces.schema import make_trace
from traces.synthetic import length_sampler
from traces.validate import validate

#: The trace's attrs key that marks it closed-loop: the number of clients.
MAX_CONCURRENCY = "max_concurrency"
DEFAULT_PROMPT_TOKENS = 512
DEFAULT_OUTPUT_TOKENS = 128
#: Generic options that rescale or cut arrival times, which a closed loop does not have.
TIMED_OPTIONS = ("rate", "time_scale", "window_start_s", "window_end_s")


def max_concurrency(trace: pd.DataFrame) -> int | None:
    """The clients of a closed-loop trace; None for a trace of arrival times."""
    value = trace.attrs.get(MAX_CONCURRENCY)
    return None if value is None else int(value)


def closed_loop_trace(
    max_concurrency: int,
    num_requests: int = 100,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    prompt: Mapping[str, Any] | None = None,
    output: Mapping[str, Any] | None = None,
    lengths_from: str | Path | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """``num_requests`` requests sent by ``max_concurrency`` clients in a closed loop.

    Lengths come from one of: ``prompt_tokens``/``output_tokens`` (fixed; 512
    and 128 where nothing else is given), ``prompt``/``output`` (length specs
    of :func:`traces.synthetic.length_sampler`, drawn with ``seed``), or
    ``lengths_from`` (a Sarathi/Vidur length file, or through
    :func:`traces.load_trace` a length trace's name such as ``sharegpt``: its
    first ``num_requests`` rows' prompt and output lengths, in file order).
    ``max_concurrency`` >= ``num_requests`` sends every request at once (offline).
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (clients), got {max_concurrency}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    n = int(num_requests)
    notes = [
        f"closed loop: {n} requests from {max_concurrency} clients, each sending its next "
        "when its last ends (arrival_s 0: a run stamps each request's send time)"
    ]
    if lengths_from is not None:
        given = [k for k, v in _length_options(prompt_tokens, output_tokens, prompt, output) if v]
        if given:
            raise ValueError(f"lengths_from={lengths_from} gives the lengths: drop {given}")
        prompt_len, output_len, note = _lengths_from(Path(lengths_from), n)
        notes.append(note)
    else:
        r_prompt, r_output = (
            np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)
        )
        prompt_len = _side("prompt", prompt_tokens, prompt, DEFAULT_PROMPT_TOKENS)(n, r_prompt)
        output_len = _side("output", output_tokens, output, DEFAULT_OUTPUT_TOKENS)(n, r_output)
    df = make_trace(
        np.zeros(n), prompt_len, output_len, name="concurrency", source="closed loop", notes=notes
    )
    df = validate(df, "concurrency")
    df.attrs[MAX_CONCURRENCY] = int(max_concurrency)
    return df


def _length_options(prompt_tokens, output_tokens, prompt, output) -> list[tuple[str, bool]]:
    return [
        ("prompt_tokens", prompt_tokens is not None),
        ("output_tokens", output_tokens is not None),
        ("prompt", prompt is not None),
        ("output", output is not None),
    ]


def _side(side: str, tokens: int | None, spec: Mapping[str, Any] | None, default: int):
    """One side's sampler: a fixed length or a length spec, not both."""
    if tokens is not None and spec is not None:
        raise ValueError(
            f"{side}_tokens={tokens} and {side}={dict(spec)}: give one "
            f"(a fixed length, or a length distribution)"
        )
    if spec is not None:
        return length_sampler(spec)
    value = default if tokens is None else int(tokens)
    if value < 1:
        raise ValueError(f"{side}_tokens must be >= 1, got {value}")
    return length_sampler({"dist": "fixed", "value": value})


def _lengths_from(path: Path, n: int) -> tuple[np.ndarray, np.ndarray, str]:
    """The first ``n`` rows' lengths of a length file, in its order."""
    rows = read_lengths(path)
    if n > len(rows):
        raise ValueError(f"lengths_from={path} has {len(rows)} rows; num_requests={n} is more")
    head = rows.iloc[:n]
    note = f"lengths of the first {n} of {len(rows)} rows of {path.name}, in order"
    return head["prompt_tokens"].to_numpy(), head["output_tokens"].to_numpy(), note
