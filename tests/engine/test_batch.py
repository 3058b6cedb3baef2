"""testbed/engine/batch.py: the flattened batch of a forward pass, against the
definition row by row (each token's position, its KV slot through its row's
block table, the padded tables and the per-row lengths)."""

from __future__ import annotations

import random

import pytest
import torch

from testbed.engine.batch import flatten


def by_row(rows, block_size):
    """The batch as defined, one row and one token at a time."""
    ids, positions, slots, q_start, seq_lens = [], [], [], [0], []
    width = max([1] + [len(table) for table, _, _ in rows])
    tables = []
    for table, toks, start in rows:
        for j, tok in enumerate(toks):
            pos = start + j
            ids.append(tok)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        q_start.append(q_start[-1] + len(toks))
        seq_lens.append(start + len(toks))
        tables.append(table + [0] * (width - len(table)))
    return ids, positions, slots, q_start, seq_lens, tables


def random_rows(rng, n, block_size):
    """Decodes, prompts, chunks after a cached prefix and verifications, each
    with a table of distinct shuffled blocks just long enough or longer."""
    blocks = list(range(10_000))
    rng.shuffle(blocks)
    rows = []
    for _ in range(n):
        start = rng.choice([0, rng.randrange(1, 3000)])
        count = rng.choice([1, 1, rng.randrange(2, 6), rng.randrange(1, 700)])
        needed = -(-(start + count) // block_size) + rng.choice([0, 0, 2])
        table, blocks = blocks[:needed], blocks[needed:]
        rows.append((table, [rng.randrange(50_000) for _ in range(count)], start))
    return rows


@pytest.mark.parametrize("seed, n, block_size", [(0, 1, 16), (1, 7, 16), (2, 64, 16), (3, 40, 5)])
def test_the_flattened_batch_is_the_row_by_row_definition(seed, n, block_size):
    rows = random_rows(random.Random(seed), n, block_size)
    ids, positions, meta, q_start = flatten(rows, block_size, torch.device("cpu"))
    want_ids, want_pos, want_slots, want_q, want_lens, want_tables = by_row(rows, block_size)
    assert ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert (
        meta.block_tables.dtype == meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    )
    assert ids.tolist() == want_ids and positions.tolist() == want_pos
    assert meta.slot_mapping.tolist() == want_slots
    assert q_start == want_q and meta.query_start_loc.tolist() == want_q
    assert meta.seq_lens.tolist() == want_lens and meta.max_seq_len == max(want_lens)
    assert meta.max_query_len == max(len(toks) for _, toks, _ in rows)
    assert meta.block_tables.tolist() == want_tables


def test_a_row_without_tokens_keeps_its_place():
    rows = [([3], [7], 4), ([5, 6], [], 20), ([9], [1, 2], 0)]
    ids, positions, meta, q_start = flatten(rows, 16, torch.device("cpu"))
    assert ids.tolist() == [7, 1, 2] and positions.tolist() == [4, 0, 1]
    assert meta.slot_mapping.tolist() == [3 * 16 + 4, 9 * 16, 9 * 16 + 1]
    assert q_start == [0, 1, 1, 3] and meta.seq_lens.tolist() == [5, 20, 2]
    assert meta.block_tables.tolist() == [[3, 0], [5, 6], [9, 0]]


def test_a_token_past_its_rows_block_table_is_refused():
    rows = [([1, 2], [5], 31), ([4], [6, 7], 15)]  # row 1's position 16 needs a second block
    with pytest.raises(ValueError, match=r"row 1: position 16 is past its block table \(1 blocks"):
        flatten(rows, 16, torch.device("cpu"))
