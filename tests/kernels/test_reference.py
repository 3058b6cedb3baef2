"""The torch paths against dense attention over unpaged K/V: the reference (the
definition) and the CPU path (``cpu_attention``, what the engine runs on CPU), each
test run on both."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kernels import cpu_attention
from testbed.kernels import torch_attention as reference
from tests.kernels.cases import (
    assert_close,
    chunk_lens,
    decode_inputs,
    make_case,
    prefill_inputs,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(4, 4), (4, 2), (8, 2), (6, 2)]  # (num_heads, num_kv_heads): ratios 1, 2, 4, 3


@pytest.fixture(params=["reference", "cpu", "cpu-torch"])
def attention(request, monkeypatch):
    """The reference, the CPU path with its C++ kernel for short queries (skipped
    where it cannot be built), and the CPU path on torch alone."""
    if request.param == "reference":
        return reference
    if request.param == "cpu-torch":
        monkeypatch.setenv("TESTBED_CPU_KERNEL", "torch")
    else:
        request.getfixturevalue("native")
    return cpu_attention


def ragged_lens(block_size: int, generator: torch.Generator) -> list[int]:
    """One token, exactly one and two blocks, one past a boundary, and random lengths."""
    fixed = [1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1]
    return fixed + torch.randint(1, 50, (3,), generator=generator).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 32])
@pytest.mark.parametrize("unused", ["poison", "-1"])
def test_reshape_and_cache(dtype, block_size, unused):
    g = torch.Generator().manual_seed(block_size)
    case = make_case([5, 1, 19], 2, 64, block_size, dtype, g, unused=unused)
    slots = case.slot_mapping
    key, value = torch.cat(case.keys), torch.cat(case.values)
    # Padding tokens (slot -1) carry junk that must not land anywhere.
    slots = torch.cat([slots, torch.full((3,), -1)])
    key = torch.cat([key, torch.full((3, 2, 64), 7.0, dtype=dtype)])
    value = torch.cat([value, torch.full((3, 2, 64), 7.0, dtype=dtype)])
    order = torch.randperm(len(slots), generator=g)
    key_cache = torch.full_like(case.key_cache, float("nan"))
    value_cache = torch.full_like(case.value_cache, float("nan"))
    assert (
        reference.reshape_and_cache(key[order], value[order], key_cache, value_cache, slots[order])
        is None
    )
    torch.testing.assert_close(key_cache, case.key_cache, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, case.value_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_matches_dense(dtype, heads, block_size, seed, attention):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    case = make_case(
        ragged_lens(block_size, g),
        num_kv_heads,
        64,
        block_size,
        dtype,
        g,
        unused="poison" if seed else "-1",
    )
    query, expected = decode_inputs(case, num_heads, g)
    out = attention.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 64**-0.5
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_head_dims(head_dim, attention):
    g = torch.Generator().manual_seed(head_dim)
    case = make_case([3, 16, 17, 40], 2, head_dim, 16, torch.float32, g)
    query, expected = decode_inputs(case, 4, g)
    out = attention.paged_attention_decode(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        head_dim**-0.5,
    )
    assert_close(out, expected, torch.float32)


def test_decode_context_zero_gives_zeros(attention):
    g = torch.Generator().manual_seed(0)
    case = make_case([0, 5], 1, 64, 4, torch.float32, g)
    query, expected = decode_inputs(case, 2, g)
    out = attention.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_matches_dense(dtype, heads, block_size, seed, attention):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(100 + seed)
    seq_lens = ragged_lens(block_size, g)
    case = make_case(
        seq_lens, num_kv_heads, 64, block_size, dtype, g, unused="poison" if seed else "-1"
    )
    q_lens = chunk_lens(seq_lens, g)
    query, starts, expected = prefill_inputs(case, q_lens, num_heads, g)
    out = attention.paged_attention_prefill(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        starts,
        case.seq_lens,
        64**-0.5,
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_prefill_head_dims_and_empty_chunk(head_dim, attention):
    g = torch.Generator().manual_seed(head_dim)
    seq_lens = [20, 7, 33, 1]
    case = make_case(seq_lens, 2, head_dim, 8, torch.float32, g)
    query, starts, expected = prefill_inputs(case, [20, 0, 9, 1], 4, g)  # a 0-token chunk
    out = attention.paged_attention_prefill(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        starts,
        case.seq_lens,
        head_dim**-0.5,
    )
    assert_close(out, expected, torch.float32)


def test_prefill_of_single_tokens_is_decode(attention):
    g = torch.Generator().manual_seed(3)
    case = make_case([1, 9, 16, 17, 30], 2, 64, 4, torch.float16, g)
    query, expected = decode_inputs(case, 8, g)
    starts = torch.arange(6, dtype=torch.int32)
    args = (case.key_cache, case.value_cache, case.block_tables)
    prefill = attention.paged_attention_prefill(query, *args, starts, case.seq_lens, 0.125)
    decode = attention.paged_attention_decode(query, *args, case.seq_lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=0, rtol=0)


def test_prefill_rejects_more_queries_than_tokens(attention):
    g = torch.Generator().manual_seed(0)
    case = make_case([4], 1, 64, 4, torch.float32, g)
    query = torch.zeros(5, 1, 64)
    with pytest.raises(ValueError, match="5 queries but only 4 tokens"):
        attention.paged_attention_prefill(
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            torch.tensor([0, 5], dtype=torch.int32),
            case.seq_lens,
            1.0,
        )


@pytest.mark.parametrize("path", ["reference", "cpu", "cpu-torch"])
@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 9),
    group=st.sampled_from([1, 2, 3]),
    seqs=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_prefill_any_block_size(path, block_size, group, seqs, seed):
    """Any block size (not only powers of two), any chunk of any length."""
    attention = reference if path == "reference" else cpu_attention
    seq_lens = [n for n, _ in seqs]
    q_lens = [min(n, q) for n, q in seqs]
    g = torch.Generator().manual_seed(seed)
    case = make_case(seq_lens, 2, 64, block_size, torch.float32, g)
    query, starts, expected = prefill_inputs(case, q_lens, 2 * group, g)
    kernel = "torch" if path == "cpu-torch" else "native"
    with mock.patch.dict(os.environ, {"TESTBED_CPU_KERNEL": kernel}):
        out = attention.paged_attention_prefill(
            query, case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125
        )
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_contexts_cross_the_references_chunks(block_size, attention):
    """Contexts and prompts longer than DECODE_CHUNK / PREFILL_CHUNK (256): the online
    softmax across chunks and the per-chunk key limits must match dense attention."""
    g = torch.Generator().manual_seed(block_size)
    lens = [1, 255, 256, 257, 700, 513]
    case = make_case(lens, 2, 64, block_size, torch.float32, g, unused="poison")
    query, expected = decode_inputs(case, 4, g)
    out = attention.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert_close(out, expected, torch.float32)
    q_lens = [1, 255, 10, 257, 700, 300]  # whole prompts and chunks after a prefix
    query, starts, expected = prefill_inputs(case, q_lens, 4, g)
    out = attention.paged_attention_prefill(
        query, case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125
    )
    assert_close(out, expected, torch.float32)
