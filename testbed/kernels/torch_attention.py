"""Torch reference implementations of the paged-attention kernels.

They define what the Triton kernels and the CPU path (``cpu_attention``) compute,
and run as an engine's backend with ``attention_backend=torch``. They are
vectorized: decode gathers each sequence's K/V through its block table
into a padded batch (sequences grouped by length so that one long context does not
pad every other one), prefill loops over sequences and sends its length-1 chunks
(decodes in a mixed batch) through the batched decode path. Math is in fp32; the
output has the query's dtype.

Layouts (shared with ``testbed.kernels.triton_kernels``):

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
    lens = context_lens.long()
    # Longest first: then the sequences that still have tokens in a chunk are a
    # prefix of the batch, and the work is the sum of the contexts, not
    # batch x longest (see _decode_sorted).
    order = torch.argsort(lens, descending=True, stable=True)
    live = order[lens[order] > 0]
    if live.numel():
        out[live] = _decode_sorted(
            query[live], key_cache, value_cache, block_tables[live], lens[live], scale
        )
    return out


DECODE_CHUNK = 256  # tokens of K/V gathered at a time: small temporaries that stay in cache
PREFILL_CHUNK = 256  # query rows at a time: keys past a chunk's last position are skipped


def _decode_sorted(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Flash-decoding in torch, for sequences sorted longest first (all non-empty).

    K/V are gathered ``DECODE_CHUNK`` tokens at a time, only for the sequences
    that reach into the chunk, and combined with a running (max, sum) softmax: no
    [seqs, context] copy of the cache is ever made (on a CPU that copy, not the
    arithmetic, is the cost), and the work grows with the sum of the contexts."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // kv_heads
    dev = query.device
    lens_list = lens.tolist()
    # Grouped-query attention without expanding K/V: [S, KVH, G, D] x [S, KVH, D, T].
    q = query.float().view(num_seqs, kv_heads, group, head_dim) * scale
    m = torch.full((num_seqs, kv_heads, group), float("-inf"), device=dev)
    denom = torch.zeros(num_seqs, kv_heads, group, device=dev)
    acc = torch.zeros(num_seqs, kv_heads, group, head_dim, device=dev)
    keys = key_cache.view(-1, kv_heads, head_dim)
    values = value_cache.view(-1, kv_heads, head_dim)
    tables = block_tables.long()
    active = num_seqs
    for start in range(0, lens_list[0], DECODE_CHUNK):
        while lens_list[active - 1] <= start:  # sorted: the finished ones are at the end
            active -= 1
        end = min(lens_list[0], start + DECODE_CHUNK)
        n = end - start
        pos = torch.arange(start, end, device=dev)
        valid = pos[None, :] < lens[:active, None]  # [A, n]
        slots = tables[:active].gather(1, (pos // block_size).expand(active, -1))
        slots = slots * block_size + pos % block_size
        # Padding reads the sequence's own first token (written, finite) rather than
        # a table entry past its end, which may hold anything (NaN * weight 0 is NaN).
        slots = torch.where(valid, slots, tables[:active, :1] * block_size).view(-1)
        k = keys.index_select(0, slots).view(active, n, kv_heads, head_dim).float()
        v = values.index_select(0, slots).view(active, n, kv_heads, head_dim).float()
        scores = torch.matmul(q[:active], k.permute(0, 2, 3, 1))  # [A, KVH, G, n]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        # Every active sequence has a token in this chunk: the new max is finite.
        m_new = torch.maximum(m[:active], scores.amax(-1))
        p = torch.exp(scores - m_new[..., None])
        correction = torch.exp(m[:active] - m_new)
        denom[:active] = denom[:active] * correction + p.sum(-1)
        acc[:active] = acc[:active] * correction[..., None] + torch.matmul(p, v.permute(0, 2, 1, 3))
        m[:active] = m_new
    out = acc / denom[..., None]
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
    dev = query.device
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        if q_len <= 1:
            continue
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float().transpose(0, 1)  # [KVH, n, D]
        v = value_cache[blocks].flatten(0, 1)[:n].float().transpose(0, 1)
        # Query rows in chunks, each against the keys up to its last position only:
        # about half the work of one masked [q_len, n] product for a long prompt.
        for a in range(0, q_len, PREFILL_CHUNK):
            b = min(q_len, a + PREFILL_CHUNK)
            last = n - q_len + b  # keys this chunk may see
            q = query[starts[i] + a : starts[i] + b].float().transpose(0, 1)  # [H, c, D]
            q_pos = torch.arange(n - q_len + a, last, device=dev)
            causal = torch.arange(last, device=dev)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q, k[:, :last], v[:, :last], attn_mask=causal, scale=scale, enable_gqa=True
            )
            out[starts[i] + a : starts[i] + b] = o.transpose(0, 1).to(query.dtype)
    return out
