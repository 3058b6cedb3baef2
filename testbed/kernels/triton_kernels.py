"""Triton paged-attention kernels, each beside its wrapper; ``testbed.kernels.torch_attention`` says
what they compute (same signatures, same layouts).

- ``reshape_and_cache``: one program per token copies its K and V heads into its slot.
- ``paged_attention_decode``: flash-decoding. A program takes one (sequence, KV head,
  split of the context) and all the query heads that share that KV head (GQA packed
  into the rows of one ``tl.dot``, so each K/V byte is loaded once); a second kernel
  merges the splits' partial softmaxes. Splitting the context lets a few long
  sequences fill the GPU; a batch that fills it alone runs unsplit, in one kernel.
- ``paged_attention_prefill``: flash attention over variable-length query chunks.
  A program takes one tile of a chunk's query tokens times the query heads of one KV
  head and streams the sequence's cached K/V through its block table, causal within
  the chunk; tiles are found by a binary search over ``query_start_loc``, so the grid
  needs no device-to-host sync.

Tokens are gathered through the block table one tile at a time (each token looks up
its block), so a tile may span cache blocks and any block size works. Head dims that
are not a power of two run in a padded power-of-two tile with masks. Math is fp32
(fp32 inputs use IEEE dots, not TF32); outputs have the query's dtype.

Run on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is imported
(that is how the tests run; there, bf16 dot operands are upcast to fp32, since the
interpreter's ``tl.dot`` cannot multiply bf16).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"]

# Whether the kernels below were defined for the interpreter (read by select_backend).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 128


def _dot_precision(dtype: torch.dtype) -> str | None:
    # Only fp32 operands have a choice; "ieee" keeps fp32 models as exact as the reference.
    return "ieee" if dtype == torch.float32 else None


def _upcast(dtype: torch.dtype) -> bool:
    # The interpreter's tl.dot multiplies bf16 as raw uint16 bits: give it fp32 instead.
    return INTERPRETED and dtype == torch.bfloat16


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV caches' head_dim must be contiguous (stride 1)")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number


# --------------------------------------------------------------------------- cache write


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


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
    _check_cache(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------- decode


# Integer arguments that vary from step to step are not specialized on (Triton
# would otherwise compile a variant for a value of 1 and for multiples of 16): a
# real run meets each variant first in the middle of a step, where compiling takes
# seconds. With these, the kernels compile a handful of variants per model, all
# of them in warm_up (see there).
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    out_ptr,
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, unnormalized
    part_ml_ptr,  # [num_seqs, num_heads, num_splits, 2] fp32: running max (log2), sum
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    num_heads,
    head_dim,
    tokens_per_split,
    num_splits,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for the reduce kernel
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    head = kv_head * QUERIES_PER_KV + g
    d = tl.arange(0, BLOCK_D)
    row_mask = g < QUERIES_PER_KV
    d_mask = d < head_dim
    q = tl.load(
        query_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every tile holds at least one token < end, so m is finite after the first one.
    for tile in range(start, end, BLOCK_N):
        tok = tile + tl.arange(0, BLOCK_N)
        tok_mask = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        offset = tok % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(
            key_cache_ptr
            + block[:, None] * stride_kb
            + offset[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a context of 0 gives zeros
        tl.store(
            out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (seq * num_heads + head).to(tl.int64) * num_splits + split
        tl.store(
            part_acc_ptr + part[:, None] * head_dim + d[None, :],
            acc,
            mask=row_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    context_lens_ptr,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    tokens_per_split,
    num_splits,
    BLOCK_S: tl.constexpr,  # a power of two >= num_splits
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_valid = tl.cdiv(context_len, tokens_per_split)  # splits past the context wrote junk
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_valid
    part = (seq * num_heads + head).to(tl.int64) * num_splits + sp
    m_i = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_i = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.where(num_valid > 0, tl.max(m_i, 0), 0.0)  # no -inf - -inf at a context of 0
    w = tl.where(s_mask, tl.exp2(m_i - m_max), 0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    denom = tl.sum(w * l_i, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def _decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    # Sized so that no variant spills registers on sm_90 (tests/kernels/test_compile.py).
    return 32 if head_dim > 128 or dtype == torch.float32 else 64


def _split_plan(
    num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int
) -> tuple[int, int]:
    """(num_splits, tokens_per_split): enough programs for a few waves on every SM."""
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(4 * num_sms, max(programs, 1))
    most = max(1, triton.cdiv(max_context, _MIN_SPLIT_TOKENS))
    num_splits = max(1, min(wanted, most, _MAX_SPLITS))
    return num_splits, _tokens_per_split(max_context, num_splits, block_n)


def _tokens_per_split(max_context: int, num_splits: int, block_n: int) -> int:
    return max(block_n, triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n)


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
    ``max_context_len`` (a host-side bound on ``context_lens``) sizes the split of long
    contexts; without it the block table's width bounds the context, which needs no
    device sync but over-splits when the table is much wider than the contexts.
    """
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * key_cache.shape[1]
    block_n = _decode_block_n(query.shape[-1], query.dtype)
    num_splits, tokens_per_split = _split_plan(
        query.shape[0], key_cache.shape[2], max_context_len, block_n, _num_sms(query.device)
    )
    return _decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        block_n=block_n,
    )


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    tokens_per_split: int,
    block_n: int,
) -> torch.Tensor:
    """The launch with an explicit split (``num_splits * tokens_per_split`` must cover
    every context); the tests use it to force splits at small shapes."""
    _check_cache(key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if tokens_per_split % block_n:
        raise ValueError("tokens_per_split must be a multiple of block_n")
    queries_per_kv = num_heads // num_kv_heads
    query = _last_dim_contiguous(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_acc = part_ml = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_ml,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        head_dim,
        tokens_per_split,
        num_splits,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=num_splits > 1,
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_ml,
            context_lens,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            tokens_per_split,
            num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------- prefill


def _prefill_tiles(head_dim: int, dtype: torch.dtype, all_decodes: bool) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps): long query tiles for prefill, short ones when every
    chunk is one token; sized so that no variant spills registers on sm_90."""
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and need small tiles
        return (16, 64, 4) if head_dim <= 128 else (16, 32, 8)
    if all_decodes:
        return 16, 32 if head_dim > 128 else 64, 4
    return (128, 64, 8) if head_dim <= 128 else (64, 32, 8)


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns grid tile ``q_tile``: sequence i's tiles start at
    ``query_start_loc[i] // BLOCK_Q + i``, a monotone function of i."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    num_seqs,
    head_dim,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_tile - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # the grid is an upper bound on the number of tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # Row r of the tile is query token r // QUERIES_PER_KV of this tile, head r % ...
    r = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + r // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV
    row_mask = (r < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    # Padding rows get a position past every key, so that no row is fully masked.
    q_pos = tl.where(row_mask, prefix + q_tok, seq_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    io_mask = row_mask[:, None] & d_mask[None, :]
    rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        query_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, prefix + (q_block + 1) * BLOCK_Q)
    for tile in range(0, kv_end, BLOCK_N):
        tok = tile + tl.arange(0, BLOCK_N)
        tok_mask = tok < kv_end
        block = tl.load(table + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        offset = tok % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(
            key_cache_ptr
            + block[:, None] * stride_kb
            + offset[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(tok_mask[None, :] & (tok[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


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
    returns the same shape and dtype. ``max_context_len`` is accepted for parity with
    decode and not needed.
    """
    all_decodes = query.shape[0] < query_start_loc.shape[0]  # one token per sequence
    block_m, block_n, num_warps = _prefill_tiles(query.shape[-1], query.dtype, all_decodes)
    return _prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
    )


def _prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
) -> torch.Tensor:
    """The launch with explicit tiles (``block_m`` rows of query tokens x heads, ``block_n``
    keys); the tests use small ones to cross tile boundaries at small shapes."""
    _check_cache(key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = query_start_loc.shape[0] - 1
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    queries_per_kv = num_heads // num_kv_heads
    query = _last_dim_contiguous(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        num_seqs,
        head_dim,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------- warm-up


def warm_up(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Launch every variant of the kernels that a model with ``num_heads`` query heads
    over this KV cache can launch, on problems of one token, so that Triton compiles
    them (or loads them from its on-disk cache) now, not in the middle of a run's first
    steps, where each compile stalls the engine for a second or more.

    The variants: the cache write; decode unsplit and split, with the reduce kernel at
    each power-of-two width of the split; prefill with its tiles for prompt chunks and
    for batches of single tokens. Every other argument that changes from step to step
    is a runtime value that Triton does not specialize on (``do_not_specialize``), so a
    step of any batch or context reuses one of these (tests/kernels/test_compile.py).
    Nothing is written to the cache (the token's slot is -1) and it is only read at
    block 0."""
    device, dtype = key_cache.device, key_cache.dtype
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]

    def tokens(n: int, heads: int) -> torch.Tensor:
        return torch.zeros(n, heads, head_dim, dtype=dtype, device=device)

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    kv = tokens(1, num_kv_heads)
    no_slot = torch.full((1,), -1, dtype=torch.int64, device=device)
    reshape_and_cache(kv, kv, key_cache, value_cache, no_slot)
    block_n = _decode_block_n(head_dim, dtype)
    # Unsplit, then the fewest splits for each reduce width (2, 3, 5, 9, ... splits
    # for widths 2, 4, 8, 16, ... up to that of the most splits).
    widths = [2]
    while widths[-1] < triton.next_power_of_2(_MAX_SPLITS):
        widths.append(2 * widths[-1])
    for splits in [1] + [w // 2 + 1 for w in widths]:
        query = tokens(1, num_heads)
        _decode(query, key_cache, value_cache, ints(0).view(1, 1), ints(1), 1.0,
                num_splits=splits, tokens_per_split=block_n, block_n=block_n)  # fmt: skip
    # A chunk of two prompt tokens; two sequences of one token each.
    cache = (key_cache, value_cache)
    paged_attention_prefill(
        tokens(2, num_heads), *cache, ints(0).view(1, 1), ints(0, 2), ints(2), 1.0
    )
    paged_attention_prefill(
        tokens(2, num_heads), *cache, ints(0, 0).view(2, 1), ints(0, 1, 2), ints(1, 1), 1.0
    )
