"""What the simulator's latency model says of a deployment before it is
simulated: floors under its TTFT and TPOT (an SLO below them cannot be met at
any rate) and a rough estimate of its capacity (where the search starts).

The floors price each request alone on an idle instance: its TTFT is at least
the steps that compute its prompt, less the longest prefix another request of
the trace shares with it (which a prefix cache may hold, whatever the order and
routing; its last token is always computed), and its TPOT at least
one decode step of it alone at its prompt's length, since every output token
after the first takes a step of its own. A run's percentile of either is then
at least the same percentile of the floors (a percentile is monotone in every
value). This holds as long as a step costs at least what a step with a subset
of its requests would (each latency model grows with every feature of a step)
and splitting a prefill into more chunks costs no less in all (each step pays
its fixed overheads); speculative decoding (several tokens a step) and a speed
trace (steps faster than predicted) void the floors, which are then not used.
"""

from __future__ import annotations

import math

import numpy as np
from omegaconf import DictConfig, OmegaConf

from testbed.build import latency_model, model_spec
from testbed.metrics.summary import statistics
from testbed.search.checks import Fit, TraceStats
from testbed.search.slo import SLO
from testbed.search.space import Deployment
from testbed.sim.latency import LatencyModel

# A run's times are differences of clock readings: an idle request's TTFT equals
# its floor only up to rounding, which must not prune it.
ROUNDING = 1e-9


class Bounds:
    """Floors and capacity estimates for the deployments of one base config."""

    def __init__(self, cfg: DictConfig, stats: TraceStats) -> None:
        self.cfg = OmegaConf.create(
            {
                k: OmegaConf.to_container(cfg[k], resolve=True)
                for k in ("model", "hardware", "engine", "mode")
            }
            | {"profiles_dir": cfg.profiles_dir}
        )
        self.spec = model_spec(cfg.model)
        self.stats = stats
        mode = cfg.mode
        speculative = cfg.engine.speculative.method is not None
        self.scale = float(mode.get("latency_scale", 1.0))
        # Why floors are off for this config (None: on).
        self.floors_off: str | None = None
        if mode.get("speed_trace"):
            self.floors_off = "mode.speed_trace is set (steps may run faster than predicted)"
        elif speculative:
            self.floors_off = "speculative decoding is on (several tokens a step)"
        self._models: dict[tuple[int, int], LatencyModel] = {}
        self._floors: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def model(self, dep: Deployment) -> LatencyModel:
        """The latency model of ``dep``'s instance shape (one per TP x PP)."""
        key = (dep.tensor_parallel, dep.pipeline_parallel)
        if key not in self._models:
            tp, pp = key
            cfg = OmegaConf.merge(
                self.cfg, {"engine": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}}
            )
            self._models[key] = latency_model(cfg, self.spec)
        return self._models[key]

    def source(self, dep: Deployment) -> str:
        return self.model(dep).source

    def prefill_s(self, dep: Deployment, prompt: int, chunk: int, cached: int = 0) -> float:
        """Seconds to compute ``prompt`` tokens alone, ``chunk`` tokens a step, the
        first ``cached`` of them found in the prefix cache."""
        lm, total, ctx = self.model(dep), 0.0, cached
        while ctx < prompt:
            n = min(chunk, prompt - ctx)
            total += lm.predict(1, n, n * (ctx + (n + 1) / 2), ctx + n, ctx + n)
            ctx += n
        return total * self.scale

    def decode_s(self, dep: Deployment, batch: int, context: float) -> float:
        """Seconds of one step in which ``batch`` requests of ``context`` tokens decode."""
        pairs = batch * (context + 1)
        return (
            self.model(dep).predict(batch, batch, pairs, int(pairs), int(context) + 1) * self.scale
        )

    def _chunk(self, dep: Deployment, fit: Fit) -> int:
        chunk = dep.max_num_batched_tokens if dep.chunked_prefill else 1 << 62
        cap = int(fit.engine.get("long_prefill_token_threshold") or 0)
        return min(chunk, cap) if cap and dep.chunked_prefill else chunk

    def floors(self, dep: Deployment, fit: Fit) -> tuple[np.ndarray, np.ndarray]:
        """Each request's TTFT floor and TPOT floor (NaN where it has one output
        token: no TPOT), in seconds."""
        key = (dep.tensor_parallel, dep.pipeline_parallel, self._chunk(dep, fit))
        if key not in self._floors:
            chunk, s = key[2], self.stats
            prefill: dict[tuple[int, int], float] = {}
            ttft = np.empty(len(s.prompt))
            for i, (p, c) in enumerate(zip(s.prompt.tolist(), s.cacheable.tolist())):
                if (p, c) not in prefill:
                    prefill[(p, c)] = self.prefill_s(dep, p, chunk, cached=c)
                ttft[i] = prefill[(p, c)]
            decode = {p: self.decode_s(dep, 1, p) for p in np.unique(s.prompt).tolist()}
            tpot = np.array([decode[p] for p in s.prompt.tolist()])
            tpot[s.output < 2] = math.nan
            self._floors[key] = ttft, tpot
        return self._floors[key]

    def floor_miss(
        self, dep: Deployment, fit: Fit, slo: SLO, requests: int | None = None
    ) -> str | None:
        """Why ``dep`` cannot meet ``slo`` at any rate (its floors above the
        targets) on the trace's first ``requests`` (None: all), or None."""
        if self.floors_off is not None:
            return None
        ttft, tpot = (f[:requests] for f in self.floors(dep, fit))
        for name, floor, target in (
            ("TTFT", statistics(ttft, (slo.percentile,))[slo.percentile], slo.ttft_s),
            ("TPOT", statistics(tpot, (slo.percentile,))[slo.percentile], slo.tpot_s),
        ):
            if floor * (1 - ROUNDING) > target:
                return (
                    f"{name} at {slo.percentile} is at least {floor:.4g} s with each request "
                    f"alone on an idle instance, above the target {target:g} s"
                )
        return None

    def capacity(self, dep: Deployment, fit: Fit) -> float:
        """A rough capacity (req/s) of the deployment: each instance decoding as
        many mean-length requests as its batch and KV cache hold, beside each
        request's prefill. Only where the search starts; it bounds nothing."""
        s = self.stats
        prompt, output = float(s.prompt.mean()), float(s.output.mean())
        context = prompt + output / 2
        batch = max(1, min(dep.max_num_seqs, int(fit.kv_tokens // max(context, 1.0))))
        decode_per_request = output * self.decode_s(dep, batch, context) / batch
        prefill = self.prefill_s(dep, round(prompt), self._chunk(dep, fit))
        pools = dep.pools()
        if pools is None:
            return dep.replicas / (decode_per_request + prefill)
        return min(pools[0] / prefill, pools[1] / decode_per_request)
