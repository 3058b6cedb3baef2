"""The CPU path (``cpu_attention``) against the reference on engine-shaped batches:
many decodes of spread lengths, bursts of short prompts, chunks after prefixes,
and groups split by their byte budget; and the property it exists for, that a
batch of many sequences runs as a few attention calls."""

from __future__ import annotations

import pytest
import torch

from testbed.kernels import cpu_attention
from testbed.kernels import torch_attention as reference
from tests.kernels.cases import assert_close, decode_inputs, make_case, prefill_inputs


def _calls(monkeypatch) -> list[tuple[int, ...]]:
    """The query shapes of every fused attention call the CPU path makes."""
    calls: list[tuple[int, ...]] = []
    sdpa = cpu_attention.F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("group_bytes", [None, 64 * 1024])
def test_decode_batch_of_spread_lengths_equals_the_reference(monkeypatch, group_bytes):
    if group_bytes is not None:  # many small groups: each still must see only its own keys
        monkeypatch.setattr(cpu_attention, "GROUP_BYTES", group_bytes)
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 400, (48,), generator=g).tolist() + [0, 1, 16]
    case = make_case(lens, 4, 64, 16, torch.float32, g)
    query, expected = decode_inputs(case, 8, g)
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    out = cpu_attention.paged_attention_decode(query, *args)
    assert_close(out, expected, torch.float32)
    assert_close(out, reference.paged_attention_decode(query, *args), torch.float32)


def test_a_burst_of_short_prompts_is_a_few_calls(monkeypatch):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(10, 80, (45,), generator=g).tolist()
    case = make_case(lens, 4, 64, 16, torch.float32, g)
    query, starts, expected = prefill_inputs(case, lens, 8, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125)
    by_reference = reference.paged_attention_prefill(query, *args)
    calls = _calls(monkeypatch)  # (the reference's calls, one per prompt, not counted)
    out = cpu_attention.paged_attention_prefill(query, *args)
    assert_close(out, expected, torch.float32)
    assert_close(out, by_reference, torch.float32)
    assert 1 <= len(calls) <= 8, f"45 prompts took {len(calls)} attention calls"
    assert sum(b for b, *_ in calls) == 45  # each prompt in exactly one call


def test_mixed_step_with_long_chunks_after_prefixes_equals_the_reference():
    """Decodes, whole prompts, and chunks longer than ROW_CHUNK after a cached prefix,
    in one batch (what a chunked-prefill step schedules)."""
    g = torch.Generator().manual_seed(3)
    seq_lens = [700, 600, 40, 33, 1, 300, 290, 18, 2]
    q_lens = [300, 600, 40, 7, 1, 1, 1, 1, 2]  # chunk after prefix, whole prompts, decodes
    assert max(q_lens) > cpu_attention.ROW_CHUNK
    case = make_case(seq_lens, 2, 64, 16, torch.float32, g, unused="-1")
    query, starts, expected = prefill_inputs(case, q_lens, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125)
    out = cpu_attention.paged_attention_prefill(query, *args)
    assert_close(out, expected, torch.float32)
    assert_close(out, reference.paged_attention_prefill(query, *args), torch.float32)


def test_groups_bound_their_padding_and_bytes():
    items = [cpu_attention.Item(i, 1, n, i) for i, n in enumerate(range(20, 900, 7))]
    bytes_per_key = 2 * 4 * 64 * 4
    groups = list(cpu_attention._groups(items, 16, bytes_per_key))
    assert sorted(it for grp in groups for it in grp) == sorted(items)
    for grp in groups:
        width = -(-max(it.keys for it in grp) // 16) * 16
        own = sum(it.work(it.rows, it.keys) for it in grp)
        padded = len(grp) * grp[0].work(grp[0].rows, width)
        assert padded <= cpu_attention.PAD_SLACK * own + cpu_attention.CALL_COST or len(grp) == 1
        assert len(grp) * width * bytes_per_key <= cpu_attention.GROUP_BYTES or len(grp) == 1
    assert len(groups) < len(items) / 4


def test_a_plan_is_reused_only_for_the_same_batch():
    """Layers of a step share one plan; a table changed in place (same tensor object)
    or new lengths get a new one, not the last call's."""
    g = torch.Generator().manual_seed(5)
    case = make_case([40, 17, 90], 2, 64, 16, torch.float32, g)
    query, expected = decode_inputs(case, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    assert_close(cpu_attention.paged_attention_decode(query, *args), expected, torch.float32)
    plan = cpu_attention._last_plan
    cpu_attention.paged_attention_decode(query, *args)
    assert cpu_attention._last_plan is plan
    # Move sequence 0's blocks: same tensors, new contents.
    tables, kc, vc = case.block_tables, case.key_cache, case.value_cache
    taken = set(tables.flatten().tolist())
    free = [b for b in range(kc.shape[0]) if b not in taken][:3]
    assert len(free) == 3
    for old, new in zip(tables[0, :3].tolist(), free, strict=True):
        kc[new], vc[new] = kc[old].clone(), vc[old].clone()
        kc[old], vc[old] = float("nan"), float("nan")
    tables[0, :3] = torch.tensor(free, dtype=tables.dtype)
    out = cpu_attention.paged_attention_decode(query, *args)
    assert cpu_attention._last_plan is not plan
    assert_close(out, expected, torch.float32)


def test_buffers_first_made_under_inference_mode_serve_calls_outside_it():
    # The engine runs under inference mode; tests and tools call the kernels outside it.
    cpu_attention._WORKSPACES.clear()
    g = torch.Generator().manual_seed(9)
    case = make_case([30, 70], 2, 64, 16, torch.float32, g)
    query, expected = decode_inputs(case, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    with torch.inference_mode():
        assert_close(cpu_attention.paged_attention_decode(query, *args), expected, torch.float32)
    assert_close(cpu_attention.paged_attention_decode(query, *args), expected, torch.float32)
