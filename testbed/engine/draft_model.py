"""The draft-model proposer: a smaller model (or the target's own first layers)
drafts ``k`` tokens autoregressively after each sampled token.

Its KV cache is its own tensors indexed by the target's block tables: the same
blocks, allocated, shared through the prefix cache, freed and preempted with
the target's request, with ``k`` lookahead slots past the verified tokens for
the drafts' KV (``SchedulerConfig.num_lookahead_tokens``). After each target
step it runs one pass over every token the target computed that is now known
to be right (prefill chunks; the last token and the accepted drafts) plus the
token just sampled, whose logits give the first draft, then ``k - 1`` one-token
passes for the rest. A greedy request's drafts are the draft's argmax; a sampled
request's are drawn from the draft's distribution (after the request's own
temperature, top-k and top-p), which the rejection sampler then needs:
:meth:`draft_probs`.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from testbed.core import SchedulerOutput
from testbed.core.outputs import pass_features
from testbed.engine.batch import flatten, token_slice
from testbed.engine.model import AttentionMetadata, CausalLM
from testbed.engine.sampler import process_logits


class FirstLayers(nn.Module):
    """A causal LM cut to its first ``n`` decoder layers (its own final norm and
    LM head after them), sharing the weights: a model as its own draft
    (self-speculation, as LayerSkip and Draft&Verify do)."""

    def __init__(self, lm: CausalLM, n: int) -> None:
        super().__init__()
        self.lm = lm
        self.config = lm.config
        self.layers = lm.model.layers[:n]

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, backend):
        m = self.lm.model
        x = m.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, m.rotary_emb, meta, kv_cache, backend)
        return m.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.logits(hidden)


class DraftModelProposer:
    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        k: int,
        num_blocks: int,
        block_size: int,
        backend,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        cfg = model.config
        self.model, self.k, self.backend, self.device = model, k, backend, device
        self.block_size, self.seed = block_size, seed
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        self._probs: dict[str, torch.Tensor] = {}  # sampled requests' draft distributions
        self._generators: dict[str, torch.Generator] = {}
        self.num_computed_tokens = 0  # tokens run through the draft, all steps
        # Each pass's step features and its short multi-token rows (requests that
        # sampled), for a run's speed against the draft's profile.
        self.passes: list[tuple[tuple[int, int, float, int, int], int]] = []

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        self._generators.pop(request_id, None)

    def draft_probs(self, request_id: str, m: int) -> torch.Tensor | None:
        """The distributions the first ``m`` drafts of a sampled request were drawn
        from (None for a greedy one)."""
        probs = self._probs.get(request_id)
        return None if probs is None else probs[:m]

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            base = seed if seed is not None else zlib.crc32(f"{self.seed}:{request_id}".encode())
            gen.manual_seed((base ^ 0x5DEECE66D) & 0x7FFF_FFFF_FFFF_FFFF)  # not the target's stream
            self._generators[request_id] = gen
        return gen

    def _run(self, rows, short: int = 0) -> torch.Tensor:
        """One forward pass over ``rows`` of ``(block table, tokens, first position)``
        (``short`` of them a sampled request's few tokens); the hidden state of each
        row's last token."""
        self.passes.append((pass_features((first, len(t)) for _, t, first in rows), short))
        ids, positions, meta, q_start = flatten(rows, self.block_size, self.device)
        hidden = self.model(ids, positions, meta, self.kv_caches, self.backend)
        self.num_computed_tokens += ids.numel()
        return hidden[[q - 1 for q in q_start[1:]]]

    def _choose(self, logits: torch.Tensor, reqs) -> list[int]:
        """Each row's draft token (argmax, or drawn from the processed distribution),
        recording the sampled requests' distributions."""
        out = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(reqs) if r.sampling_params.temperature > 0]
        if sampled:
            params = [reqs[i].sampling_params for i in sampled]
            probs = torch.softmax(process_logits(logits[sampled], params), dim=-1)
            for row, i in enumerate(sampled):
                req = reqs[i]
                gen = self._generator(req.request_id, req.sampling_params.seed)
                out[i] = int(torch.multinomial(probs[row], 1, generator=gen))
                prev = self._probs.get(req.request_id)
                step = probs[row : row + 1]
                self._probs[req.request_id] = step if prev is None else torch.cat([prev, step])
        return out

    @torch.inference_mode()
    def propose(
        self,
        so: SchedulerOutput,
        sampled: list[list[int]],
        limits: list[int],
        tables: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """Drafts for each request that sampled (at most ``limits[i]`` and k), after
        bringing the draft's KV (in ``tables``' blocks, the target's) up to every
        token the target step made certain."""
        rows, proposing = [], []  # proposing: (request's row, its sampled token's position)
        for i, req in enumerate(so.requests):
            ctx, n, new = so.context_lens[i], so.num_scheduled_tokens[i], sampled[i]
            table = tables[req.request_id]
            if not new:  # a prefill chunk: its tokens, nothing to draft
                rows.append((table, token_slice(req, ctx, ctx + n), ctx))
                continue
            # The step's tokens up to its last real one, the accepted drafts, then
            # the token just sampled (at the first rejected draft's position).
            m = len(so.spec_token_ids.get(req.request_id, ()))
            end = ctx + n - m + len(new) - 1
            rows.append((table, token_slice(req, ctx, end) + [new[-1]], ctx))
            self._probs.pop(req.request_id, None)
            if limits[i] > 0:
                proposing.append((i, end))
        last = self._run(rows, sum(1 for new in sampled if new))  # a row per scheduled request
        drafts = {so.requests[i].request_id: [] for i, _ in proposing}
        active = proposing
        if active:
            logits = self.model.logits(last[[i for i, _ in active]])
        while active:
            chosen = self._choose(logits, [so.requests[i] for i, _ in active])
            more = []
            for (i, pos), tok in zip(active, chosen, strict=True):
                req = so.requests[i]
                d = drafts[req.request_id]
                d.append(tok)
                if len(d) < min(self.k, limits[i]):
                    more.append((i, pos + 1))
            active = more
            if active:
                ids = [so.requests[i].request_id for i, _ in active]
                rows = [(tables[r], [drafts[r][-1]], pos) for r, (_, pos) in zip(ids, active)]
                logits = self.model.logits(self._run(rows))
        return drafts
