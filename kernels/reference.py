"""Torch reference implementations of the paged-attention kernels.

They define what the Triton kernels compute and are what the engine runs on CPU,
so they are vectorized: decode gathers each sequence's K/V through its block table
into a padded batch (sequences grouped by length so that one long context does not
pad every other one), prefill loops over sequences and sends its length-1 chunks
(decodes in a mixed batch) through the batched decode path. Math is in fp32; the
output has the query's dtype.

Layouts (shared with ``kernels.triton_kernels``):

- ``key_cache``, ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
- ``block_tables``: ``int32 [num_seqs, max_blocks_per_seq]``; entries past a sequence's
  last block may hold anything (0, -1, ...) and are never read
- ``slot_mapping``: ``int [num_tokens]``, slot ``s`` is block ``s // block_size``, offset
  ``s % block_size``; ``-1`` marks a padding token that is not written
- grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

__all__ = ["paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    In place; tokens whose slot is ``-1`` are skipped.
    """
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


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
    """One query token per sequence over its first ``context_lens[i]`` cached tokens.

    ``query`` is ``[num_seqs, num_heads, head_dim]``; returns the same shape and dtype.
    A sequence with a context of 0 gets zeros. ``max_context_len`` is a hint the Triton
    version uses to size its grid without a device sync; here it is not needed.
    """
    out = torch.zeros_like(query)
    if query.shape[0] == 0:
        return out
    lens = context_lens.long()
    # Pad each sequence to the next power of two of its length and batch those that
    # share it: padding costs at most 2x, whatever the spread of lengths.
    bucket = torch.ceil(torch.log2(lens.clamp(min=1).double())).long().masked_fill_(lens == 0, -1)
    for b in torch.unique(bucket).tolist():
        if b < 0:
            continue
        idx = torch.nonzero(bucket == b).squeeze(1)
        out[idx] = _decode_group(
            query[idx], key_cache, value_cache, block_tables[idx], lens[idx], scale
        )
    return out


def _decode_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs, num_heads, head_dim = query.shape
    max_len = int(lens.max())
    pos = torch.arange(max_len, device=query.device)
    valid = pos[None, :] < lens[:, None]  # [S, T]
    blocks = block_tables[:, : (max_len + block_size - 1) // block_size].long()
    slots = blocks.gather(1, (pos // block_size).expand(num_seqs, -1)) * block_size
    slots = slots + pos % block_size
    # Padding reads the sequence's own first token (written, finite) rather than a
    # table entry past its end, which may hold anything (NaN * weight 0 is NaN).
    slots = torch.where(valid, slots, slots[:, :1]).view(-1)
    k = key_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    v = value_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    k = k.view(num_seqs, max_len, kv_heads, head_dim).float()
    v = v.view(num_seqs, max_len, kv_heads, head_dim).float()
    # Grouped-query attention without expanding K/V: [S, KVH, G, D] x [S, KVH, D, T].
    q = query.float().view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).mul_(scale)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.permute(0, 2, 1, 3))
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


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
    """Causal attention for variable-length query chunks over a paged, cached prefix.

    Sequence ``i``'s queries are ``query[query_start_loc[i]:query_start_loc[i + 1]]``,
    the last ``q_len`` of its ``seq_lens[i]`` tokens (all of whose K/V are in the
    cache); query ``j`` sits at position ``seq_lens[i] - q_len + j`` and attends to
    positions up to its own. ``query`` is ``[num_query_tokens, num_heads, head_dim]``;
    returns the same shape and dtype.
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in itertools.pairwise(starts)]
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        if q_len > n:
            raise ValueError(f"sequence {i}: {q_len} queries but only {n} tokens in total")
    singles = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if singles:
        rows = query_start_loc[singles].long()
        out[rows] = paged_attention_decode(
            query[rows],
            key_cache,
            value_cache,
            block_tables[singles],
            seq_lens[singles],
            scale,
        )
    block_size = key_cache.shape[1]
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        if q_len <= 1:
            continue
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float()  # [n, KVH, D]
        v = value_cache[blocks].flatten(0, 1)[:n].float()
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H, D]
        q_pos = torch.arange(n - q_len, n, device=query.device)
        causal = torch.arange(n, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(query.dtype)
    return out
