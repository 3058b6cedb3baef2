"""The simulated data plane: a step lasts what the latency model predicts."""

from __future__ import annotations

import random
from collections.abc import Callable

from testbed.core import ExecutorOutput, SchedulerOutput
from testbed.sim.latency import LatencyModel, step_features
from testbed.sim.speed import SpeedTrace


class SimExecutor:
    """Predicts each step's latency; "samples" stand-in tokens.

    With ``num_speculative_tokens > 0`` it also proposes that many stand-in
    drafts after every sampled token and accepts each draft with probability
    ``acceptance_rate`` (stopping at the first rejection, as verification does),
    seeded, so that speculative decoding's effect on the schedule is simulated.

    With a ``speed`` trace, each step's latency is also multiplied by the trace's
    factor at the step's start (``clock``: the simulation's clock).
    """

    def __init__(
        self,
        latency_model: LatencyModel,
        num_speculative_tokens: int = 0,
        acceptance_rate: float = 0.0,
        seed: int = 0,
        speed: SpeedTrace | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if speed is not None and clock is None:
            raise ValueError("a speed trace needs the simulation's clock")
        self.latency_model = latency_model
        self.speed, self.clock = speed, clock
        self.num_spec = num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self.rng = random.Random(seed)

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        latency = self.latency_model.predict(*step_features(so))
        if self.speed is not None:
            latency *= self.speed.at(self.clock())
        if not self.num_spec:
            return ExecutorOutput(latency_s=latency)
        accepted, drafts = {}, {}
        for i, req in enumerate(so.requests):
            if not so.samples(i):
                continue
            rid = req.request_id
            n = 0
            for _ in so.spec_token_ids.get(rid, ()):
                if self.rng.random() >= self.acceptance_rate:
                    break
                n += 1
            accepted[rid] = n
            drafts[rid] = [0] * self.num_spec
        return ExecutorOutput(
            latency_s=latency, num_accepted_drafts=accepted, draft_token_ids=drafts
        )
