"""The rejection sampler: verifies a request's drafts against the target model.

Given the target's logits at the request's last token and at each of its ``m``
drafts (``m + 1`` rows), it accepts a prefix of the drafts and adds one token:

* greedy (temperature 0): a draft is accepted while it equals the target's
  argmax; the first that does not is replaced by the argmax, and when all are
  accepted the argmax after the last is the bonus token. The output is the
  target's greedy output, token for token.
* sampled (Leviathan et al. 2023; Chen et al. 2023): draft ``d`` drawn from
  ``q`` is accepted with probability ``min(1, p(d) / q(d))``, ``p`` the target's
  distribution after temperature, top-k and top-p; at the first rejection the
  token is drawn from the residual ``max(0, p - q)`` normalised, and after all
  accepted the bonus from ``p``. The output follows ``p`` exactly. A proposer
  without a distribution (n-gram lookup) is a point mass: accept with ``p(d)``,
  the residual is ``p`` without ``d`` (as vLLM does).

The random draws come from the request's own generator (the sampler's), so a
request's tokens do not depend on its batch.
"""

from __future__ import annotations

import torch

from testbed.core import SamplingParams
from testbed.engine.sampler import Sampler, process_logits


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(
        self,
        logits: torch.Tensor,
        drafts: list[int],
        request_id: str,
        params: SamplingParams,
        draft_probs: torch.Tensor | None = None,
    ) -> list[int]:
        """The accepted drafts and one more token. ``logits``: float32
        ``[len(drafts) + 1, vocab]``; ``draft_probs``: ``[len(drafts), vocab]``, the
        proposer's distributions (after the same processing), or None."""
        m = len(drafts)
        if params.temperature == 0:
            best = logits.argmax(dim=-1).tolist()
            out = []
            for j in range(m):
                if drafts[j] != best[j]:
                    break
                out.append(drafts[j])
            out.append(best[len(out)])
            return out
        gen = self.sampler.generator(request_id, params)
        p = torch.softmax(process_logits(logits, [params] * (m + 1)), dim=-1)
        u = torch.rand(m, generator=gen, device=logits.device).tolist() if m else []
        out = []
        for j, d in enumerate(drafts):
            p_d = float(p[j, d])
            q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
            if q_d > 0 and u[j] < min(1.0, p_d / q_d):
                out.append(d)
                continue
            if draft_probs is None:
                residual = p[j].clone()
                residual[d] = 0.0
            else:
                residual = (p[j] - draft_probs[j]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q: any draw from p is the residual's
                residual = p[j]
            out.append(self.sampler.draw(residual, gen))
            return out
        out.append(self.sampler.draw(p[m], gen))
        return out
