"""Triton kernels against the references on CUDA at realistic shapes (bf16, head_dim
128, 32 query heads over 8 KV heads, contexts up to 4k)."""

from __future__ import annotations

import pytest
import torch

from testbed.kernels import torch_attention as reference
from tests.kernels.cases import TOLERANCE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def paged_cache(seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int):
    """Random caches with shuffled blocks per sequence and NaN everywhere unwritten."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 8
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    order = torch.randperm(num_blocks, generator=g, device="cuda")
    width = max(needed) + 4
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device="cuda")
    slots = []
    used = 0
    for i, n in enumerate(seq_lens):
        blocks = order[used : used + needed[i]]
        used += needed[i]
        tables[i, : needed[i]] = blocks.int()
        pos = torch.arange(n, device="cuda")
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    t = slot_mapping.numel()
    key = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(dtype)
    value = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(dtype)
    return key, value, key_cache, value_cache, tables, slot_mapping, g


def check(actual, expected, dtype):
    assert not actual.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reshape_and_cache_cuda(block_size, dtype):
    from testbed.kernels import triton_kernels as tk

    key, value, kc, vc, _, slots, _ = paged_cache([100, 4096, 1], block_size, dtype, 0)
    slots = slots.clone()
    slots[::7] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    reference.reshape_and_cache(key, value, kc, vc, slots)
    tk.reshape_and_cache(key, value, kc2, vc2, slots)
    torch.testing.assert_close(kc2, kc, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(vc2, vc, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("hint", [True, False])
def test_decode_cuda(block_size, batch, hint):
    from testbed.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    seq_lens[0] = 4096
    dtype = torch.bfloat16
    key, value, kc, vc, tables, slots, g = paged_cache(seq_lens, block_size, dtype, batch)
    reference.reshape_and_cache(key, value, kc, vc, slots)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=g, device="cuda").to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (query, kc, vc, tables, lens, HEAD_DIM**-0.5)
    want = reference.paged_attention_decode(*args)
    got = tk.paged_attention_decode(*args, max_context_len=max(seq_lens) if hint else None)
    check(got, want, dtype)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_cuda_mixed_batch(block_size, dtype):
    from testbed.kernels import triton_kernels as tk

    # Whole prompts, chunks after a cached prefix, and decodes, up to 4k tokens.
    seq_lens = [4096, 3000, 1500, 513, 17, 2048, 1, 900]
    q_lens = [4096, 1000, 1, 513, 17, 1, 1, 128]
    key, value, kc, vc, tables, slots, g = paged_cache(seq_lens, block_size, dtype, 1)
    reference.reshape_and_cache(key, value, kc, vc, slots)
    starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g, device="cuda").to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (query, kc, vc, tables, starts, lens, HEAD_DIM**-0.5)
    check(tk.paged_attention_prefill(*args), reference.paged_attention_prefill(*args), dtype)


def test_auto_dispatch_picks_triton_on_cuda():
    from testbed import kernels

    assert kernels.select_backend("auto", "cuda") is kernels.triton_kernels
    assert kernels.select_backend("triton", "cuda") is kernels.triton_kernels
