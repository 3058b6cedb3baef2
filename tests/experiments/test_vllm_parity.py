"""Schedule parity with vLLM V1: our scheduler against vLLM 0.34's own, step by step.

The comparison runs where the replay tool and its venv exist
(``../shared/tools/vllm_replay``; ``experiments/vllm_parity/reference.py`` says
how to build the venv) and is skipped, saying so, where they do not.
"""

from __future__ import annotations

import pytest

from experiments.vllm_parity import reference
from experiments.vllm_parity.cli import main, run_pair
from experiments.vllm_parity.compare import compare, read_steps
from experiments.vllm_parity.ours import run_ours
from experiments.vllm_parity.reference import Settings
from experiments.vllm_parity.streams import StreamSpec, write_stream


def needs_tool():
    if not (reference.tool_dir() / "vllm_steps.py").is_file():
        pytest.skip(reference.missing())


def needs_vllm():
    why = reference.missing()
    if why:
        pytest.skip(why)


SMALL = StreamSpec(n=120, rate=3.0, prompt=(20, 400), output=(4, 60), seed=3)

CASES = {
    # FCFS, chunked prefill, prefix caching, full-prompt reservation (vLLM's defaults)
    "fcfs": (SMALL, Settings()),
    "first-chunk-admission": (SMALL, Settings(reserve_full_isl=False)),
    "threshold-tight-cache": (
        SMALL,
        Settings(num_gpu_blocks=48, long_prefill_token_threshold=48),
    ),
    "shared-prefixes-preempting": (
        StreamSpec(n=200, rate=5.0, share_frac=0.9, num_prefixes=2, seed=4),
        Settings(num_gpu_blocks=96, reserve_full_isl=False, block_size=8),
    ),
    "no-chunked-prefill": (
        SMALL,
        Settings(enable_chunked_prefill=False, max_num_batched_tokens=512, num_gpu_blocks=64),
    ),
    "no-prefix-caching": (SMALL, Settings(enable_prefix_caching=False, num_gpu_blocks=40)),
    "priority": (
        StreamSpec(n=150, rate=4.0, priority_classes=3, seed=5),
        Settings(policy="priority", num_gpu_blocks=48, long_prefill_token_threshold=64),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_is_the_one_vllm_schedules(case, tmp_path):
    needs_vllm()
    spec, settings = CASES[case]
    stream = write_stream(spec, tmp_path / "stream.csv")
    result, ours, theirs = run_pair(stream, settings, tmp_path)
    assert result.same, result.summary()
    assert result.identical == result.steps_vllm > 0 and ours.unfinished == 0
    if case in ("threshold-tight-cache", "shared-prefixes-preempting", "priority"):
        preempting = [r for r in read_steps(theirs.steps_csv).values() if r["preempted"]]
        assert preempting, "the case was meant to preempt"


def test_the_comparison_finds_the_first_step_that_differs(tmp_path):
    """Our scheduler against itself with the reservation switched: the two part
    where a prompt first fits by its chunk but not whole, and the report names it."""
    needs_tool()
    stream = write_stream(SMALL, tmp_path / "stream.csv")
    a = run_ours(stream, Settings(num_gpu_blocks=48), tmp_path / "a")
    b = run_ours(stream, Settings(num_gpu_blocks=48, reserve_full_isl=False), tmp_path / "b")
    assert compare(a.steps_csv, a.steps_csv).same
    result = compare(a.steps_csv, b.steps_csv)
    assert not result.same and result.identical < result.steps_vllm
    assert "admitted" in result.first_fields or "scheduled" in result.first_fields
    first = result.first_divergence
    assert result.rows[0] is not None and result.rows[1] is not None
    assert f"first divergence at step {first}" in result.summary()


def test_a_cache_too_small_for_the_longest_request_is_refused(tmp_path):
    """vLLM does not start when max_model_len exceeds its KV cache; replayed, it
    would wait on such a request forever while ours rejects it: no comparison."""
    needs_tool()
    stream = write_stream(SMALL, tmp_path / "stream.csv")
    with pytest.raises(ValueError, match="does not fit 19 usable blocks of 16 tokens"):
        run_ours(stream, Settings(num_gpu_blocks=20), tmp_path)


def test_the_command_line_prints_the_comparison_and_writes_its_record(tmp_path, capsys):
    needs_vllm()
    out = tmp_path / "out"
    assert main(["--n", "40", "--out", str(out), "--num-gpu-blocks", "64"]) == 0
    printed = capsys.readouterr().out
    assert "every step identical" in printed and "ms" in printed
    for name in ("stream.csv", "ours_steps.csv", "vllm_steps.csv", "parity.json", "manifest.json"):
        assert (out / name).is_file(), name
