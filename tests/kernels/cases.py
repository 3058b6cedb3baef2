"""Paged test cases built from dense per-sequence K/V, and the dense attention they
must agree with.

A case scatters each sequence's contiguous K/V into shuffled cache blocks and fills
everything else in the caches with NaN, so a kernel that reads a slot past a
context, or follows a block-table entry past a sequence's last block, returns NaN.
Unused table entries hold -1 (out of range) or the id of a NaN "poison" block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


@dataclass
class PagedCase:
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    slots: list[torch.Tensor]  # per sequence, the slot of each token

    @property
    def slot_mapping(self) -> torch.Tensor:
        return torch.cat(self.slots)


def make_case(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    *,
    unused: str = "poison",
    spare_blocks: int = 3,
    spare_columns: int = 2,
) -> PagedCase:
    """Random K/V for sequences of ``seq_lens`` tokens, paged into shuffled blocks."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks + 1  # + 1: the poison block
    order = torch.randperm(num_blocks, generator=generator).tolist()
    poison, order = order[0], order[1:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(needed, default=0) + spare_columns
    filler = poison if unused == "poison" else -1
    block_tables = torch.full((len(seq_lens), width), filler, dtype=torch.int32)
    keys, values, slots = [], [], []
    for i, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(needed[i])]
        block_tables[i, : needed[i]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        pos = torch.arange(n)
        block_ids = torch.tensor(blocks, dtype=torch.long)[pos // block_size]
        key_cache[block_ids, pos % block_size] = k
        value_cache[block_ids, pos % block_size] = v
        keys.append(k)
        values.append(v)
        slots.append(block_ids * block_size + pos % block_size)
    return PagedCase(
        keys,
        values,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        slots,
    )


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` ``[q_len, H, D]`` (the last ``q_len`` tokens) over
    contiguous ``keys``/``values`` ``[n, KVH, D]``, in float64, written out longhand."""
    q_len, n = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [n, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    q_pos = torch.arange(n - q_len, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def decode_inputs(
    case: PagedCase, num_heads: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[num_seqs, num_heads, head_dim]`` and the dense answer for decode."""
    dtype, head_dim = case.key_cache.dtype, case.key_cache.shape[-1]
    query = torch.randn(len(case.keys), num_heads, head_dim, generator=generator).to(dtype)
    expected = torch.zeros(query.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        if k.shape[0]:
            expected[i] = dense_attention(query[i : i + 1], k, v, head_dim**-0.5)[0]
    return query, expected


def prefill_inputs(
    case: PagedCase, q_lens: list[int], num_heads: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, ``query_start_loc`` and the dense answer for chunks of ``q_lens``."""
    dtype, head_dim = case.key_cache.dtype, case.key_cache.shape[-1]
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(dtype)
    expected = torch.zeros(query.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        a, b = int(starts[i]), int(starts[i + 1])
        if b > a:
            expected[a:b] = dense_attention(query[a:b], k, v, head_dim**-0.5)
    return query, starts, expected


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert not actual.isnan().any(), (
        "NaN in the output: an unused slot read, or a row left nothing to attend to"
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


def chunk_lens(seq_lens: list[int], generator: torch.Generator) -> list[int]:
    """A mixed batch: whole prompts, chunks after a cached prefix, and decodes."""
    q_lens = []
    for i, n in enumerate(seq_lens):
        kind = i % 3
        if kind == 0 or n == 1:
            q_lens.append(n)
        elif kind == 1:
            q_lens.append(int(torch.randint(1, n + 1, (1,), generator=generator)))
        else:
            q_lens.append(1)
    return q_lens
