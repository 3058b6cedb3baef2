"""The router comparison's trace bound: an LRU cache over the prompts' blocks."""

from __future__ import annotations

import math

from experiments.router_comparison import lru_hit_rate
from testbed.core import Request, SamplingParams


def prompt(rid: str, tokens: list[int], t: float) -> Request:
    return Request(rid, prompt_token_ids=tokens, sampling_params=SamplingParams(), arrival_time=t)


def test_lru_hit_rate_counts_leading_blocks_and_evicts_the_least_recent():
    a = list(range(1, 9))  # two blocks of 4, then one more token
    shared = prompt("a", [*a, 99], 0.0)
    other = prompt("b", [50, 51, 52, 53, 54, 55, 56, 57, 58], 1.0)
    again = prompt("c", [*a, 77], 2.0)  # hits a's two blocks if they are still cached
    reqs = [shared, other, again]
    total = 27
    assert lru_hit_rate(reqs, 4, math.inf) == 8 / total
    assert lru_hit_rate(reqs, 4, 4) == 8 / total  # room for both prompts' blocks
    assert lru_hit_rate(reqs, 4, 2) == 0.0  # b's blocks evicted a's
    # A prompt never hits its own last token: c equal to a hits one block, not two.
    assert lru_hit_rate([prompt("x", a, 0), prompt("y", a, 1)], 4, math.inf) == 4 / 16
