"""Sampling: greedy, temperature, top-k, top-p, seeded per request.

Random rows are sampled with the Gumbel-max trick, ``argmax(logits / T + g)``
with ``g = -log(-log(u))``: the same distribution as drawing from the softmax,
but vectorized over the batch after top-k and top-p have masked what they cut.
Each request draws its noise ``u`` from its own generator, one vector per
token, so its tokens do not depend on which requests share its batches.
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

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The request's own random generator (seeded by ``params.seed``, else by
        the engine's seed and its id)."""
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
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if not rows:
            return out.tolist()
        dev = logits.device
        scaled = process_logits(logits[rows], [params[i] for i in rows])
        vocab = logits.shape[-1]
        u = torch.stack(
            [
                torch.rand(vocab, generator=self.generator(request_ids[i], params[i]), device=dev)
                for i in rows
            ]
        )
        out[rows] = (scaled + gumbel(u)).argmax(dim=-1)
        return out.tolist()

    def draw(self, weights: torch.Tensor, generator: torch.Generator) -> int:
        """One index drawn with probability proportional to ``weights`` (>= 0, 1-D)."""
        u = torch.rand(weights.shape[-1], generator=generator, device=weights.device)
        return int((torch.log(weights) + gumbel(u)).argmax())


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from uniforms ``u``: argmax(logits + it) draws from softmax(logits)."""
    return -torch.log(-torch.log(u.clamp_(min=1e-20)))


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's logits over its temperature (> 0), with what its top-k and top-p
    cut set to -inf: the distribution a sampled token is drawn from, as logits."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits / temps[:, None]
    scaled = _top_k(scaled, [p.top_k for p in params])
    return _top_p(scaled, [p.top_p for p in params])


def _top_k(scaled: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in ks]
    if not any(ks):
        return scaled
    kmax = max(ks)
    top = torch.topk(scaled, kmax, dim=-1).values
    idx = torch.tensor([max(k, 1) - 1 for k in ks], device=scaled.device)
    kth = top.gather(1, idx[:, None])
    kth[torch.tensor([k == 0 for k in ks], device=scaled.device)] = float("-inf")
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_p(scaled: torch.Tensor, ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in ps):
        return scaled
    top_p = torch.tensor(ps, device=scaled.device)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # Keep the smallest set whose mass reaches top_p (the top token always).
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))
