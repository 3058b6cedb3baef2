"""Request traces: loaders, synthetic generators, transforms, validation, export.

A trace is a pandas DataFrame, one row per request in arrival order (see
:mod:`traces.schema`). :func:`load_trace` is the one entry point the configs
use: ``load_trace("azure_conv", rate=4.0, max_model_len=4096)``.

Generic options, applied after loading, in this order (each only when given
and not None):

1. ``window_start_s`` / ``window_end_s``: :func:`~traces.transforms.window`
2. ``num_requests``: :func:`~traces.transforms.head`
3. ``sample``: an int n or a fraction in (0, 1): :func:`~traces.transforms.sample`
4. ``rate``: :func:`~traces.transforms.scale_to_rate` (req/s)
5. ``time_scale``: :func:`~traces.transforms.scale_time`
5b. ``prompt_scale``: :func:`~traces.transforms.scale_prompts`
6. ``max_model_len``: :func:`~traces.transforms.cap_lengths`
7. ``num_tenants`` / ``priority_classes`` (seeded by ``seed``):
   :func:`~traces.transforms.assign_tenants`, :func:`~traces.transforms.assign_priorities`
8. ``ttft_slo_s`` / ``tpot_slo_s``: :func:`~traces.transforms.assign_slos`

An option the loader itself takes goes to the loader instead (``num_requests``
and ``rate`` for ``synthetic`` and the length-file traces, which generate
their arrivals); ``seed`` goes to the loader when it takes one and also seeds
``sample``. ServeGen's ``lengths_from`` may name a length trace (``sharegpt``,
``arxiv``, ``bwb``) instead of a path, as may the closed loop's
(``concurrency``, :mod:`traces.closed_loop`), which refuses the options that
rescale or cut arrival times (it has none until it runs).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from traces import transforms
from traces.closed_loop import TIMED_OPTIONS, closed_loop_trace, max_concurrency
from traces.export import export_csv
from traces.loaders import load_azure, load_csv, load_lengths, load_mooncake
from traces.schema import COLUMNS, TraceError, empty_trace, make_trace
from traces.servegen import load_servegen
from traces.synthetic import synthetic_trace
from traces.validate import validate

__all__ = [
    "COLUMNS",
    "GENERIC_OPTIONS",
    "TRACE_NAMES",
    "TraceError",
    "closed_loop_trace",
    "empty_trace",
    "export_csv",
    "load_azure",
    "load_csv",
    "load_lengths",
    "load_mooncake",
    "load_servegen",
    "load_trace",
    "loader_options",
    "make_trace",
    "max_concurrency",
    "synthetic_trace",
    "trace_loader",
    "traces_dir",
    "validate",
]

ENV_VAR = "TESTBED_TRACES_DIR"

_SARATHI = "length_dists_sarathi/"
#: Config name -> (loader, file or folder under traces_dir(), or None when it needs none).
_TRACES: dict[str, tuple[Callable[..., pd.DataFrame], str | None]] = {
    "azure_code": (load_azure, "azure_llm_2023/AzureLLMInferenceTrace_code.csv"),
    "azure_conv": (load_azure, "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"),
    "mooncake_conv": (load_mooncake, "mooncake/conversation_trace.jsonl"),
    "mooncake_synthetic": (load_mooncake, "mooncake/synthetic_trace.jsonl"),
    "sharegpt": (load_lengths, _SARATHI + "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
    "arxiv": (
        load_lengths,
        _SARATHI + "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    ),
    "bwb": (load_lengths, _SARATHI + "bwb_stats_llama2_tokenizer_filtered_v2.csv"),
    "servegen_deepseek-r1": (load_servegen, "servegen/reason/deepseek-r1"),
    "servegen_mm-image": (load_servegen, "servegen/multimodal/mm-image"),
    "servegen_m-large": (load_servegen, "servegen/language/m-large"),
    "servegen_m-mid": (load_servegen, "servegen/language/m-mid"),
    "servegen_m-small": (load_servegen, "servegen/language/m-small"),
    "synthetic": (synthetic_trace, None),
    "csv": (load_csv, None),
    "concurrency": (closed_loop_trace, None),
}
TRACE_NAMES: tuple[str, ...] = tuple(_TRACES)
#: The options every trace takes (:func:`_apply`'s transforms, and ``seed``).
GENERIC_OPTIONS = ("window_start_s", "window_end_s", "num_requests", "sample", "rate")
GENERIC_OPTIONS += ("time_scale", "prompt_scale", "max_model_len", "num_tenants")
GENERIC_OPTIONS += ("priority_classes", "seed", "ttft_slo_s", "tpot_slo_s")


def trace_loader(name: str) -> Callable[..., pd.DataFrame]:
    """The function that loads (or generates) trace ``name``."""
    if name not in _TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_NAMES)}")
    return _TRACES[name][0]


def loader_options(name: str) -> dict[str, inspect.Parameter]:
    """The options trace ``name``'s loader takes itself (:func:`load_trace` passes
    them on): its parameters less the file it reads, which ``csv`` alone takes as
    ``path``, and the trace's ``name``, which is the config's."""
    loader = trace_loader(name)
    params = dict(inspect.signature(loader).parameters)
    drop = {"folder", "name"} | ({"path"} if _TRACES[name][1] else set())
    return {k: p for k, p in params.items() if k not in drop}


def traces_dir() -> Path:
    """Where the shared trace files are: $TESTBED_TRACES_DIR, else ../shared/traces
    next to the project root."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces"


def trace_path(relative: str) -> Path:
    """A file or folder under :func:`traces_dir`, or a FileNotFoundError that says where
    it looked and how to point elsewhere."""
    root = traces_dir()
    path = root / relative
    if not path.exists():
        raise FileNotFoundError(
            f"trace data {relative!r} not found: looked in {root} "
            f"(set the {ENV_VAR} environment variable to the folder holding the shared traces)"
        )
    return path


def load_trace(name: str, **options: Any) -> pd.DataFrame:
    """Load the trace a config names (see :data:`TRACE_NAMES`), then apply the generic options.

    ``csv`` needs ``path``. Options the loader does not take and that are not
    generic are an error; options set to None count as not given.
    """
    loader, relative = trace_loader(name), _TRACES[name][1]
    options = {k: v for k, v in options.items() if v is not None}
    params = set(loader_options(name))
    if name == "csv" and "path" not in options:
        raise ValueError("trace 'csv' needs a path option: load_trace('csv', path=...)")
    if unknown := sorted(set(options) - params - set(GENERIC_OPTIONS)):
        raise ValueError(
            f"trace {name!r}: unknown options {unknown}; the loader takes {sorted(params)} "
            f"and every trace takes {list(GENERIC_OPTIONS)}"
        )
    own = {k: v for k, v in options.items() if k in params}
    if own.get("lengths_from") in _TRACES and _TRACES[own["lengths_from"]][0] is load_lengths:
        own["lengths_from"] = trace_path(_TRACES[own["lengths_from"]][1])  # e.g. "sharegpt"
    generic = {k: v for k, v in options.items() if k not in params or k == "seed"}
    df = loader(trace_path(relative), **own) if relative else loader(**own)
    df.attrs["name"] = name
    if (clients := max_concurrency(df)) is not None and (
        timed := [k for k in TIMED_OPTIONS if k in generic]
    ):
        raise ValueError(
            f"trace {name!r} is a closed loop ({clients} clients, each sending its next "
            f"request when its last ends): it has no arrival times for {timed} to rescale or cut"
        )
    return _apply(df, generic)


def _apply(df: pd.DataFrame, o: dict[str, Any]) -> pd.DataFrame:
    """The generic transforms, in the documented order."""
    if "window_start_s" in o or "window_end_s" in o:
        df = transforms.window(df, o.get("window_start_s", 0.0), o.get("window_end_s"))
    if "num_requests" in o:
        df = transforms.head(df, int(o["num_requests"]))
    if "sample" in o:
        s = o["sample"]
        size = {"frac": s} if isinstance(s, float) and 0 < s < 1 else {"n": int(s)}
        df = transforms.sample(df, seed=int(o.get("seed", 0)), **size)
    if "rate" in o:
        df = transforms.scale_to_rate(df, float(o["rate"]))
    if "time_scale" in o:
        df = transforms.scale_time(df, float(o["time_scale"]))
    if "prompt_scale" in o:
        df = transforms.scale_prompts(df, float(o["prompt_scale"]))
    if "max_model_len" in o:
        df = transforms.cap_lengths(df, int(o["max_model_len"]))
    if "num_tenants" in o:
        df = transforms.assign_tenants(df, int(o["num_tenants"]), seed=int(o.get("seed", 0)))
    if "priority_classes" in o:
        classes = int(o["priority_classes"])
        df = transforms.assign_priorities(df, classes, seed=int(o.get("seed", 0)))
    if "ttft_slo_s" in o or "tpot_slo_s" in o:
        df = transforms.assign_slos(df, o.get("ttft_slo_s"), o.get("tpot_slo_s"))
    return df
