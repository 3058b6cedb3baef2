"""A callable's median wall time: the one timing loop the kernel benchmarks share.
Standard library only, so that a benchmark's side run in vLLM's own environment
(``attention_vs_vllm.py --side vllm``) can import it too."""

from __future__ import annotations

import statistics
import time


def median_s(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
