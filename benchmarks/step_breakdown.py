"""Where the real engine's step time goes: attention, linear layers, the rest of the
forward pass, LM head + sampling, batch preparation, and the control plane.

``StepBreakdown(llm)`` instruments an ``LLM`` for the runs inside its ``with``
block: the attention backend behind the profiler's ``TimedBackend``, forward
hooks on the decoder's linear layers, and the engine's ``step`` wrapped to read
each step's kind and the executor's own part timings. For CPUs: there every op
is synchronous, so wall-clock intervals are the ops' costs (on a GPU the
backend's syncs would slow the run it times). The hooks cost about a microsecond per linear call,
which the shares include. Within the block a CPU model's layers run op by op
(``cpu_layer_ops.layer_by_layer``), so that the hooks see each product: the
engine's own runs take each layer in one C++ call, with the same ops and less
Python between them.
"""

from __future__ import annotations

import time
from collections import defaultdict

from torch import nn

from testbed.engine.cpu_layer_ops import layer_by_layer
from testbed.engine.cpu_linear import packed_linears
from testbed.profiling.measure import TimedBackend

PARTS = ("attention", "linear", "other_forward", "lm_head_sampling", "prepare", "control_plane")
KINDS = ("decode", "prefill", "mixed")


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    if num_prefill_tokens == 0:
        return "decode"
    return "prefill" if num_decode_tokens == 0 else "mixed"


class StepBreakdown:
    """Seconds per part, summed by step kind (decode-only, prefill-only, mixed)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.seconds = {k: defaultdict(float) for k in KINDS}
        self.steps = defaultdict(int)
        self._linear = 0.0

    def __enter__(self) -> StepBreakdown:
        executor, engine = self.llm.executor, self.llm.engine
        self._backend, self._step = executor.backend, engine.step
        executor.backend = self._timed = TimedBackend(executor.backend, executor.device)
        self._hooks = []
        linears = [m for m in executor.model.model.layers.modules() if isinstance(m, nn.Linear)]
        for module in linears + packed_linears(executor.model):
            self._hooks.append(module.register_forward_pre_hook(self._linear_start))
            self._hooks.append(module.register_forward_hook(self._linear_end))
        engine.step = self._timed_step
        self._layers = layer_by_layer(executor.model)  # so the hooks see each product
        self._layers.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.llm.executor.backend, self.llm.engine.step = self._backend, self._step
        for h in self._hooks:
            h.remove()
        self._layers.__exit__(*exc)

    def _linear_start(self, module, args) -> None:
        module._t0 = time.perf_counter()

    def _linear_end(self, module, args, out) -> None:
        self._linear += time.perf_counter() - module._t0

    def _timed_step(self):
        self._timed.seconds = self._linear = 0.0
        t0 = time.perf_counter()
        result = self._step()
        total = time.perf_counter() - t0
        if result.num_prefill_tokens + result.num_decode_tokens == 0:
            return result
        kind = step_kind(result.num_prefill_tokens, result.num_decode_tokens)
        parts = self.llm.executor.last_timings
        executor_s = sum(parts.values())
        s = self.seconds[kind]
        attention = self._timed.seconds
        s["attention"] += attention
        s["linear"] += self._linear
        s["other_forward"] += parts["forward"] - attention - self._linear
        s["lm_head_sampling"] += parts["sample"] + parts.get("propose", 0.0)
        s["prepare"] += parts["prepare"]
        s["control_plane"] += total - executor_s
        s["total"] += total
        self.steps[kind] += 1
        return result

    def shares(self, kinds=KINDS) -> dict[str, float]:
        """Each part's share of the steps of ``kinds``, and their total seconds."""
        total = sum(self.seconds[k]["total"] for k in kinds)
        out = {p: sum(self.seconds[k][p] for k in kinds) / total if total else 0.0 for p in PARTS}
        out["seconds"] = total
        out["steps"] = sum(self.steps[k] for k in kinds)
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        rows = {"all": self.shares()}
        for k in KINDS:
            if self.steps[k]:
                rows[k] = self.shares((k,))
        return rows
