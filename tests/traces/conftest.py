"""Shared helpers: the real trace files, skipped with a clear message where absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from traces import traces_dir

#: The shared file or folder each trace name reads (for skip messages and fakes).
SHARED_FILES = {
    "azure_code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "azure_conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake_conv": "mooncake/conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake/synthetic_trace.jsonl",
    "sharegpt": "length_dists_sarathi/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "length_dists_sarathi/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "bwb": "length_dists_sarathi/bwb_stats_llama2_tokenizer_filtered_v2.csv",
    "servegen_deepseek-r1": "servegen/reason/deepseek-r1",
    "servegen_mm-image": "servegen/multimodal/mm-image",
    "servegen_m-large": "servegen/language/m-large",
    "servegen_m-mid": "servegen/language/m-mid",
    "servegen_m-small": "servegen/language/m-small",
}


def shared_path(relative: str) -> Path:
    """A path under traces_dir(), or skip the test saying which path is missing."""
    path = traces_dir() / relative
    if not path.exists():
        pytest.skip(f"shared trace data not found: {path} (set TESTBED_TRACES_DIR to its folder)")
    return path


@pytest.fixture
def shared() -> object:
    """``shared("azure_llm_2023/...")``: the path, or a skip naming it."""
    return shared_path
