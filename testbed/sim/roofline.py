"""The analytic latency model: a spec sheet's roofline, used where no profile exists."""

from __future__ import annotations

import numpy as np

from testbed.hardware import HardwareSpec
from testbed.models import ModelSpec


class RooflineModel:
    """Analytic: compute-bound or memory-bound, whichever is slower, plus overheads."""

    kind = "roofline"

    def __init__(self, model: ModelSpec, hw: HardwareSpec, dtype: str = "bfloat16") -> None:
        self.model, self.hw, self.dtype = model, hw, dtype
        self.source = f"analytic roofline of {hw.name} spec sheet ({hw.source})"
        flops = hw.peak_flops * hw.compute_efficiency
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency
        self._s_per_token_flops = 2 * model.matmul_params / flops
        self._s_weights = model.weight_bytes(dtype) / bw
        self._s_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / flops
        self._s_per_kv_token = model.kv_bytes_per_token(dtype) / bw

    def predict(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        # max_kv: a roofline charges work and bytes, not how they are spread
        linear = max(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = max(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        hw = self.hw
        return hw.step_overhead_s + hw.request_overhead_s * num_reqs + linear + attention

    def verification_s(self, num_spec_reqs):
        """Nothing: a roofline charges a verification's tokens like any others."""
        return 0.0 * num_spec_reqs

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        linear = np.maximum(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = np.maximum(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        hw = self.hw
        return hw.step_overhead_s + hw.request_overhead_s * num_reqs + linear + attention
