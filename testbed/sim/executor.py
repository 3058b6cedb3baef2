"""The simulated data plane: a step lasts what the latency model predicts."""

from __future__ import annotations

import random
from collections.abc import Callable

from testbed.core import ExecutorOutput, SchedulerOutput
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

    With a ``speed`` trace, each step's latency is also multiplied by the trace's
    factor at the step's start (``clock``: the simulation's clock).
    """

    def __init__(
        self,
        latency_model: LatencyModel,
        acceptance: AcceptanceModel | None = None,
        seed: int = 0,
        propose_s: tuple[float, float] = (0.0, 0.0),
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
        self.seed = seed
        self._rngs: dict[str, random.Random] = {}  # each request's own, while it runs

    def _rng(self, request_id: str) -> random.Random:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = random.Random(f"{self.seed}:{request_id}")
        return rng

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        latency = self.latency_model.predict(*step_features(so))
        if so.spec_token_ids:  # requests verifying drafts, beyond their tokens
            latency += self.latency_model.verification_s(len(so.spec_token_ids))
        if self.speed is not None:
            latency *= self.speed.at(self.clock())
        model = self.acceptance
        out = ExecutorOutput()
        if model is not None:
            # The proposer's time as a real run measured it (at its machine's speed).
            latency += self._speculate(so, model, out)
        out.latency_s = latency
        return out

    def _speculate(self, so: SchedulerOutput, model: AcceptanceModel, out: ExecutorOutput) -> float:
        """Accept each request's verified drafts and draft its next ones, as the
        acceptance model says; the proposer's time this costs the step."""
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
