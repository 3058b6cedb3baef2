"""The Triton kernels against the torch references, in the Triton interpreter on CPU.

Not collected by pytest on its own (the name does not start with ``test_``):
``test_triton_interpreter.py`` runs this file in a subprocess with
``TRITON_INTERPRET=1``, which has to be set before ``testbed.kernels.triton_kernels`` is
imported and must not leak into the other tests of the same process. Run it by hand
with ``TRITON_INTERPRET=1 python -m pytest tests/kernels/interp_cases.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 set before import", allow_module_level=True)

from testbed import kernels
from testbed.kernels import torch_attention as reference
from tests.kernels.cases import assert_close, chunk_lens, make_case

tk = kernels.select_backend("triton", "cpu")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every pair of values of (dtype, heads, block size, head dim, seed) in some case,
# heads as (num_heads, num_kv_heads) of GQA ratios 1, 2 and 4:
# 9 cases instead of the 72 of every combination (a pairwise covering array), as
# most kernel faults show with one parameter or an interaction of two.
PAIRWISE = [
    (torch.float32, (4, 4), 16, 80, 0),
    (torch.float32, (4, 2), 32, 64, 1),
    (torch.float32, (8, 2), 16, 64, 1),
    (torch.float16, (4, 4), 32, 64, 0),
    (torch.float16, (4, 2), 16, 64, 1),
    (torch.float16, (8, 2), 32, 80, 1),
    (torch.bfloat16, (4, 4), 32, 64, 1),
    (torch.bfloat16, (4, 2), 32, 80, 0),
    (torch.bfloat16, (8, 2), 16, 80, 0),
]


def small_lens(block_size: int, generator: torch.Generator) -> list[int]:
    """A context of one token, one ending on a block boundary, one just past it, and a
    random one, all within ~40 tokens."""
    return [1, block_size, block_size + 1, int(torch.randint(2, 41, (1,), generator=generator))]


def decode_both(case, query, scale, **split):
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    want = reference.paged_attention_decode(*args)
    got = tk._decode(*args, **split) if split else tk.paged_attention_decode(*args)
    return got, want


def check_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, seed, seq_lens=None):
    g = torch.Generator().manual_seed(seed)
    seq_lens = seq_lens or small_lens(block_size, g)
    case = make_case(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, g, unused=("poison", "-1")[seed % 2]
    )
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    got, want = decode_both(case, query, scale)
    assert_close(got, want, dtype)
    # Forced splits of 16 tokens (tiles of 16): several splits per sequence, reduced.
    splits = -(-max(seq_lens) // 16)
    got, _ = decode_both(case, query, scale, num_splits=splits, tokens_per_split=16, block_n=16)
    assert_close(got, want, dtype)
    # 2 tiles per split: shorter sequences leave whole splits empty (never reduced).
    splits = -(-max(seq_lens) // 32)
    got, _ = decode_both(case, query, scale, num_splits=splits, tokens_per_split=32, block_n=16)
    assert_close(got, want, dtype)


def check_prefill(num_heads, num_kv_heads, head_dim, block_size, dtype, seed, seq_lens=None):
    g = torch.Generator().manual_seed(1000 + seed)
    seq_lens = seq_lens or small_lens(block_size, g)
    case = make_case(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, g, unused=("poison", "-1")[seed % 2]
    )
    q_lens = chunk_lens(seq_lens, g)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens)
    want = reference.paged_attention_prefill(*args, head_dim**-0.5)
    assert_close(tk.paged_attention_prefill(*args, head_dim**-0.5), want, dtype)
    # Small tiles: several query tiles and key tiles per sequence.
    got = tk._prefill(*args, head_dim**-0.5, block_m=16, block_n=16)
    assert_close(got, want, dtype)


# --------------------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_reshape_and_cache(dtype, block_size, head_dim):
    g = torch.Generator().manual_seed(block_size + head_dim)
    case = make_case([5, 1, 40], 2, head_dim, block_size, dtype, g)
    slots = torch.cat([case.slot_mapping, torch.full((3,), -1)])  # 3 padding tokens
    junk = torch.full((3, 2, head_dim), 7.0, dtype=dtype)
    key, value = torch.cat([*case.keys, junk]), torch.cat([*case.values, junk])
    order = torch.randperm(len(slots), generator=g)
    caches = {}
    for name, module in [("torch", reference), ("triton", tk)]:
        kc, vc = torch.full_like(case.key_cache, float("nan")), torch.full_like(case.value_cache, 0)
        assert module.reshape_and_cache(key[order], value[order], kc, vc, slots[order]) is None
        caches[name] = kc, vc
    for ours, theirs in zip(caches["triton"], caches["torch"]):
        torch.testing.assert_close(ours, theirs, equal_nan=True, atol=0, rtol=0)


def test_reshape_and_cache_non_contiguous_key():
    g = torch.Generator().manual_seed(0)
    case = make_case([9], 2, 64, 16, torch.float16, g)
    kv = torch.randn(9, 4, 64, generator=g).to(torch.float16)  # a fused K/V projection
    for module in (reference, tk):
        kc, vc = torch.zeros_like(case.key_cache), torch.zeros_like(case.value_cache)
        module.reshape_and_cache(kv[:, :2], kv[:, 2:], kc, vc, case.slot_mapping)
        blocks, offsets = case.slot_mapping // 16, case.slot_mapping % 16
        assert torch.equal(kc[blocks, offsets], kv[:, :2])
        assert torch.equal(vc[blocks, offsets], kv[:, 2:])


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize(("dtype", "heads", "block_size", "head_dim", "seed"), PAIRWISE)
def test_decode(dtype, heads, block_size, head_dim, seed):
    check_decode(*heads, head_dim, block_size, dtype, seed)


def test_decode_context_zero_and_non_contiguous_query():
    g = torch.Generator().manual_seed(0)
    case = make_case([0, 23, 1], 2, 64, 16, torch.float32, g)
    qkv = torch.randn(3, 8, 64, generator=g)  # queries are a view into a fused projection
    query = qkv[:, :4]
    for split in ({}, dict(num_splits=2, tokens_per_split=16, block_n=16)):
        got, want = decode_both(case, query, 0.125, **split)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert_close(got, want, torch.float32)


def test_decode_split_plan_covers_the_context():
    for num_seqs, max_context in [(1, 1), (1, 40), (2, 4096), (256, 16384), (1, 16384)]:
        splits, per_split = tk._split_plan(num_seqs, 8, max_context, 64, 132)
        assert 1 <= splits <= tk._MAX_SPLITS and per_split % 64 == 0
        assert splits * per_split >= max_context
    assert tk._split_plan(1, 8, 16384, 64, 132)[0] > 1  # one long sequence is split
    assert tk._split_plan(256, 8, 4096, 64, 132)[0] == 1  # a full batch is not


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(("dtype", "heads", "block_size", "head_dim", "seed"), PAIRWISE)
def test_prefill(dtype, heads, block_size, head_dim, seed):
    check_prefill(*heads, head_dim, block_size, dtype, seed)


def test_prefill_all_decodes_matches_decode():
    g = torch.Generator().manual_seed(5)
    case = make_case([1, 16, 17, 33], 2, 64, 16, torch.float16, g)
    query = torch.randn(4, 8, 64, generator=g).to(torch.float16)
    starts = torch.arange(5, dtype=torch.int32)
    args = (case.key_cache, case.value_cache, case.block_tables)
    got = tk.paged_attention_prefill(query, *args, starts, case.seq_lens, 0.125)
    want = reference.paged_attention_decode(query, *args, case.seq_lens, 0.125)
    assert_close(got, want, torch.float16)


def test_prefill_empty_chunk_and_non_contiguous_query():
    g = torch.Generator().manual_seed(1)
    case = make_case([20, 7, 33], 2, 80, 16, torch.float32, g)
    q_lens = [20, 0, 9]
    starts = torch.tensor([0, 20, 20, 29], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 12, 80, generator=g)[:, 4:8]
    args = (query, case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens)
    want = reference.paged_attention_prefill(*args, 0.1)
    assert_close(tk._prefill(*args, 0.1, block_m=16, block_n=16), want, torch.float32)


# --------------------------------------------------------------------------- dispatch


def test_select_backend_in_the_interpreter():
    assert tk is kernels.triton_kernels and tk.INTERPRETED
    assert kernels.select_backend("auto", "cpu") is kernels.cpu_attention  # never the interpreter
    assert kernels.select_backend("torch", "cpu") is reference


def test_warm_up_runs_and_leaves_the_cache_as_it_was():
    # The engine warms the kernels up on its own cache before a run: nothing of it
    # may change (the one token written goes to slot -1, which is skipped).
    g = torch.Generator().manual_seed(7)
    for dtype, heads, kv_heads, head_dim in ((torch.bfloat16, 8, 2, 32), (torch.float32, 4, 4, 16)):
        shape = (3, 16, kv_heads, head_dim)
        caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
        before = [c.clone() for c in caches]
        tk.warm_up(*caches, heads)
        for c, b in zip(caches, before, strict=True):
            assert torch.equal(c, b)


def test_engine_generates_the_same_tokens_with_the_triton_kernels_as_with_torch():
    # The engine's own use of the kernels (its metadata, block tables, chunked
    # prefill, mixed batches and, with the long prompt, split decodes), on the CPU
    # through the interpreter: the same greedy tokens as the torch reference.
    from testbed.core import SamplingParams
    from testbed.engine.llm import LLM
    from tests.engine.test_engine import prompts

    # 140 tokens: decodes past 128 tokens of context split (the interpreter's 4 "SMs")
    batch = prompts(3, seed=3) + [list(range(100, 240))]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM("dummy-llama", device="cpu", dtype="float32", attention_backend=backend,
                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)  # fmt: skip
        if backend == "triton":
            assert llm.executor.backend is tk
            llm.executor.warm_up()
        outs[backend] = [o.token_ids for o in llm.generate(batch, greedy)]
    assert outs["triton"] == outs["torch"]


# --------------------------------------------------------------------------- slow: wider grid


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_prefill_other_head_dims(head_dim, dtype):
    check_decode(8, 2, head_dim, 16, dtype, seed=head_dim)
    check_prefill(8, 2, head_dim, 16, dtype, seed=head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 2, 3, 8])
@pytest.mark.parametrize("heads", [(6, 2), (14, 2)])  # non-power-of-two GQA ratios 3 and 7
def test_decode_and_prefill_small_blocks_odd_gqa(block_size, heads):
    check_decode(*heads, 64, block_size, torch.float16, seed=block_size)
    check_prefill(*heads, 64, block_size, torch.float16, seed=block_size)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_longer_contexts(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 200, (3,), generator=g).tolist()
    check_decode(8, 2, 64, 16, torch.float16, seed, seq_lens=lens)
    check_prefill(8, 2, 64, 32, torch.float16, seed, seq_lens=lens)
