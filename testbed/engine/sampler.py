"""Sampling: greedy, temperature, top-k, top-p, seeded per request.

A request with a seed draws from its own generator, so its tokens do not depend
on which other requests share its batches.
"""

from __future__ import annotations

import zlib

import torch

from testbed.core import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            seed = params.seed
            if seed is None:  # stable across processes, unlike hash() of a string
                seed = zlib.crc32(f"{self.seed}:{request_id}".encode())
            gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
            self.generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """One token per row of ``logits`` (float32 ``[n, vocab]``)."""
        greedy = logits.argmax(dim=-1)
        if all(p.temperature == 0 for p in params):
            return greedy.tolist()
        out = greedy.tolist()
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.temperature == 0:
                continue
            row = logits[i] / p.temperature
            if 0 < p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                # Keep the smallest set whose mass reaches top_p (the top token always).
                drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
                probs = probs.scatter(0, idx[drop], 0.0)
                probs = probs / probs.sum()
            out[i] = int(torch.multinomial(probs, 1, generator=self._generator(rid, p)))
        return out
