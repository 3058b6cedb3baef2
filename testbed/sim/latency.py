"""Step-latency models' common ground: what a step is to them, and their interface.

A step is summarised by five numbers (see :func:`step_features`):

* ``num_reqs``: requests in the batch (per-request CPU work: input preparation,
  sampling, bookkeeping);
* ``num_tokens``: tokens computed (every linear layer, the LM head);
* ``attn_pairs``: query-key pairs attention computes, ``sum_i n_i * (ctx_i + (n_i + 1) / 2)``
  for a request computing ``n_i`` tokens after ``ctx_i`` cached ones;
* ``kv_tokens``: cached tokens whose keys and values attention reads,
  ``sum_i (ctx_i + n_i)``;
* ``max_kv``: the most one request reads, ``max_i (ctx_i + n_i)``: attention
  kernels that pad to, or loop over chunks of, the longest context pay for
  unequal contexts beyond their total.

Two models map them to seconds: :class:`~testbed.sim.roofline.RooflineModel`
from a spec sheet, and :class:`~testbed.sim.profile_model.ProfileModel` fitted
to a measured profile; :func:`~testbed.sim.predictor.make_latency_model` picks
one for a run.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from testbed.core import SchedulerOutput

FEATURES = ("num_reqs", "num_tokens", "attn_pairs", "kv_tokens", "max_kv")


def step_features(so: SchedulerOutput) -> tuple[int, int, float, int, int]:
    """``(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)`` of a scheduled step."""
    return so.features()


def decode_latencies(
    model: LatencyModel, num_reqs: int, context_tokens: int, k: int, longest_context: int
):
    """Latencies of ``k`` steps in which each of ``num_reqs`` requests decodes one
    token, after ``context_tokens`` cached tokens in total (``longest_context`` for
    the longest request) at the first. Bit for bit
    what :func:`step_features` + ``predict`` give for each such step, so the
    simulator's fast path predicts exactly what stepping would."""
    steps = np.arange(1, k + 1, dtype=np.int64)
    kv = context_tokens + num_reqs * steps
    return model.predict_many(
        num_reqs, num_reqs, kv.astype(np.float64), kv, longest_context + steps
    )


class LatencyModel(Protocol):
    kind: str  # "roofline" or "profile"
    source: str  # where its numbers come from

    def predict(
        self, num_reqs: int, num_tokens: int, attn_pairs: float, kv_tokens: int, max_kv: int
    ) -> float:
        """Seconds one step with this composition takes."""
        ...

    def verification_s(self, num_spec_reqs):
        """Seconds that ``num_spec_reqs`` requests verifying drafts (speculative
        decoding) add to a step beyond what its features say (a number or an array)."""
        ...

    def predict_many(
        self,
        num_reqs: int,
        num_tokens: int,
        attn_pairs: np.ndarray,
        kv_tokens: np.ndarray,
        max_kv: np.ndarray,
    ) -> np.ndarray:
        """:meth:`predict` over arrays of attention work, with the same float operations
        in the same order (so each element equals the scalar prediction exactly)."""
        ...
