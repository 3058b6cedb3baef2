"""The analytic latency model: a spec sheet's roofline, used where no profile exists."""

from __future__ import annotations

import numpy as np

from testbed.hardware import HardwareSpec
from testbed.models import DTYPE_BYTES, ModelSpec
from testbed.sim.collectives import RING_LATENCY_S, ring_share


class RooflineModel:
    """Analytic: compute-bound or memory-bound, whichever is slower, plus overheads.

    Over ``tensor`` ranks each GPU does its share of the work and reads its share
    of the weights and KV cache, and every layer adds two ring all-reduces of the
    step's hidden states at the spec sheet's interconnect bandwidth; over
    ``pipeline`` stages a step passes each stage in turn (one batch in flight)
    with a hand-over between stages."""

    kind = "roofline"

    def __init__(
        self,
        model: ModelSpec,
        hw: HardwareSpec,
        dtype: str = "bfloat16",
        tensor: int = 1,
        pipeline: int = 1,
    ) -> None:
        self.model, self.hw, self.dtype = model, hw, dtype
        split = f", TP{tensor} PP{pipeline}" if tensor * pipeline > 1 else ""
        self.source = f"analytic roofline of {hw.name} spec sheet ({hw.source}){split}"
        flops = hw.peak_flops * hw.compute_efficiency
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency
        kv_heads = max(model.num_kv_heads, tensor)  # replicated beyond one per rank
        kv_per_token = model.kv_bytes_per_token(dtype) * kv_heads / model.num_kv_heads
        self._s_per_token_flops = 2 * model.matmul_params / flops / tensor
        self._s_weights = model.weight_bytes(dtype) / bw / tensor
        self._s_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / flops / tensor
        self._s_per_kv_token = kv_per_token / bw / tensor
        self._s_comm_per_token, self._s_comm = 0.0, 0.0
        if tensor * pipeline > 1:
            link = hw.interconnect_bandwidth
            if link <= 0:
                raise ValueError(
                    f"hardware {hw.name}: a replica of {tensor * pipeline} GPUs needs an "
                    "interconnect (interconnect_bandwidth is 0)"
                )
            token_bytes = model.hidden_size * DTYPE_BYTES[dtype]
            reduces = 2 * model.num_layers if tensor > 1 else 0
            ring = ring_share(tensor)
            self._s_comm_per_token = (reduces * ring + 2 * (pipeline - 1)) * token_bytes / link
            self._s_comm = (reduces + pipeline - 1) * RING_LATENCY_S

    def predict(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        # max_kv: a roofline charges work and bytes, not how they are spread
        linear = max(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = max(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        return self._total(num_reqs, num_tokens, linear, attention)

    def verification_s(self, num_spec_reqs):
        """Nothing: a roofline charges a verification's tokens like any others."""
        return 0.0 * num_spec_reqs

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        linear = np.maximum(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = np.maximum(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        return self._total(num_reqs, num_tokens, linear, attention)

    def _total(self, num_reqs, num_tokens, linear, attention):
        """A step's seconds from its linear and attention parts (numbers or arrays)."""
        hw = self.hw
        return (
            hw.step_overhead_s
            + hw.request_overhead_s * num_reqs
            + linear
            + attention
            + (self._s_comm + num_tokens * self._s_comm_per_token)
        )
