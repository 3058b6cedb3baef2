"""A CPU model's RMSNorms, rotary embedding and MLP activation through the fused
C++ ops of ``testbed/kernels/cpu_layer_ops.cpp``: one pass over the rows each,
where the torch modules run several ops and float32 temporaries. They round a
bfloat16 model's values where the torch modules do, so only the order of a
norm's sum differs. Where the ops cannot be built (or ``TESTBED_CPU_KERNEL=torch``)
the torch modules run, as they do on any other device.

Where its linear layers are packed as well (``cpu_linear``) and it has no q/k
norms, each decoder layer also runs as one C++ call (``cpu_decoder_layer.cpp``:
the same ops in the same order, without the Python between them) in every step
whose attention the C++ kernel takes whole; ``layer_by_layer`` turns that off for
timers that hook the layer's parts.
"""

from __future__ import annotations

import contextlib

import torch

from testbed.engine.model import MLP, RMSNorm, RotaryEmbedding
from testbed.kernels import cpu_native

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def enable(model) -> str | None:
    """Give ``model``'s norms, rotary embedding and MLPs the fused ops, and its
    layers the one-call op where they qualify; None, or why they keep torch's."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype not in FUSED_DTYPES:
        return f"not a float32 or bfloat16 model on a CPU ({weight.dtype}, {weight.device})"
    ops = cpu_native.layer_ops()
    if ops is None:
        return cpu_native.unavailable_reason()
    for module in model.modules():
        if isinstance(module, RMSNorm | RotaryEmbedding | MLP):
            module.ops = ops
    _enable_layers(model, ops)
    return None


def _enable_layers(model, ops) -> None:
    """``model.layer_op`` and each layer's fixed arguments of it, where every layer's
    products are packed and no layer normalises its queries and keys."""
    layers = model.model.layers
    if model.config.qk_norm or any(
        layer.self_attn.packed is None or layer.mlp.packed is None for layer in layers
    ):
        return
    for layer in layers:
        attn = layer.self_attn
        products = [attn.packed["qkv"], attn.packed["o"], layer.mlp.packed["gate_up"]]
        products.append(layer.mlp.packed["down"])
        layer.fused = (
            [layer.input_layernorm.weight, layer.post_attention_layernorm.weight],
            layer.input_layernorm.eps,
            [p.packed for p in products],
            [p.rows_packed for p in products],
            [p.bias for p in products],
            [p.out_features for p in products],
            products[0].max_rows,
            attn.num_heads,
            attn.num_kv_heads,
        )
    model.layer_op = ops.decoder_layer


@contextlib.contextmanager
def layer_by_layer(model):
    """Within the block, ``model``'s layers run op by op from Python (the one-call
    op off), so that hooks on their products and timers around their attention see
    each call."""
    op = getattr(model, "layer_op", None)
    model.layer_op = None
    try:
        yield
    finally:
        model.layer_op = op
