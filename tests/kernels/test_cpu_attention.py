"""The CPU path (``cpu_attention``) against the reference on engine-shaped batches:
many decodes of spread lengths, bursts of short prompts, chunks after prefixes,
and groups split by their byte budget, with and without its C++ kernel for short
queries; and the properties each route exists for: on torch alone, a batch of many
sequences runs as a few attention calls; with the kernel, every short query of a
step runs in one call that reads no gathered copy."""

from __future__ import annotations

import pytest
import torch

from testbed.kernels import cpu_attention, cpu_native
from testbed.kernels import torch_attention as reference
from tests.kernels.cases import assert_close, decode_inputs, make_case, prefill_inputs


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """The CPU path's route for short queries: its C++ kernel (skipped where it cannot
    be built), or torch's fused attention on gathered blocks."""
    monkeypatch.setenv("TESTBED_CPU_KERNEL", request.param)
    if request.param == "native":
        request.getfixturevalue("native")
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TESTBED_CPU_KERNEL", "torch")


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
def test_decode_batch_of_spread_lengths_equals_the_reference(monkeypatch, group_bytes, kernel):
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


def test_a_burst_of_short_prompts_is_a_few_calls(monkeypatch, torch_path):
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


def test_mixed_step_with_long_chunks_after_prefixes_equals_the_reference(kernel):
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


def test_a_plan_is_reused_only_for_the_same_batch(kernel):
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


def test_buffers_first_made_under_inference_mode_serve_calls_outside_it(torch_path):
    # The engine runs under inference mode; tests and tools call the kernels outside it.
    cpu_attention._WORKSPACES.clear()
    g = torch.Generator().manual_seed(9)
    case = make_case([30, 70], 2, 64, 16, torch.float32, g)
    query, expected = decode_inputs(case, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    with torch.inference_mode():
        assert_close(cpu_attention.paged_attention_decode(query, *args), expected, torch.float32)
    assert_close(cpu_attention.paged_attention_decode(query, *args), expected, torch.float32)


@pytest.mark.parametrize("limit", [None, 2**21])
def test_every_query_of_a_step_is_one_kernel_call(monkeypatch, native, limit):
    """Decodes, verifications (a token and its drafts after a context), prompts
    short and long: one call of the C++ kernel, no fused attention call and no
    gathered copy; with a limit of (row x key) pairs for float32, a prompt past it
    goes to torch's fused attention instead."""
    if limit is not None:
        monkeypatch.setitem(cpu_attention.NATIVE_PAIRS, torch.float32, limit)
    g = torch.Generator().manual_seed(11)
    seq_lens = [300, 41, 517, 12, 64, 1500, 5, 33]
    q_lens = [1, 4, 4, 12, 64, 1500, 5, 1]  # decode, verifications, prompts, one long
    case = make_case(seq_lens, 2, 64, 16, torch.float32, g, unused="poison")
    query, starts, expected = prefill_inputs(case, q_lens, 8, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125)
    calls = _calls(monkeypatch)
    kernel_calls = []
    run = cpu_native.kernel()
    monkeypatch.setattr(cpu_native, "kernel", lambda: lambda *a: kernel_calls.append(a) or run(*a))
    out = cpu_attention.paged_attention_prefill(query, *args)
    assert_close(out, expected, torch.float32)
    assert len(kernel_calls) == 1
    long = [] if limit is None else [1500]
    assert kernel_calls[0][5][:, 1].tolist() == [q for q in q_lens if q not in long]
    assert [c[0] for c in calls] == [1 for _ in long]  # the long prompt, alone


@pytest.mark.parametrize("head_dim", [8, 12, 64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("threads", [1, 8])
def test_the_kernel_on_any_head_dim_block_size_and_group(
    head_dim, block_size, group, threads, native
):
    """Head dims the vector code takes (multiples of 8) and one it does not (12),
    blocks shorter than its 8-key steps, and grouped-query ratios; on one thread
    (a short item's KV heads in one unit) and on eight (more threads than items: a
    unit per KV head)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + group)
    seq_lens = [1, 7, 8, 9, 33, 130]
    q_lens = [1, 7, 2, 1, 3, 1]
    case = make_case(seq_lens, 2, head_dim, block_size, torch.float32, g, unused="poison")
    query, starts, expected = prefill_inputs(case, q_lens, 2 * group, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens)
    out = cpu_attention.paged_attention_prefill(query, *args, head_dim**-0.5)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_prompt_tiles_on_any_head_dim_block_size_and_group(
    monkeypatch, head_dim, block_size, group, threads, native
):
    """float32 prompts in row tiles: tiles of 128 keys or more with head dims in
    whole 16-value registers take their query vectors in lanes (AVX-512), the rest
    dot products (a head dim of 24, a prompt of 40 tokens); prompts of ragged
    lengths, a chunk after a prefix, blocks of one token and of more than the
    kernel's 32-key steps, the keys past each sequence NaN."""
    monkeypatch.setenv("TESTBED_CPU_KERNEL", "native")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + group)
    seq_lens = [150, 40, 333, 129, 3]
    q_lens = [150, 40, 61, 129, 1]
    case = make_case(seq_lens, 2, head_dim, block_size, torch.float32, g, unused="poison")
    query, starts, expected = prefill_inputs(case, q_lens, 2 * group, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens)
    calls = _calls(monkeypatch)
    out = cpu_attention.paged_attention_prefill(query, *args, head_dim**-0.5)
    assert not calls  # every item through the kernel
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("threads", [1, 8])
def test_the_kernel_over_contexts_of_several_chunks(monkeypatch, block_size, threads, native):
    """Contexts past the kernel's chunk of keys (a softmax carried across chunks), keys
    growing along each sequence so that later chunks' scores top the earlier ones',
    a verification whose rows straddle a chunk's end, and a prompt whose rows see one
    chunk or two (blocks of 5: chunks of 1,020 keys); units of both KV heads (one
    thread) and of one (eight threads)."""
    torch.set_num_threads(threads)
    monkeypatch.setitem(cpu_attention.NATIVE_PAIRS, torch.float32, 2**22)  # the prompt too
    g = torch.Generator().manual_seed(block_size)
    seq_lens = [1030, 2050, 3000, 1500]
    q_lens = [1, 6, 1, 1500]
    case = make_case(seq_lens, 2, 64, block_size, torch.float32, g)
    for k, slots in zip(case.keys, case.slots):
        k.mul_(torch.linspace(0.5, 2.0, len(k)).view(-1, 1, 1))
        case.key_cache.view(-1, *k.shape[1:])[slots] = k
    query, starts, expected = prefill_inputs(case, q_lens, 4, g)
    calls = _calls(monkeypatch)
    out = cpu_attention.paged_attention_prefill(
        query, case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125
    )
    assert_close(out, expected, torch.float32)
    assert not calls  # every item through the kernel


def test_the_kernel_rejects_items_past_their_table(native):
    g = torch.Generator().manual_seed(2)
    case = make_case([20], 1, 64, 16, torch.float32, g)
    query = torch.randn(1, 2, 64, generator=g)
    items = torch.tensor([[0, 1, 16 * case.block_tables.shape[1] + 1, 0]])
    with pytest.raises(RuntimeError, match="more keys than its block table holds"):
        cpu_native.kernel()(
            torch.empty_like(query),
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            items,
            0.125,
        )


def test_without_a_compiler_the_path_runs_on_torch(monkeypatch):
    """Where the kernel cannot be built, short queries go to torch's fused attention."""
    monkeypatch.setattr(cpu_native, "kernel", lambda: None)
    g = torch.Generator().manual_seed(4)
    case = make_case([50, 3, 200], 2, 64, 16, torch.float32, g)
    query, expected = decode_inputs(case, 4, g)
    calls = _calls(monkeypatch)
    out = cpu_attention.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert_close(out, expected, torch.float32)
    assert calls


def test_the_kernel_rejects_a_table_entry_outside_the_cache(native):
    g = torch.Generator().manual_seed(3)
    case = make_case([20], 1, 64, 16, torch.float32, g)
    query = torch.randn(1, 2, 64, generator=g)
    tables = case.block_tables.clone()
    tables[0, 1] = -1  # the second of its two blocks
    with pytest.raises(RuntimeError, match="is not in the cache"):
        cpu_native.kernel()(
            torch.empty_like(query),
            query,
            case.key_cache,
            case.value_cache,
            tables,
            torch.tensor([[0, 1, 20, 0]]),
            0.125,
        )


def test_the_engines_warm_up_loads_the_kernel_before_any_step(monkeypatch):
    """Loading the kernel costs tens of milliseconds; it must not land on a run's
    first step."""
    from testbed.engine.llm import LLM

    asked = []
    kernel = cpu_native.kernel
    monkeypatch.setattr(cpu_native, "kernel", lambda: asked.append(1) or kernel())
    llm = LLM("dummy-llama", num_kv_blocks=16, attention_backend="cpu", device="cpu")
    assert llm.executor.backend is cpu_attention
    assert asked, "the engine's warm-up did not load the C++ kernel"


def test_bfloat16_decodes_and_chunks_run_in_the_kernel_and_equal_the_answer(native, monkeypatch):
    """A bfloat16 cache and queries take the C++ kernel too (widened to float32 as it
    reads them); for items of a few rows (decodes, verifications, short prompts and
    chunks) its outputs are the float32 answer rounded once."""
    monkeypatch.setenv("TESTBED_CPU_KERNEL", "native")
    g = torch.Generator().manual_seed(11)
    seq_lens = [700, 16, 33, 1, 300, 290, 18, 2, 129]
    q_lens = [1, 16, 7, 1, 1, 1, 1, 2, 16]  # decodes, a short prompt, short chunks
    case = make_case(seq_lens, 2, 64, 16, torch.bfloat16, g)
    query, starts, expected = prefill_inputs(case, q_lens, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125)
    out = cpu_attention.paged_attention_prefill(query, *args)
    plan = cpu_attention._last_plan[1]
    assert plan.kernel is not None and plan.native is not None and not plan.groups
    assert_close(out, expected, torch.bfloat16)
    # The float32 result of the same bfloat16 inputs, rounded: within one bfloat16 step.
    wide = [t.float() for t in (query, case.key_cache, case.value_cache)]
    exact = cpu_attention.paged_attention_prefill(wide[0], wide[1], wide[2], *args[2:])
    step = exact.abs().clamp_min(2**-20) * 2**-7
    assert ((out.float() - exact).abs() <= step).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_equals_the_references_and_skips_unslotted_tokens(kernel, dtype):
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(9, 6, 32, generator=g).to(dtype)
    key, value = kv[:, :3], kv[:, 3:]  # views whose rows are apart, as split from qkv
    slots = torch.tensor([5, -1, 0, 17, 31, 8, -1, 30, 1])
    caches = [torch.full((4, 8, 3, 32), 7.0, dtype=dtype) for _ in range(4)]
    cpu_attention.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert (caches[0].view(32, 3, 32)[[2, 3, 4]] == 7.0).all()  # slots nobody wrote
    with pytest.raises((RuntimeError, IndexError)):
        cpu_attention.reshape_and_cache(key, value, caches[0], caches[1], slots + 30)


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_prompts_run_in_the_kernel_in_row_tiles(native, monkeypatch, block_size, threads):
    """bfloat16 prompts of any length take the kernel, their rows in tiles (tiles of
    the causal triangle, a tile's last row past a chunk of keys, odd key counts in a
    block, a chunk after a prefix); their weights are rounded to bfloat16 before the
    product with V where the CPU has dot pairs, as torch's bfloat16 attention rounds
    them: the error against the exact answer is about torch's own (its largest within
    1.5x, its mean within 2x)."""
    monkeypatch.setenv("TESTBED_CPU_KERNEL", "native")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(block_size * 10 + threads)
    seq_lens = [1100, 33, 17, 700, 2]
    q_lens = [1100, 33, 17, 301, 1]  # prompts, a chunk after a prefix, a decode
    case = make_case(seq_lens, 2, 64, block_size, torch.bfloat16, g, unused="poison")
    query, starts, expected = prefill_inputs(case, q_lens, 4, g)
    args = (case.key_cache, case.value_cache, case.block_tables, starts, case.seq_lens, 0.125)
    calls = _calls(monkeypatch)
    out = cpu_attention.paged_attention_prefill(query, *args)
    assert not calls  # every item through the kernel
    assert_close(out, expected, torch.bfloat16)
    ours = (out.double() - expected).abs()
    theirs = torch.zeros_like(expected)  # torch's bfloat16 attention on each sequence
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        a, b = int(starts[i]), int(starts[i + 1])
        mask = torch.ones(b - a, len(k), dtype=torch.bool).tril(len(k) - (b - a))
        o = torch.nn.functional.scaled_dot_product_attention(
            query[a:b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=0.125, enable_gqa=True,
        )  # fmt: skip
        theirs[a:b] = (o.transpose(0, 1).double() - expected[a:b]).abs()
    assert ours.max() <= 1.5 * theirs.max(), (ours.max(), theirs.max())
    assert ours.mean() <= 2 * theirs.mean(), (ours.mean(), theirs.mean())
