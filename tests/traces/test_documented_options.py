"""Every trace option docs/traces.md documents works as written (``trace.<option>=``,
no ``+``) on every trace config in conf/trace/: it composes, validates and reaches
the loader. The options are read from the page, so a newly documented one is
tested here (it needs a value in :data:`VALUES`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
import re

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import testbed.build
from testbed.build import run_trace
from testbed.config_schema import TraceOptions, compose_config, validate
from testbed.errors import InputError
from testbed.models import PROJECT_ROOT
from tests.traces.conftest import SHARED_FILES, shared_path
from traces import GENERIC_OPTIONS, loader_options
from traces.export import export_csv
from traces.synthetic import synthetic_trace

DOC = (PROJECT_ROOT / "docs" / "traces.md").read_text()
CONFIGS = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "trace").glob("*.yaml"))
LOADER_HEADING = "### Each loader's own options"

# option -> (its value on the command line, what the loader gets)
_LENGTHS = {"dist": "lognormal", "mean": 50, "cv": 1.0, "min": 4, "max": 200}
VALUES = {
    "window_start_s": ("1.5", 1.5),
    "window_end_s": ("900", 900.0),
    "num_requests": ("7", 7),
    "sample": ("5", 5),
    "rate": ("3.5", 3.5),
    "time_scale": ("2", 2.0),
    "prompt_scale": ("0.5", 0.5),
    "max_model_len": ("2048", 2048),
    "num_tenants": ("3", 3),
    "priority_classes": ("2", 2),
    "seed": ("11", 11),
    "ttft_slo_s": ("2.5", 2.5),
    "tpot_slo_s": ("0.25", 0.25),
    "arrival": ("gamma", "gamma"),
    "cv": ("2", 2.0),
    "prompt": ("{dist:lognormal,mean:50,cv:1.0,min:4,max:200}", _LENGTHS),
    "output": ("{dist:lognormal,mean:50,cv:1.0,min:4,max:200}", _LENGTHS),
    "tenants": ("[{name:a,weight:1}]", [{"name": "a", "weight": 1}]),
    "shared_prefix": (
        "{num_prefixes:2,tokens:64,fraction:0.5}",
        {"num_prefixes": 2, "tokens": 64, "fraction": 0.5},
    ),
    "hash_block_tokens": ("16", 16),
    "spread": ("uniform", "uniform"),
    "duration_s": ("30", 30.0),
    "start_s": ("600", 600.0),
    "rate_scale": ("0.5", 0.5),
    "max_clients": ("2", 2),
    "lengths_from": ("arxiv", "arxiv"),
    "path": ("mine.csv", "mine.csv"),
    "max_concurrency": ("4", 4),
    "prompt_tokens": ("300", 300),
    "output_tokens": ("20", 20),
}


def _section(start: str, end: str) -> str:
    begin = DOC.index(start)
    return DOC[begin : DOC.index(end, begin)]


def documented_generic_options() -> list[str]:
    """The ``trace.<option>`` names of the page's "Options" section, before the
    loaders' own: the options every trace takes."""
    section = _section("## Options", LOADER_HEADING)
    return list(dict.fromkeys(re.findall(r"`trace\.(\w+)`", section)))


def documented_loader_options() -> dict[str, list[str]]:
    """Trace config -> the options the page's loader table gives it (its first
    column's names and patterns, such as ``servegen_*``, matched against conf/trace)."""
    out: dict[str, list[str]] = {}
    after = DOC[DOC.index(LOADER_HEADING) :].splitlines()
    rows = itertools.dropwhile(lambda line: not line.startswith("|"), after)
    table = list(itertools.takewhile(lambda line: line.startswith("|"), rows))
    for row in table[2:]:  # below the header and its rule
        cells = [c.strip() for c in row.strip("|").split("|")]
        options = re.findall(r"`(\w+)`", cells[1])
        for pattern in re.findall(r"`([\w*-]+)`", cells[0]):
            matched = fnmatch.filter(CONFIGS, pattern)
            assert matched, f"docs/traces.md: {pattern!r} names no trace config in conf/trace"
            for config in matched:
                out.setdefault(config, []).extend(options)
    return out


GENERIC = documented_generic_options()
OWN = documented_loader_options()


@functools.cache
def _trace_name(config: str) -> str:
    """The trace a config loads (``burst`` is ``synthetic``'s)."""
    return compose_config([f"trace={config}"]).trace.name


def test_the_page_lists_the_options_every_trace_takes_and_each_loaders():
    assert GENERIC, "docs/traces.md: no `trace.<option>` found in its Options section"
    assert set(GENERIC) == set(GENERIC_OPTIONS), "docs/traces.md's list against traces"
    assert set(CONFIGS) <= set(OWN), f"no row in the loader table for {set(CONFIGS) - set(OWN)}"
    for config, options in OWN.items():
        name = _trace_name(config)
        own = set(loader_options(name)) - set(GENERIC_OPTIONS)
        assert set(options) == own, f"docs/traces.md, trace={config}: documents {options}"


def test_the_schema_declares_every_generic_option_unset_but_seed():
    fields = {f.name: f.default for f in dataclasses.fields(TraceOptions)}
    assert set(fields) - {"name"} == set(GENERIC_OPTIONS)
    assert all(v is None for k, v in fields.items() if k not in ("name", "seed"))


def _overrides(config: str, options: list[str]) -> list[str]:
    missing = [o for o in options if o not in VALUES]
    assert not missing, f"documented trace options without a test value in VALUES: {missing}"
    return [f"trace={config}", *(f"trace.{o}={VALUES[o][0]}" for o in options)]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_documented_option_composes_validates_and_reaches_the_loader(config, monkeypatch):
    """Each option as written on the command line, no ``+``, for this trace config;
    the loader is stood in for, so no trace data is needed."""
    options = [*GENERIC, *OWN.get(config, [])]
    cfg = compose_config(_overrides(config, options))
    validate(cfg)
    got = {}

    def fake_load_trace(name, **kwargs):
        got.update(kwargs, name=name)
        return synthetic_trace(num_requests=1)

    monkeypatch.setattr(testbed.build, "load_trace", fake_load_trace)
    run_trace(cfg)
    assert got["name"] == cfg.trace.name
    for option in options:
        assert got.get(option) == VALUES[option][1], f"trace={config} trace.{option}"


def _compose_loadable(config: str, tmp_path, *overrides: str):
    """``config`` composed to load here (a csv file, a short ServeGen interval), or
    a skip naming the shared data it needs."""
    name, extra = _trace_name(config), []
    if name == "csv":
        path = export_csv(synthetic_trace(num_requests=20), tmp_path / "t.csv")
        extra.append(f"trace.path={path}")
    if name.startswith("servegen_"):
        extra.append("trace.duration_s=60")  # m-mid alone runs at ~1,000 req/s
    cfg = compose_config([f"trace={config}", *extra, *overrides])
    for needs in (name, cfg.trace.get("lengths_from")):
        if needs in SHARED_FILES:
            shared_path(SHARED_FILES[needs])
    return cfg


# ServeGen's traces read hundreds of client files each: seconds per load.
SLOW = {c: pytest.mark.slow for c in CONFIGS if c.startswith("servegen_")}


@pytest.mark.parametrize("config", [pytest.param(c, marks=SLOW.get(c, ())) for c in CONFIGS])
@pytest.mark.parametrize(("option", "size"), [("num_requests", 7), ("sample", 5)])
def test_the_built_trace_honours_num_requests_and_sample(config, option, size, tmp_path):
    cfg = _compose_loadable(config, tmp_path, f"trace.{option}={size}")
    validate(cfg)
    assert OmegaConf.select(cfg, f"trace.{option}") == size
    assert len(run_trace(cfg)) == size


def test_a_trace_options_typo_or_wrong_type_fails_at_start_up_naming_it():
    with pytest.raises(ConfigCompositionException, match=r"trace\.num_requests"):
        compose_config(["trace=azure_conv", "trace.num_requests=many"])
    with pytest.raises(ConfigCompositionException, match=r"trace\.spreed"):
        compose_config(["trace=mooncake_conv", "trace.spreed=uniform"])
    added = compose_config(["trace=mooncake_conv", "+trace.spreed=uniform"])  # + gets it in
    with pytest.raises(InputError, match=r"^trace\.spreed: no such option of trace=mooncake_conv"):
        validate(added)
