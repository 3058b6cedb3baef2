"""The model runner: one flattened batch per step, built from a ``SchedulerOutput``.

It keeps each request's block table (rebuilt for new and resumed requests,
extended with new blocks otherwise), gathers the tokens each request computes
this step, their positions and KV slots, runs the model once over all of them
(prefill chunks, decodes and draft verifications mixed), and samples for the
requests whose prompt and output are fully computed: a request with drafts
gets the target's logits at its last token and at each draft, and the
rejection sampler accepts a prefix of them and adds one token. With a
proposer, it then proposes the next step's drafts for each request that sampled.
"""

from __future__ import annotations

import time

import torch

from testbed.core import ExecutorOutput, SchedulerOutput
from testbed.core.spec_stats import ProposerTime
from testbed.engine.batch import flatten, token_slice
from testbed.engine.model import CausalLM
from testbed.engine.rejection import RejectionSampler
from testbed.engine.sampler import Sampler
from testbed.threads import ThreadGovernor


class ModelExecutor:
    """The real data plane: a model, its paged KV cache and a sampler."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        backend,
        device: torch.device,
        seed: int = 0,
        proposer=None,
    ) -> None:
        cfg = model.config
        self.model, self.backend, self.device = model, backend, device
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.tables: dict[str, list[int]] = {}
        self.sampler = Sampler(device, seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        # Proposes each sampling request's next drafts (``propose(so, sampled, limits,
        # tables)``, ``draft_probs(request_id, m)``, ``forget(request_id)``).
        self.proposer = proposer
        self.proposer_time = ProposerTime()  # the proposer's time per step, for the simulator
        self._num_proposing = 0  # requests the last step's proposer drafted for
        self.num_computed_tokens = 0  # tokens run through the model, all steps
        self.record_timings = False  # synchronize the device for exact part timings
        # Sets torch's threads to the cores others leave free, before each step
        # (testbed/threads.py); None: the threads stay as they are.
        self.threads: ThreadGovernor | None = None
        self.last_timings: dict[str, float] = {}

    def warm_up(self) -> None:
        """Compile or load the attention backend's kernels for this model and cache
        (Triton's ``warm_up``, the CPU path's C++ kernel; the torch reference has
        nothing to compile) and initialise a GPU's matrix-multiply library, before
        any request's clock runs."""
        warm = getattr(self.backend, "warm_up", None)
        if warm is not None:
            warm(*self.kv_caches[0], self.model.config.num_heads)
        if self.device.type == "cuda":
            x = torch.ones(16, 16, dtype=self.kv_caches[0][0].dtype, device=self.device)
            (x @ x).sum().item()  # cuBLAS's handle and workspace; waits for the kernels

    def gather_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of ``block_ids``, every layer's keys and values, in one tensor
        ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` (what a KV
        transfer sends)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([k[idx], v[idx]]) for k, v in self.kv_caches])

    def scatter_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write a :meth:`gather_kv` tensor into ``block_ids`` (a KV transfer's end)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (k, v), layer in zip(self.kv_caches, kv, strict=True):
            k[idx] = layer[0].to(k.device)
            v[idx] = layer[1].to(v.device)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of :meth:`gather_kv` of ``num_blocks`` blocks."""
        k, _ = self.kv_caches[0]
        return (len(self.kv_caches), 2, num_blocks, *k.shape[1:])

    @property
    def kv_cache_bytes(self) -> int:
        k, _ = self.kv_caches[0]
        return 2 * len(self.kv_caches) * k.numel() * k.element_size()

    def _update_tables(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.sampler.forget(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)
        for rid in so.preempted_req_ids:
            self.tables.pop(rid, None)
        for req in so.requests:
            rid = req.request_id
            new = so.new_block_ids.get(rid, ())
            if rid in so.new_req_ids:
                self.tables[rid] = list(new)
            else:
                self.tables[rid].extend(new)

    def _prepare(self, so: SchedulerOutput):
        rows = []
        for req, ctx, n in zip(so.requests, so.context_lens, so.num_scheduled_tokens, strict=True):
            rows.append((self.tables[req.request_id], token_slice(req, ctx, ctx + n), ctx))
        ids, positions, meta, q_start = flatten(rows, self.block_size, self.device)
        sample_idx = []
        for i, req in enumerate(so.requests):
            if so.samples(i):
                # The last token's logits, and each scheduled draft's before it.
                m = len(so.spec_token_ids.get(req.request_id, ()))
                sample_idx.extend(range(q_start[i + 1] - 1 - m, q_start[i + 1]))
        return ids, positions, meta, sample_idx

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        if self.threads is not None:
            self.threads.adjust()
        start = time.perf_counter()
        self._update_tables(so)
        if not so.requests:
            return ExecutorOutput(sampled_token_ids=[], measured_s=time.perf_counter() - start)
        ids, positions, meta, sample_idx = self._prepare(so)
        t_prepared = time.perf_counter()
        hidden = self.model(ids, positions, meta, self.kv_caches, self.backend)
        if self.record_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_forward = time.perf_counter()
        self.num_computed_tokens += ids.numel()
        sampled: list[list[int]] = [[] for _ in so.requests]
        drafts = None
        if sample_idx:
            sampled = self._sample(so, self.model.logits(hidden[sample_idx]))
        t_sampled = time.perf_counter()
        if self.proposer is not None:  # a draft model also follows prefill-only steps
            drafts = self._propose(so, sampled)
        end = time.perf_counter()
        if self.proposer is not None:
            self.proposer_time.observe(self._num_proposing, end - t_sampled, start=t_sampled)
        # The parts of this step, for the profiler (sampling includes the LM head).
        self.last_timings = {
            "prepare": t_prepared - start,
            "forward": t_forward - t_prepared,
            "sample": t_sampled - t_forward,
            "propose": end - t_sampled,
        }
        return ExecutorOutput(
            sampled_token_ids=sampled, measured_s=end - start, draft_token_ids=drafts
        )

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor) -> list[list[int]]:
        """Each sampling request's tokens from its rows of ``logits`` (in batch order:
        one row, or one per draft and one more): plain rows batched through the
        sampler, requests with drafts through the rejection sampler."""
        sampled: list[list[int]] = [[] for _ in so.requests]
        plain, plain_rows, row = [], [], 0
        for i, req in enumerate(so.requests):
            if not so.samples(i):
                continue
            drafts = so.spec_token_ids.get(req.request_id)
            if drafts:
                rows = logits[row : row + len(drafts) + 1]
                proposer = self.proposer
                probs = proposer.draft_probs(req.request_id, len(drafts)) if proposer else None
                sampled[i] = self.rejection_sampler.verify(
                    rows, drafts, req.request_id, req.sampling_params, probs
                )
                row += len(drafts) + 1
            else:
                plain.append(i)
                plain_rows.append(row)
                row += 1
        if plain:
            reqs = [so.requests[i] for i in plain]
            toks = self.sampler.sample(
                logits if plain_rows == list(range(len(logits))) else logits[plain_rows],
                [r.request_id for r in reqs],
                [r.sampling_params for r in reqs],
            )
            for i, tok in zip(plain, toks, strict=True):
                sampled[i] = [tok]
        return sampled

    def _propose(self, so: SchedulerOutput, sampled: list[list[int]]) -> dict[str, list[int]]:
        """The next step's drafts of each request that sampled, no more than can be
        used before it stops at its length (prompt + output + drafts + 1 <= its end)."""
        limits = [
            req.max_num_tokens - (req.num_tokens + len(new)) - 1 if new else 0
            for req, new in zip(so.requests, sampled, strict=True)
        ]
        self._num_proposing = sum(1 for lim in limits if lim > 0)
        # A draft model's KV lives in blocks of the target's tables.
        return self.proposer.propose(so, sampled, limits, self.tables)
