"""Paged-attention kernels: Triton on CUDA and a torch path for CPUs, each beside a
torch reference with the same signature (the real engine's hot path).

Three operations, in three modules with identical signatures:

- ``testbed.kernels.torch_attention``: torch, any device; the definition of what is computed.
- ``testbed.kernels.cpu_attention``: shaped for CPUs, what the engine runs on CPU: short
  queries through a C++ kernel that reads K/V through the block table
  (``cpu_native``, compiled on first use), long ones as whole blocks gathered and one
  torch fused attention call per group of similar sequences.
- ``testbed.kernels.triton_kernels``: Triton, CUDA tensors (or CPU tensors in the Triton
  interpreter, ``TRITON_INTERPRET=1`` set before it is imported); imported lazily.

``testbed.kernels.reshape_and_cache``, ``testbed.kernels.paged_attention_decode`` and
``testbed.kernels.paged_attention_prefill`` dispatch on the tensors' device: Triton when they
are on CUDA and triton is importable, ``cpu_attention`` otherwise.
``select_backend("auto" | "triton" | "cpu" | "torch", device)`` returns the module to
call once (what the engine holds as its ``backend``).

Shared layout: K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
(separate tensors), ``int32`` block tables ``[num_seqs, max_blocks_per_seq]`` whose
unused entries are never read, slot ``s`` = block ``s // block_size``, offset
``s % block_size``, and grouped-query attention (query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from testbed.kernels import cpu_attention, torch_attention

__all__ = [
    "cpu_attention",
    "describe",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "select_backend",
    "torch_attention",
    "triton_kernels",
]

BACKENDS = ("auto", "triton", "cpu", "torch")


def describe(backend: ModuleType) -> str:
    """A backend module's name, with how it runs here where it says (its optional
    ``route()``: the CPU path's route for short queries)."""
    route = getattr(backend, "route", None)
    return f"{backend.__name__} ({route()})" if route is not None else backend.__name__


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports here (it is absent on some CPU-only machines)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_module() -> ModuleType:
    return importlib.import_module("testbed.kernels.triton_kernels")


def select_backend(name: str = "auto", device: torch.device | str | None = None) -> ModuleType:
    """The module whose ``reshape_and_cache`` / ``paged_attention_*`` to call on ``device``.

    ``"torch"``: the reference. ``"cpu"``: the torch path shaped for CPUs (it runs on
    any device, but is tuned for none other). ``"auto"``: Triton on a CUDA device with
    triton installed, the reference on another GPU, the CPU path on a CPU.
    ``"triton"``: Triton, or a ``RuntimeError`` that says why not: it needs triton and
    a CUDA device, except that ``TRITON_INTERPRET=1`` (set before the kernels are
    imported) runs it on CPU tensors in the interpreter.
    ``device`` defaults to CUDA where there is one, else CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if name == "torch":
        return torch_attention
    if name == "cpu":
        return cpu_attention
    if name == "auto":
        if on_cuda and triton_available():
            return _triton_module()
        return cpu_attention if device.type == "cpu" else torch_attention
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}: expected one of {BACKENDS}")
    if not triton_available():
        raise RuntimeError(
            "attention backend 'triton' needs the triton package, which is not installed; "
            "use backend 'torch' (or 'auto')"
        )
    if on_cuda:
        return _triton_module()
    if not _interpreting():
        raise RuntimeError(
            f"attention backend 'triton' needs a CUDA device, and the device is {device} "
            f"(torch.cuda.is_available() = {torch.cuda.is_available()}); use backend 'torch' "
            "or 'auto', or set TRITON_INTERPRET=1 before importing kernels to run the Triton "
            "kernels on CPU in the (slow) interpreter"
        )
    module = _triton_module()
    if not module.INTERPRETED:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after testbed.kernels.triton_kernels had been imported, "
            "so its kernels were compiled for a GPU; set it before the first import"
        )
    return module


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into their cache slots (slot -1: skipped). In place."""
    select_backend("auto", key_cache.device).reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping
    )


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached context (see
    ``testbed.kernels.torch_attention``)."""
    return select_backend("auto", query.device).paged_attention_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len=max_context_len,
    )


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Causal variable-length query chunks over a paged prefix (see
    ``testbed.kernels.torch_attention``)."""
    return select_backend("auto", query.device).paged_attention_prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_context_len=max_context_len,
    )


def __getattr__(name: str) -> ModuleType:
    # ``testbed.kernels.triton_kernels`` without importing triton until someone asks for it.
    if name == "triton_kernels":
        return _triton_module()
    raise AttributeError(f"module 'testbed.kernels' has no attribute {name!r}")
