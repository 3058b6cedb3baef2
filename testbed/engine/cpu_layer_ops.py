"""A CPU model's RMSNorms, rotary embedding and MLP activation through the fused
C++ ops of ``testbed/kernels/cpu_layer_ops.cpp``: one pass over the rows each,
where the torch modules run several ops and float32 temporaries. They round a
bfloat16 model's values where the torch modules do, so only the order of a
norm's sum differs. Where the ops cannot be built (or ``TESTBED_CPU_KERNEL=torch``)
the torch modules run, as they do on any other device.
"""

from __future__ import annotations

import torch

from testbed.engine.model import MLP, RMSNorm, RotaryEmbedding
from testbed.kernels import cpu_native

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def enable(model) -> str | None:
    """Give ``model``'s norms, rotary embedding and MLPs the fused ops; None, or why
    they keep torch's."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype not in FUSED_DTYPES:
        return f"not a float32 or bfloat16 model on a CPU ({weight.dtype}, {weight.device})"
    ops = cpu_native.layer_ops()
    if ops is None:
        return cpu_native.unavailable_reason()
    for module in model.modules():
        if isinstance(module, RMSNorm | RotaryEmbedding | MLP):
            module.ops = ops
    return None
