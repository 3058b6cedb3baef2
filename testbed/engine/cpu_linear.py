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
``MLP.packed``, ``CausalLM.packed_head``), outside the module tree.

A few rows (decode steps, short chunks) go instead to the C++ kernel of
``testbed/kernels/cpu_linear_rows.cpp``, whose own packed copy streams each weight
once with no call setup: oneDNN's fixed cost (10-20 us a call) and its speed on a
few rows make it about 2x slower there. ``ROWS`` says up to how many rows, per
dtype. The packed copies triple the linear layers' memory on a CPU.
``TESTBED_CPU_LINEAR=torch`` turns packing off; ``TESTBED_CPU_KERNEL=torch`` (or a
CPU without the instructions) keeps every row count on oneDNN.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from testbed.kernels import cpu_native

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Up to how many rows the C++ kernel computes a product, by dtype (more: oneDNN).
# Measured on 2 AVX-512 BF16 cores, the dummy Llama's 33 products of a step
# streamed from memory (benchmarks/linear_rows.py): in bfloat16 it takes 0.5x
# oneDNN's time for 1-4 rows and 0.9x at 64; in float32 0.5-0.7x up to 8 rows,
# level at 16 and slower past it.
ROWS = {torch.bfloat16: 64, torch.float32: 12}


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` packed for oneDNN. A module (so timing hooks can
    attach to it) that no parent registers: it is not in any ``state_dict``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_ops=None) -> None:
        """``rows_ops``: the C++ ops with ``linear_rows`` for ``weight``'s dtype (None:
        oneDNN for every row count)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.rows_ops, self.max_rows, self.rows_packed = rows_ops, 0, None
        with torch.inference_mode(False), torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.bias = None if bias is None else bias.detach().clone()
            if rows_ops is not None:
                self.max_rows = ROWS.get(weight.dtype, 0)
                self.rows_packed = rows_ops.pack_linear_rows(weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows and x.dim() == 2 and x.is_contiguous():
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            self.rows_ops.linear_rows(out, x, self.rows_packed, self.bias)
            return out
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


def rows_ops(dtype: torch.dtype):
    """The C++ ops that compute a few rows of ``dtype`` (``linear_rows``), or None
    where they are turned off, not built, or lack this dtype's instructions."""
    ops = cpu_native.layer_ops()
    if ops is None or str(dtype).removeprefix("torch.") not in ops.linear_rows_dtypes():
        return None
    return ops


def route(model) -> str:
    """How ``model``'s linear layers run, for reports and benchmark files."""
    head = getattr(model, "packed_head", None)
    if head is not None:
        few = f"up to {head.max_rows} rows in C++, " if head.max_rows else ""
        return f"{few}oneDNN, packed weights (q/k/v and gate/up fused)"
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
    ops = rows_ops(weight.dtype)

    def packed(weight, bias=None):
        return PackedLinear(weight, bias, ops)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat(
                [p.bias if p.bias is not None else p.weight.new_zeros(len(p.weight)) for p in parts]
            )
        attn.packed = {
            "qkv": packed(torch.cat([p.weight for p in parts]), bias),
            "o": packed(attn.o_proj.weight, attn.o_proj.bias),
        }
        mlp.packed = {
            "gate_up": packed(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            "down": packed(mlp.down_proj.weight, mlp.down_proj.bias),
        }
    model.packed_head = packed(weight)
    return None


def packed_linears(model) -> list[PackedLinear]:
    """Every packed product of ``model`` (none where it is not packed)."""
    out = []
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            out += list((getattr(owner, "packed", None) or {}).values())
    return out
