"""The n-gram proposer (prompt lookup decoding).

For each request that sampled, the longest suffix of its tokens (prompt, output
and the tokens just sampled) of ``prompt_lookup_min`` to ``prompt_lookup_max``
tokens that also occurs earlier in them proposes the tokens that followed its
latest earlier occurrence, up to ``k``: vLLM's rule (longest n-gram first, then
the rightmost match). A request with no match gets no drafts (vLLM pads its
drafts with the last token for fixed shapes; a padded draft is rarely accepted).
Vectorised with numpy: one pass over the context per n-gram length, then only
over the places that match so far.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from testbed.core import SchedulerOutput


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``tokens`` (int64, the whole context)."""
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n :]
            # Starts 0 .. size - n - 1: every occurrence but the suffix itself. One
            # pass over the context for the first token, then only its matches.
            starts = np.flatnonzero(tokens[: size - n] == suffix[0])
            for offset in range(1, n):
                if not len(starts):
                    break
                starts = starts[tokens[starts + offset] == suffix[offset]]
            if len(starts):
                start = int(starts[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose_many(
        self, contexts: Sequence[Sequence[int]], limits: Sequence[int]
    ) -> list[list[int]]:
        """Drafts for each context, at most ``limits[i]`` (<= k) for the i-th."""
        return [
            self.propose_one(np.asarray(ctx, dtype=np.int64), min(self.k, lim)) if lim > 0 else []
            for ctx, lim in zip(contexts, limits, strict=True)
        ]

    def propose(
        self, so: SchedulerOutput, sampled: list[list[int]], limits: list[int], tables=None
    ) -> dict[str, list[int]]:
        """Drafts for each request of the step that sampled (the proposers' interface)."""
        reqs = [
            (r, new, lim) for r, new, lim in zip(so.requests, sampled, limits, strict=True) if new
        ]
        contexts = [[*r.prompt_token_ids, *r.output_token_ids, *new] for r, new, _ in reqs]
        drafts = self.propose_many(contexts, [lim for _, _, lim in reqs])
        return {r.request_id: d for (r, _, _), d in zip(reqs, drafts, strict=True) if d}

    def draft_probs(self, request_id: str, m: int) -> None:
        """A point mass: n-gram drafts have no distribution."""
        return None

    def forget(self, request_id: str) -> None:
        pass
