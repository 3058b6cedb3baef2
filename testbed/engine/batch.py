"""One flattened batch for a paged-attention forward pass: each row's tokens
from its first position on, their KV slots from its block table, and the
attention metadata; shared by the target model's step and the draft model's passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from testbed.engine.model import AttentionMetadata


def flatten(
    rows: Sequence[tuple[list[int], list[int], int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """``rows`` of ``(block table, tokens, first position)``: the token ids, their
    positions, the attention metadata and ``query_start_loc`` as a list (row i's
    tokens are ``q_start[i]:q_start[i + 1]`` of the batch)."""
    bs = block_size
    tokens: list[int] = []
    positions, slots, q_start, seq_lens = [], [], [0], []
    max_blocks, max_query = 1, 1
    for table, toks, start in rows:
        end = start + len(toks)
        tokens.extend(toks)
        pos = torch.arange(start, end)
        t = torch.tensor(table, dtype=torch.int64)
        positions.append(pos)
        slots.append(t[pos // bs] * bs + pos % bs)
        q_start.append(q_start[-1] + len(toks))
        seq_lens.append(end)
        max_blocks = max(max_blocks, len(table))
        max_query = max(max_query, len(toks))
    tables = torch.zeros((len(rows), max_blocks), dtype=torch.int32)
    for i, (table, _, _) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max_query,
        max_seq_len=max(seq_lens),
    )
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    return ids, torch.cat(positions).to(device), meta, q_start


def token_slice(req, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of prompt + output + drafts, copying only what is needed."""
    p = req.num_prompt_tokens
    if end <= p:
        return list(req.prompt_token_ids[start:end])
    rest = req.output_token_ids + req.spec_token_ids if req.spec_token_ids else req.output_token_ids
    if start >= p:
        return rest[start - p : end - p]
    return list(req.prompt_token_ids[start:]) + rest[: end - p]
