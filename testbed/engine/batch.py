"""One flattened batch for a paged-attention forward pass: each row's tokens
from its first position on, their KV slots from its block table, and the
attention metadata; shared by the target model's step and the draft model's passes.

Built with a few whole-batch array operations rather than tensors per row: a
step's preparation runs on the host before every forward pass, and per-row
tensor calls (about 40 us a row on a 2-core VM) made it most of a small model's
decode step at a batch of 256."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from testbed.engine.model import AttentionMetadata


def flatten(
    rows: Sequence[tuple[list[int], list[int], int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """``rows`` of ``(block table, tokens, first position)``: the token ids, their
    positions, the attention metadata and ``query_start_loc`` as a list (row i's
    tokens are ``q_start[i]:q_start[i + 1]`` of the batch)."""
    n = len(rows)
    tokens, lens, q_start = _ragged([toks for _, toks, _ in rows], np.int64)
    starts = np.fromiter((start for _, _, start in rows), np.int64, n)
    row = np.repeat(np.arange(n), lens)  # each token's row
    positions = starts[row] + np.arange(len(tokens)) - q_start[row]
    # The block tables, padded with 0 to the longest.
    flat, widths, offsets = _ragged([table for table, _, _ in rows], np.int32)
    tables = np.zeros((n, max(1, int(widths.max(initial=0)))), np.int32)
    table_row = np.repeat(np.arange(n), widths)
    tables[table_row, np.arange(len(flat)) - offsets[table_row]] = flat
    block = positions // block_size
    beyond = block >= widths[row]
    if beyond.any():
        i = int(row[beyond.argmax()])
        raise ValueError(
            f"row {i}: position {int(positions[beyond.argmax()])} is past its block table "
            f"({int(widths[i])} blocks of {block_size})"
        )
    slots = tables[row, block].astype(np.int64) * block_size + positions % block_size
    seq_lens = starts + lens
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        query_start_loc=torch.from_numpy(q_start.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        max_query_len=max(1, int(lens.max(initial=0))),
        max_seq_len=int(seq_lens.max()),
    )
    ids = torch.from_numpy(tokens).to(device)
    return ids, torch.from_numpy(positions).to(device), meta, q_start.tolist()


def _ragged(lists: Sequence[list[int]], dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``lists`` end to end, their lengths, and where each starts (with the total last)."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return np.fromiter(chain.from_iterable(lists), dtype, int(offsets[-1])), lens, offsets


def token_slice(req, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of prompt + output + drafts, copying only what is needed."""
    p = req.num_prompt_tokens
    if end <= p:
        return list(req.prompt_token_ids[start:end])
    rest = req.output_token_ids + req.spec_token_ids if req.spec_token_ids else req.output_token_ids
    if start >= p:
        return rest[start - p : end - p]
    return list(req.prompt_token_ids[start:]) + rest[: end - p]
