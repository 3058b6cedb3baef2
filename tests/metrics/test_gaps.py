"""Pooled inter-token gaps: the statistics of the whole sample, folded or not."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from testbed.metrics.gaps import PooledGaps


def token_times(rng: np.random.Generator, steps: np.ndarray) -> list[array]:
    """Requests that take their tokens at the ends of runs of shared steps (as a
    batch does), some with several tokens in one step (gap 0, speculative)."""
    out = []
    for _ in range(200):
        start = int(rng.integers(0, len(steps) - 2))
        n = int(rng.integers(1, min(60, len(steps) - start)))
        times = steps[start : start + n]
        if rng.random() < 0.2:
            times = np.repeat(times, rng.integers(1, 3, size=n))
        out.append(array("d", times))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spill_at", [4, 1000, 1 << 22])
def test_the_pool_gives_numpys_statistics_of_every_gap(seed, spill_at):
    rng = np.random.default_rng(seed)
    steps = np.cumsum(rng.choice([0.01, 0.0125, 0.02, 0.03], size=300))
    requests = token_times(rng, steps)
    pool = PooledGaps(spill_at=spill_at)
    for times in requests:
        pool.add(times)
    sample = np.concatenate([np.diff(np.asarray(t)) for t in requests])
    assert len(pool) == sample.size
    qs = [50, 90, 99, 0, 100, 33.3]
    assert pool.percentiles(qs) == np.percentile(sample, qs).tolist()  # exactly
    stats = pool.stats("itl_s")
    assert stats["itl_s_mean"] == pytest.approx(sample.mean(), rel=1e-12)
    expected = np.percentile(sample, [50, 90, 99]).tolist()
    assert [stats[f"itl_s_p{q}"] for q in (50, 90, 99)] == expected


def test_gaps_beyond_memory_go_to_a_file_that_goes_with_the_pool():
    import gc

    pool = PooledGaps(spill_at=10)
    for _ in range(5):
        pool.add(array("d", np.cumsum(np.full(12, 0.5))))
    assert pool._spilled == 55 and len(pool) == 55 and pool._file.exists()
    assert pool.percentiles([0, 50, 100]) == [0.5, 0.5, 0.5]
    folder = pool._file.parent
    del pool
    gc.collect()
    assert not folder.exists()


def test_no_gaps_no_numbers():
    pool = PooledGaps.of([array("d", [1.0]), array("d")])
    assert len(pool) == 0
    assert all(np.isnan(v) for v in pool.stats().values())


@pytest.mark.parametrize("seed", range(10))
def test_selection_over_the_file_is_exact_across_magnitudes(seed):
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.lognormal(-4, 2.5, size=5000))  # gaps from microseconds to minutes
    pool = PooledGaps(spill_at=100)
    for chunk in np.array_split(times, 37):
        pool.add(array("d", chunk))
    sample = np.concatenate([np.diff(c) for c in np.array_split(times, 37)])
    qs = sorted(rng.uniform(0, 100, size=30).tolist()) + [50, 99.9]
    assert pool.percentiles(qs) == np.percentile(sample, qs).tolist()
