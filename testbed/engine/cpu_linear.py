"""Linear layers on a CPU through oneDNN with each weight packed once, and the
projections that read the same input fused into one product.

torch's ``F.linear`` on a CPU reorders the weight into the GEMM library's blocked
layout on every call; for the few rows of a decode step that reorder costs as much
as the product. oneDNN's packed weights (torch's own ``mkldnn`` ops, those
inductor's CPU weight freezing uses) are reordered once, at engine build. Measured
on 2 AVX-512 cores (``docs/engine_vs_vllm.md``): 2-3x faster for 1-8 rows in
bfloat16 and float32, 10-30% for 16-48 rows. The query, key and value projections
become one product, as do the MLP's gate and up projections: fewer, wider calls.

The modules keep their own weights (checkpoint loading, ``state_dict`` and the
weights shared with a draft model see nothing new); the packed copies live beside
them in plain attributes the forward pass reads (``Attention.packed``,
``MLP.packed``, ``CausalLM.packed_head``), outside the module tree. They double
the linear layers' memory on a CPU. ``TESTBED_CPU_LINEAR=torch`` turns packing off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` packed for oneDNN. A module (so timing hooks can
    attach to it) that no parent registers: it is not in any ``state_dict``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode(False), torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def enabled() -> bool:
    """Whether packing may be used (``TESTBED_CPU_LINEAR`` is not ``torch``)."""
    return os.environ.get("TESTBED_CPU_LINEAR", "onednn").strip().lower() != "torch"


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why linear layers of ``dtype`` run through ``F.linear`` here (None: they are
    packed)."""
    if not enabled():
        return "turned off (TESTBED_CPU_LINEAR=torch)"
    if dtype not in PACKED_DTYPES:
        return f"{dtype} is not packed (only float32 and bfloat16)"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 support in oneDNN"
    return None


def route(model) -> str:
    """How ``model``'s linear layers run, for reports and benchmark files."""
    if getattr(model, "packed_head", None) is not None:
        return "oneDNN, packed weights (q/k/v and gate/up fused)"
    dtype = next(model.parameters()).dtype
    return f"F.linear: {unavailable_reason(dtype) or 'not packed'}"


def pack(model) -> str | None:
    """Pack ``model``'s linear layers (a CPU ``CausalLM``) in place and fuse its
    q/k/v and gate/up projections; None, or why it was left as it is. Packing
    twice (a model shared by two engines) does nothing more."""
    if getattr(model, "packed_head", None) is not None:
        return None
    weight = model.lm_head.weight
    if weight.device.type != "cpu":
        return "not on a CPU"
    reason = unavailable_reason(weight.dtype)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat(
                [p.bias if p.bias is not None else p.weight.new_zeros(len(p.weight)) for p in parts]
            )
        attn.packed = {
            "qkv": PackedLinear(torch.cat([p.weight for p in parts]), bias),
            "o": PackedLinear(attn.o_proj.weight, attn.o_proj.bias),
        }
        mlp.packed = {
            "gate_up": PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None),
            "down": PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias),
        }
    model.packed_head = PackedLinear(weight, None)
    return None


def packed_linears(model) -> list[PackedLinear]:
    """Every packed product of ``model`` (none where it is not packed)."""
    out = []
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            out += list((getattr(owner, "packed", None) or {}).values())
    return out
