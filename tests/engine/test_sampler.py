"""The sampler draws from the distribution that temperature, top-k and top-p define."""

from __future__ import annotations

import torch

from testbed.core import SamplingParams
from testbed.engine.sampler import Sampler


def draw(params: SamplingParams, logits: torch.Tensor, n: int = 4000) -> torch.Tensor:
    s = Sampler(torch.device("cpu"))
    counts = torch.zeros(logits.shape[-1])
    for i in range(n):
        tok = s.sample(logits[None], [f"r{i}"], [params])[0]
        counts[tok] += 1
    return counts / n


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_temperature_sampling_matches_the_softmax():
    freq = draw(SamplingParams(temperature=0.7), LOGITS)
    expected = torch.softmax(LOGITS / 0.7, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_and_top_p_cut_the_tail():
    assert (draw(SamplingParams(temperature=1.0, top_k=2), LOGITS)[2:] == 0).all()
    probs = torch.softmax(LOGITS, dim=-1)  # 0.61, 0.22, 0.14, ...: top_p=0.7 keeps two
    freq = draw(SamplingParams(temperature=1.0, top_p=0.7), LOGITS)
    assert (freq[2:] == 0).all() and abs(freq[0] - probs[0] / probs[:2].sum()) < 0.03


def test_greedy_rows_and_random_rows_in_one_batch():
    s = Sampler(torch.device("cpu"))
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    toks = s.sample(
        logits, ["a", "b"], [SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=3)]
    )
    assert toks[0] == 0
    again = Sampler(torch.device("cpu")).sample(
        logits[1:], ["b"], [SamplingParams(temperature=0.5, seed=3)]
    )
    assert toks[1] == again[0]  # seeded per request, whatever shares the batch
