"""The simulated data plane: a step lasts what the latency model predicts."""

from __future__ import annotations

import random
from collections.abc import Callable

from testbed.core import ExecutorOutput, SchedulerOutput
from testbed.core.outputs import pass_features
from testbed.core.request import STAND_IN_TOKEN
from testbed.sim.acceptance import AcceptanceModel
from testbed.sim.latency import LatencyModel, step_features
from testbed.sim.speed import SpeedTrace


class SimExecutor:
    """Predicts each step's latency; "samples" stand-in tokens.

    With an acceptance model (speculative decoding), it also drafts stand-in
    tokens after every sampled token and accepts a prefix of each request's
    verified drafts, as the model says (:mod:`testbed.sim.acceptance`), so that
    speculation's effect on the schedule is simulated: the verified drafts are
    tokens of the step like any others, for the latency model too.

    A draft model's time is its passes as the real proposer runs them, each
    predicted by ``draft_latency`` (the draft's own latency model): after every
    step one pass over each scheduled request's tokens now known to be right plus
    the token just sampled, then ``k - 1`` one-token passes of the requests still
    drafting (times ``draft_latency_scale``: the draft profile's level against
    the target's, as a real run measures both). ``propose_s`` adds a proposer
    time per step and per request drafted for (an n-gram proposer's, as a real
    run fits it).

    With a ``speed`` trace, each step's latency (the draft's passes included) is
    also multiplied by the trace's factor at the step's start (``clock``: the
    simulation's clock).
    """

    def __init__(
        self,
        latency_model: LatencyModel,
        acceptance: AcceptanceModel | None = None,
        seed: int = 0,
        propose_s: tuple[float, float] = (0.0, 0.0),
        draft_latency: LatencyModel | None = None,
        draft_latency_scale: float = 1.0,
        speed: SpeedTrace | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if speed is not None and clock is None:
            raise ValueError("a speed trace needs the simulation's clock")
        self.latency_model = latency_model
        self.speed, self.clock = speed, clock
        self.acceptance = acceptance
        # The proposer's time: per step it drafts in, and per request it drafts for.
        self.propose_s_per_step, self.propose_s_per_request = propose_s
        self.draft_latency, self.draft_latency_scale = draft_latency, draft_latency_scale
        # Starts the KV transfers a step's connector metadata asks for (set by a
        # disaggregated simulation: testbed.sim.disagg).
        self.kv_transfers: Callable[[object], None] | None = None
        self.seed = seed
        self._rngs: dict[str, random.Random] = {}  # each request's own, while it runs

    def _rng(self, request_id: str) -> random.Random:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = random.Random(f"{self.seed}:{request_id}")
        return rng

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        if so.kv_connector_metadata is not None and self.kv_transfers is not None:
            self.kv_transfers(so.kv_connector_metadata)
        if not so.requests:  # only KV to wait for: no step
            return ExecutorOutput(latency_s=0.0)
        latency = self.latency_model.predict(*step_features(so))
        if so.spec_token_ids:  # requests verifying drafts, beyond their tokens
            latency += self.latency_model.verification_s(len(so.spec_token_ids))
        model = self.acceptance
        out = ExecutorOutput()
        propose_s = 0.0
        if model is not None:
            propose_s = self._speculate(so, model, out)
            if self.draft_latency is not None:
                latency += self._draft_passes_s(so, out)
        if self.speed is not None:
            latency *= self.speed.at(self.clock())
        # The proposer's time as a real run measured it (at its machine's speed).
        out.latency_s = latency + propose_s
        return out

    def _draft_passes_s(self, so: SchedulerOutput, out: ExecutorOutput) -> float:
        """The draft model's passes after this step (as
        :meth:`testbed.engine.draft_model.DraftModelProposer.propose` runs them),
        each predicted by the draft's latency model."""
        model = self.draft_latency
        rows, sampled = [], 0  # the sync pass: (context, tokens) per scheduled request
        ends = []  # (first draft's context, drafts) of each request drafting
        for i, req in enumerate(so.requests):
            ctx, n = so.context_lens[i], so.num_scheduled_tokens[i]
            rid = req.request_id
            drafts = len(out.draft_token_ids.get(rid, ()))
            if rid in out.num_accepted_drafts:  # sampled: right tokens + the new one
                n += out.num_accepted_drafts[rid] + 1 - len(so.spec_token_ids.get(rid, ()))
                sampled += 1
            rows.append((ctx, n))
            if drafts > 1:
                ends.append((ctx + n, drafts))
        # A request that sampled runs at least 2 tokens (its last and the new one):
        # a short multi-token query, charged as a verification is.
        seconds = model.predict(*pass_features(rows)) + model.verification_s(sampled)
        for j in range(1, max((d for _, d in ends), default=1)):
            # The j-th draft token of each request drafting more than j.
            reads = [end + j for end, d in ends if d > j]
            total = sum(reads)
            seconds += model.predict(len(reads), len(reads), float(total), total, max(reads))
        return seconds * self.draft_latency_scale

    def _speculate(self, so: SchedulerOutput, model: AcceptanceModel, out: ExecutorOutput) -> float:
        """Accept each request's verified drafts and draft its next ones, as the
        acceptance model says; the proposer's time per step and per request this
        costs (``propose_s``)."""
        for rid in so.finished_req_ids:
            self._rngs.pop(rid, None)
        accepted, drafts, proposing = {}, {}, 0
        for i, req in enumerate(so.requests):
            if not so.samples(i):
                continue
            rid = req.request_id
            rng = self._rng(rid)
            n = model.num_accepted(rng, len(so.spec_token_ids.get(rid, ())))
            accepted[rid] = n
            # Room before the request's end after this step's 1 + n tokens.
            room = min(model.k, req.max_num_tokens - req.num_tokens - n - 2)
            drafts[rid] = [STAND_IN_TOKEN] * model.num_drafts(rng, room)
            proposing += room > 0
        out.num_accepted_drafts, out.draft_token_ids = accepted, drafts
        if not proposing:
            return 0.0
        return self.propose_s_per_step + proposing * self.propose_s_per_request
