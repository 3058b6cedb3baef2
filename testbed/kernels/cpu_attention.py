"""Paged attention for CPUs. Same signatures and results as
``testbed.kernels.torch_attention`` (the definition, which the tests compare this
against); what the engine runs on CPU.

On a CPU the reference's cost is data movement and call count, not arithmetic: it
gathers K/V a token at a time and runs its products per (sequence, KV head) for
decodes, and one gather + SDPA per sequence for prefills. Here every query of a
step, decode or prefill chunk, is an *item* (its query rows, and the keys it may
see), and items take one of two routes:

- items of a few rows, or of few (row x key) pairs (decodes, speculative
  verifications, short prompts), all go to one call of the C++ kernel
  (``cpu_native``), which reads K/V through the block table: no copy, no padding;
- the rest (long prompts, long chunks), and every item where the kernel cannot be
  built, form groups of similar size, whose blocks are copied whole (one
  ``index_select`` of ``block_size``-token pieces) into a padded
  ``[items, keys, kv_heads, head_dim]`` batch; each group runs as one call of
  torch's fused CPU attention (``scaled_dot_product_attention``, grouped-query
  without expanding K/V) under a mask that is causal from each item's first
  position and hides the padding. Long prompts are cut into row chunks, each an
  item that sees only the keys up to its last row, so their work stays about half
  of a full square.

A step's layers share their batch, so the routes, grouping and every index, mask
and padding list are built once per step (a *plan*, cached on the contents of the
metadata tensors the layers are called with) and each layer runs only the kernel
call, gathers and attention calls. Gathers go into buffers kept between calls.

Slots past an item's keys may hold anything (another request's stale values, or
NaN), and a masked NaN still poisons the softmax, so padded keys must read
finite values: padded blocks read the item's first block where that block is
full (every slot written by this sequence), and the remaining padded slots (the
tail of each item's last block, and padded blocks of items shorter than a block)
are zeroed after the gather. The kernel reads no slot past an item's keys.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from testbed.kernels import cpu_native
from testbed.kernels import torch_attention as reference

__all__ = ["paged_attention_decode", "paged_attention_prefill", "reshape_and_cache", "warm_up"]

ROW_CHUNK = 256  # query rows per item of a chunk after a prefix: keys past its end skipped
GROUP_BYTES = 8 * 2**20  # gathered K+V per call: temporaries that stay in cache
PAD_SLACK = 1.3  # a group's padded work may exceed its items' own by this factor ...
CALL_COST = 4096  # ... plus about one call's fixed cost, in (query row x key) units
# A key costs about this many query rows of work besides its products (gathering
# it, zeroing its padding): a decode's key is dominated by the copy, a long
# prefill chunk's by the arithmetic.
KEY_COST_ROWS = 4
# Which items the C++ kernel (``cpu_native``) takes where it is built: it reads
# K/V through the block table, with no copy and no padding, and takes a long
# item's rows in tiles that keep their scores in cache. Measured per layer on 2
# AVX-512 cores (head_dim 64) against torch's fused attention: in bfloat16 it wins
# on every shape (4 prompts of 1,000 tokens 0.56-0.64x torch's time, one of 2,048
# 0.82x); in float32, its query vectors in lanes, 0.72x for a chunk of 1,024 rows
# after 1,024 keys, 0.74x for 512 rows after 3,000, 0.93x for two prompts of
# 1,500 and level for one of 2,048. So it takes every item: a dtype listed in
# NATIVE_PAIRS sends its items of more rows than NATIVE_ROWS and more (row x key)
# pairs than its limit to torch's route instead.
NATIVE_ROWS = 16
NATIVE_PAIRS: dict[torch.dtype, int] = {}

_WORKSPACES: dict[tuple, torch.Tensor] = {}  # (name, dtype, device) -> flat buffer


def warm_up(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Load the C++ kernel (building it on first use) before any request's clock
    runs, as the engine's warm-up does: loading it costs tens of milliseconds (torch
    checks its build), which would otherwise land on a run's first step."""
    _native_kernel(key_cache, value_cache)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``torch_attention.reshape_and_cache``: one C++ copy per row where the kernels
    are built (the reference's masks, index arithmetic and scatters are about ten
    small ops per layer), else the reference."""
    ops = cpu_native.layer_ops() if _native_kernel(key, value, key_cache) else None
    if ops is None or key.stride(-1) != 1 or value.stride(-1) != 1:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.contiguous())


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
    """One query token per sequence over its first ``context_lens[i]`` cached tokens
    (``torch_attention.paged_attention_decode``); a context of 0 gets zeros."""

    items = _decode_items(context_lens)
    plan = _plan((block_tables, context_lens), query.shape, query.dtype, key_cache, items)
    return _run(plan, query, key_cache, value_cache, block_tables, scale)


def _decode_items(context_lens: torch.Tensor) -> Callable[[], list[Item]]:
    return lambda: [Item(i, 1, n, i) for i, n in enumerate(context_lens.tolist()) if n > 0]


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
    """Causal variable-length query chunks over a paged prefix
    (``torch_attention.paged_attention_prefill``): sequence ``i``'s queries are the
    last ``q_len`` of its ``seq_lens[i]`` tokens."""

    meta = (block_tables, query_start_loc, seq_lens)
    items = _prefill_items(query_start_loc, seq_lens)
    plan = _plan(meta, query.shape, query.dtype, key_cache, items)
    return _run(plan, query, key_cache, value_cache, block_tables, scale)


def native_items(meta, num_tokens: int, num_heads: int, key_cache: torch.Tensor):
    """The C++ kernel's items for a step's attention (the same for every layer; ``meta``
    the model's ``AttentionMetadata``), where the kernel takes every query row of it:
    what the fused decoder layer (``cpu_decoder_layer.cpp``) runs. None where some row
    takes torch's route or the kernel is not here."""
    shape = (num_tokens, num_heads, key_cache.shape[3])
    if meta.max_query_len == 1:
        parts = (meta.block_tables, meta.seq_lens)
        items = _decode_items(meta.seq_lens)
    else:
        parts = (meta.block_tables, meta.query_start_loc, meta.seq_lens)
        items = _prefill_items(meta.query_start_loc, meta.seq_lens)
    plan = _plan(parts, shape, key_cache.dtype, key_cache, items)
    return plan.native if plan.covered and not plan.groups and plan.native is not None else None


def _prefill_items(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    def items():
        out = []
        starts = query_start_loc.tolist()
        for i, ((s, e), n) in enumerate(zip(itertools.pairwise(starts), seq_lens.tolist())):
            q_len = e - s
            if q_len > n:
                raise ValueError(f"sequence {i}: {q_len} queries but only {n} tokens in total")
            if q_len == 0:
                continue
            if q_len == n:  # no prefix: one causal item, the kernel skips the upper triangle
                out.append(Item(s, q_len, n, i))
                continue
            for a in range(0, q_len, ROW_CHUNK):
                b = min(q_len, a + ROW_CHUNK)
                out.append(Item(s + a, b - a, n - q_len + b, i))
        return out

    return items


class Item(NamedTuple):
    """Query rows ``row:row + rows`` of sequence ``seq``; row ``j`` sits at position
    ``keys - rows + j`` and sees the keys up to it."""

    row: int
    rows: int
    keys: int
    seq: int

    @property
    def causal(self) -> bool:
        """Rows from position 0 on: plain top-left causal attention, no mask needed."""
        return self.rows == self.keys and self.rows > 1

    def work(self, rows: int, keys: int) -> float:
        """The cost of this item's shape padded to ``rows`` x ``keys``."""
        return keys * ((rows / 2 if self.causal else rows) + KEY_COST_ROWS)


class Group(NamedTuple):
    """One attention call's precomputed indices (see :func:`_group`)."""

    blocks: torch.Tensor  # long [items * num_blocks]: cache blocks to gather
    num_items: int
    num_blocks: int
    zero: torch.Tensor | None  # long: gathered key slots to zero (None: none)
    q_rows: torch.Tensor  # long [items * q_max]: query rows (padding repeats a live row)
    out_rows: torch.Tensor  # long: rows of the output the live results go to
    live: torch.Tensor  # bool [items, q_max]: rows that are an item's, not padding
    mask: torch.Tensor | None  # bool, broadcast over heads (None: causal, or unmasked)
    q_max: int
    causal: bool


class Plan(NamedTuple):
    groups: list[Group]
    native: torch.Tensor | None  # int64 [n, 4]: the C++ kernel's items (row, rows, keys, seq)
    kernel: Callable | None  # the C++ kernel (None: not here)
    covered: bool  # every query row is in some item (else the rest are zeros)


_last_plan: tuple[tuple, Plan] | None = None  # (key, plan) of the last call


def _plan(meta: tuple[torch.Tensor, ...], shape, dtype, key_cache, items) -> Plan:
    """The plan for a batch of queries of ``shape`` and ``dtype``: the last call's
    where ``meta`` holds the same values and the shapes are the same, as for every
    layer of a step. (Keyed on contents, not identity: inference tensors keep no
    version counter to catch an in-place change, and a few KB of bytes cost
    microseconds to compare.)"""
    global _last_plan
    key = (
        tuple((tuple(t.shape), t.cpu().numpy().tobytes()) for t in meta),
        tuple(shape),
        tuple(key_cache.shape),
        key_cache.device,
        dtype,
        key_cache.dtype,
        kernel := _native_kernel(key_cache) if dtype == key_cache.dtype else None,
        NATIVE_PAIRS.get(dtype),  # the routing (benchmarks and tests change it)
    )
    if _last_plan is not None and _last_plan[0] == key:
        return _last_plan[1]
    block_tables = meta[0]
    its = items()
    native = None
    if kernel is not None:
        short = [it for it in its if _native_item(it, dtype)]
        its = [it for it in its if not _native_item(it, dtype)]
        if short:
            native = torch.tensor(short, dtype=torch.int64).reshape(-1, 4)
    block_size = key_cache.shape[1]
    bytes_per_key = 2 * key_cache.shape[2] * key_cache.shape[3] * key_cache.element_size()
    groups = [
        _group(grp, block_tables, block_size, key_cache.device)
        for causal in (True, False)
        for grp in _groups([it for it in its if it.causal == causal], block_size, bytes_per_key)
    ]
    rows = sum(it.rows for it in its) + (int(native[:, 1].sum()) if native is not None else 0)
    plan = Plan(groups, native, kernel, rows == shape[0])
    _last_plan = (key, plan)
    return plan


def _native_item(it: Item, dtype: torch.dtype) -> bool:
    limit = NATIVE_PAIRS.get(dtype)
    return it.rows <= NATIVE_ROWS or limit is None or it.rows * it.keys <= limit


def route() -> str:
    """How this path runs short queries here, for profile headers and reports."""
    if cpu_native.kernel() is not None:
        if not NATIVE_PAIRS:
            return "C++ kernel for every query"
        limits = ", ".join(f"{str(d).removeprefix('torch.')} {n}" for d, n in NATIVE_PAIRS.items())
        return (
            f"C++ kernel for queries of <= {NATIVE_ROWS} rows or row-key pairs within "
            f"{limits} (other dtypes: every query)"
        )
    return f"torch only: {cpu_native.unavailable_reason()}"


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel reads and writes


def _native_kernel(*tensors: torch.Tensor):
    """The C++ kernel where it applies (``tensors`` on a CPU, all float32 or all
    bfloat16) and is built, else None."""
    dtypes = {t.dtype for t in tensors}
    if any(t.device.type != "cpu" for t in tensors) or len(dtypes) != 1:
        return None
    if dtypes.pop() not in NATIVE_DTYPES:
        return None
    return cpu_native.kernel()


def _groups(items: list[Item], block_size: int, bytes_per_key: int):
    """``items`` (all causal or all not) in groups of similar shape: largest first, a
    group closed when one more item would pad its work past ``PAD_SLACK`` times the
    items' own plus a call's cost, or its gathered K/V past ``GROUP_BYTES``."""
    group: list[Item] = []
    own = width = 0
    for it in sorted(items, key=lambda it: (it.rows, it.keys), reverse=True):
        work = it.work(it.rows, it.keys)
        wider = max(width, _round_up(it.keys, block_size))
        if group:
            n = len(group) + 1
            padded = n * it.work(group[0].rows, wider)
            too_big = n * wider * bytes_per_key > GROUP_BYTES
            if too_big or padded > PAD_SLACK * (own + work) + CALL_COST:
                yield group
                group, own, wider = [], 0, _round_up(it.keys, block_size)
        group.append(it)
        own += work
        width = wider
    if group:
        yield group


def _round_up(n, block_size: int):
    """``n`` (a number or a tensor of them) rounded up to whole blocks, in tokens."""
    return (n + block_size - 1) // block_size * block_size


def _group(group: list[Item], block_tables, block_size: int, dev) -> Group:
    """The indices of one attention call over ``group``, padded to its largest item."""
    first = torch.tensor([it.row for it in group], device=dev)
    rows = torch.tensor([it.rows for it in group], device=dev)
    keys = torch.tensor([it.keys for it in group], device=dev)
    b, q_max, causal = len(group), group[0].rows, group[0].causal
    width = _round_up(max(it.keys for it in group), block_size)
    num_blocks = width // block_size
    table = block_tables[torch.tensor([it.seq for it in group], device=dev), :num_blocks].long()
    # Blocks past an item's last may be anything in the table: read its first instead,
    # which is finite where full, and zero what is not (see the module's docstring).
    pos = torch.arange(width, device=dev)
    used = pos[None, ::block_size] < keys[:, None]  # [b, num_blocks]
    table = torch.where(used, table, table[:, :1]).reshape(-1)
    past_end = pos[None, :] >= keys[:, None]  # [b, width]
    stale = past_end & (
        (pos[None, :] < _round_up(keys, block_size)[:, None]) | (keys < block_size)[:, None]
    )
    zero = stale.view(-1).nonzero().view(-1)
    j = torch.arange(q_max, device=dev)
    live = j[None, :] < rows[:, None]  # [b, q_max]
    q_rows = torch.where(live, first[:, None] + j[None, :], first[:, None])  # pad: row 0 again
    if q_max == 1:  # decodes: every row live, only the padding masked
        mask = (~past_end)[:, None, None, :]
    elif causal:  # a live row j sees keys <= j, never the padding: no mask
        mask = None
    else:  # row j of an item sees keys <= keys - rows + j
        last_seen = (keys - rows)[:, None] + j[None, :]
        mask = (pos[None, None, :] <= last_seen[:, :, None])[:, None]
    return Group(
        blocks=table,
        num_items=b,
        num_blocks=num_blocks,
        zero=zero if zero.numel() else None,
        q_rows=q_rows.reshape(-1),
        out_rows=q_rows[live],
        live=live,
        mask=mask,
        q_max=q_max,
        causal=causal,
    )


def _workspace(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A reused buffer of ``shape`` (``like``'s dtype and device): fresh multi-MB
    temporaries would be page-faulted in on every call, which costs more than the
    copy into them."""
    key = (name, like.dtype, like.device)
    numel = math.prod(shape)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor, even when first needed under inference mode: an inference
        # tensor could not be written into by a later call outside it.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _WORKSPACES[key] = buf
    return buf[:numel].view(shape)


def _run(plan: Plan, query, key_cache, value_cache, block_tables, scale) -> torch.Tensor:
    out = torch.empty_like(query) if plan.covered else torch.zeros_like(query)
    block_size, kv_heads, head_dim = key_cache.shape[1:]
    num_heads = query.shape[1]
    group_size = num_heads // kv_heads
    if plan.native is not None:
        tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
        q = query if query.stride(-1) == 1 else query.contiguous()
        plan.kernel(out, q, key_cache, value_cache, tables.contiguous(), plan.native, scale)
    for g in plan.groups:
        b, width = g.num_items, g.num_blocks * block_size
        shape = (b * g.num_blocks, block_size, kv_heads, head_dim)
        k = torch.index_select(key_cache, 0, g.blocks, out=_workspace("k", shape, key_cache))
        v = torch.index_select(value_cache, 0, g.blocks, out=_workspace("v", shape, value_cache))
        if g.zero is not None:
            k.view(b * width, -1).index_fill_(0, g.zero, 0.0)
            v.view(b * width, -1).index_fill_(0, g.zero, 0.0)
        k = k.view(b, width, kv_heads, head_dim).float().transpose(1, 2)
        v = v.view(b, width, kv_heads, head_dim).float().transpose(1, 2)
        q = query.index_select(0, g.q_rows).float()
        if g.q_max == 1:
            # A decode's query heads of one KV head are rows of one product: each KV
            # head's keys are read once, not once per query head.
            q = q.view(b, kv_heads, group_size, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            out[g.out_rows] = o.reshape(b, num_heads, head_dim).to(out.dtype)
            continue
        q = q.view(b, g.q_max, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=g.mask, is_causal=g.causal, scale=scale, enable_gqa=True
        ).transpose(1, 2)  # [b, q_max, heads, head_dim]
        out[g.out_rows] = o[g.live].to(out.dtype)
    return out
