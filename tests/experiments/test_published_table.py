"""experiments/published/measurements.yaml: every point names its source, its
configuration and workload in the project's names, and what it measured."""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path

import pytest
import yaml

import experiments.published

TABLE = Path(experiments.published.__file__).with_name("measurements.yaml")

ENGINES = {"vllm", "sglang"}
# conf/hardware names and the memory of each card, in GB
GPUS = {
    "h100": 80,
    "h100-pcie": 80,
    "h200": 141,
    "a100": 80,
    "a100-40gb": 40,
    "l40s": 48,
    "rtx4090": 24,
}
MODELS = {
    "llama3-8b",
    "llama2-7b",
    "llama3-70b",
    "llama2-70b",
    "qwen2.5-72b",
    "qwen2.5-7b",
    "mistral-7b",
    "codellama-34b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "qwen3-0.6b",
}
PRECISIONS = {"bf16", "fp16"}
KINDS = {"single_request", "concurrency", "offline_batch", "request_rate"}
DATASETS = {None, "sharegpt", "random", "sonnet", "synthetic_fixed"}
WORKLOAD_FIELDS = {
    "kind",
    "prompt_tokens",
    "output_tokens",
    "dataset",
    "max_concurrency",
    "num_requests",
    "request_rate",
    "max_num_seqs",
    "max_num_batched_tokens",
}
# figures that are one number for the whole run, and per-request latencies that need a statistic
AGGREGATES = {
    "output_throughput_tok_s",
    "request_throughput_req_s",
    "total_throughput_tok_s",
    "duration_s",
}
LATENCIES = {"tpot_ms", "itl_ms", "ttft_ms", "e2e_s"}
STATISTICS = {"mean", "median", "p90", "p99", "fit", "approx", "unspecified"}
ORIGINS = {"printed", "plot", "fit", "derived"}
FIELDS = {
    "id",
    "source",
    "engine",
    "engine_version",
    "gpu",
    "gpu_memory_gb",
    "num_gpus",
    "model",
    "precision",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "workload",
    "measured",
    "statistic",
    "value_origin",
    "assumptions",
    "notes",
}
KEBAB = re.compile(r"^[a-z0-9]+(?:[.-][a-z0-9]+)*$")
VERSION = re.compile(r"^\d+\.\d+(?:\.\d+)?(?:\.post\d+)?$")


def _points() -> list[dict]:
    table = yaml.safe_load(TABLE.read_text())
    assert set(table) == {"points"}, f"{TABLE}: the top level holds only 'points'"
    return table["points"]


POINTS = _points()


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def test_the_table_holds_enough_points_with_unique_kebab_case_ids():
    ids = [point.get("id") for point in POINTS]
    assert len(ids) >= 12
    assert len(set(ids)) == len(ids), "ids repeat"
    for point_id in ids:
        assert isinstance(point_id, str) and KEBAB.match(point_id), point_id


@pytest.mark.parametrize("point", POINTS, ids=[p.get("id", "?") for p in POINTS])
def test_a_point_has_every_field_with_a_known_value(point):
    assert set(point) == FIELDS, f"missing {FIELDS - set(point)}, unknown {set(point) - FIELDS}"
    source = point["source"]
    assert set(source) == {"url", "title", "date", "figure"}
    assert source["url"].startswith("https://") and " " not in source["url"]
    assert source["title"] and source["figure"]
    assert source["date"] is None or isinstance(source["date"], datetime.date)
    assert point["engine"] in ENGINES
    version = point["engine_version"]
    assert version is None or (isinstance(version, str) and VERSION.match(version)), version
    assert point["gpu"] in GPUS
    assert point["gpu_memory_gb"] == GPUS[point["gpu"]]
    assert point["model"] in MODELS
    assert point["precision"] in PRECISIONS
    tp, pp, gpus = (
        point["tensor_parallel_size"],
        point["pipeline_parallel_size"],
        point["num_gpus"],
    )
    assert all(_positive_int(n) for n in (tp, pp, gpus)) and tp * pp == gpus
    assert point["value_origin"] in ORIGINS
    assert isinstance(point["notes"], str) and point["notes"].strip()
    assert isinstance(point["assumptions"], str)


@pytest.mark.parametrize("point", POINTS, ids=[p.get("id", "?") for p in POINTS])
def test_a_workload_is_specified_or_its_gaps_are_assumed(point):
    workload = point["workload"]
    assert set(workload) == WORKLOAD_FIELDS
    kind = workload["kind"]
    assert kind in KINDS
    assert workload["dataset"] in DATASETS
    for field in ("prompt_tokens", "output_tokens", "num_requests", "max_concurrency"):
        assert workload[field] is None or _positive_int(workload[field]), field
    for field in ("max_num_seqs", "max_num_batched_tokens"):
        assert workload[field] is None or _positive_int(workload[field]), field
    if workload["prompt_tokens"] is None or workload["output_tokens"] is None:
        assert workload["dataset"] is not None, "lengths come from a fixed value or a dataset"
    rate = workload["request_rate"]
    if kind == "request_rate":
        assert _positive_number(rate) or rate == math.inf, "a rate, or .inf for all at once"
    else:
        assert rate is None
    if kind == "single_request":
        assert workload["max_concurrency"] == 1
    if kind == "concurrency":
        assert _positive_int(workload["max_concurrency"])
    gaps = [field for field, value in workload.items() if value is None]
    if gaps or point["engine_version"] is None:
        assert point["assumptions"].strip(), f"{point['id']}: {gaps} left open without assumption"


@pytest.mark.parametrize("point", POINTS, ids=[p.get("id", "?") for p in POINTS])
def test_a_measurement_is_positive_and_says_its_statistic(point):
    measured, statistic = point["measured"], point["statistic"]
    assert measured, "a point measures something"
    assert set(measured) <= AGGREGATES | LATENCIES, set(measured) - AGGREGATES - LATENCIES
    for figure, value in measured.items():
        assert _positive_number(value), f"{figure}={value!r}"
    assert isinstance(statistic, dict)
    assert set(statistic) == set(measured) & LATENCIES, "a statistic for each latency only"
    assert set(statistic.values()) <= STATISTICS
    if point["value_origin"] == "fit":
        assert "fit" in statistic.values()


def test_the_check_refuses_a_point_with_a_bad_field():
    """The checks above can fail: a copy of a point with one field wrong is refused."""
    bad = {**POINTS[0], "gpu": "h800"}
    with pytest.raises(AssertionError):
        test_a_point_has_every_field_with_a_known_value(bad)
    gap = {**POINTS[0], "assumptions": " ", "workload": {**POINTS[0]["workload"]}}
    gap["workload"]["max_num_seqs"] = None
    with pytest.raises(AssertionError):
        test_a_workload_is_specified_or_its_gaps_are_assumed(gap)
    unlabelled = {**POINTS[0], "measured": {"tpot_ms": 5.0}, "statistic": {}}
    with pytest.raises(AssertionError):
        test_a_measurement_is_positive_and_says_its_statistic(unlabelled)
