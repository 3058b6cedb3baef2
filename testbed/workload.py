"""Turn a trace (a DataFrame, see ``traces``) into :class:`Request` objects.

In simulation a request needs only lengths (and prefix hash ids, so that the
prefix cache sees which requests share blocks). The real engine needs token
ids: they are drawn from a seeded generator, and a prompt's prefix blocks are
derived from their hash ids alone, so that requests sharing a hash share the
same tokens (and the prefix cache hits exactly where the trace says).
"""

from __future__ import annotations

import math
import random

import pandas as pd

from testbed.core import Request, SamplingParams


def _opt(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def to_requests(
    trace: pd.DataFrame,
    with_tokens: bool = False,
    vocab_size: int = 32000,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> list[Request]:
    """One :class:`Request` per trace row; it stops at the row's output length."""
    block = int(trace.attrs.get("hash_block_tokens", 512))
    cols = [
        trace[c].tolist()
        for c in (
            "arrival_s",
            "prompt_tokens",
            "output_tokens",
            "tenant",
            "priority",
            "ttft_slo_s",
            "tpot_slo_s",
            "prefix_hash_ids",
        )
    ]
    out = []
    for i, (t, n_in, n_out, tenant, prio, ttft, tpot, hashes) in enumerate(zip(*cols, strict=True)):
        hashes = tuple(hashes) if hashes is not None and not _is_nan(hashes) else None
        tokens = (
            prompt_tokens(i, int(n_in), hashes, block, vocab_size, seed) if with_tokens else None
        )
        out.append(
            Request(
                request_id=f"req-{i}",
                prompt_token_ids=tokens,
                num_prompt_tokens=int(n_in),
                sampling_params=SamplingParams(max_tokens=int(n_out), ignore_eos=True),
                target_output_tokens=int(n_out),
                eos_token_id=eos_token_id,
                tenant=str(tenant),
                priority=int(prio),
                ttft_slo_s=_opt(ttft),
                tpot_slo_s=_opt(tpot),
                arrival_time=float(t),
                prefix_hash_ids=hashes,
                hash_block_tokens=block,
            )
        )
    return out


def _is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def prompt_tokens(
    index: int, length: int, hashes: tuple[int, ...] | None, block: int, vocab: int, seed: int
) -> list[int]:
    """Seeded token ids; the span of each prefix hash id depends on that id only."""
    tokens: list[int] = []
    for h in hashes or ():
        if len(tokens) >= length:
            break
        rng = random.Random(f"hash-{seed}-{h}")
        tokens.extend(rng.randrange(vocab) for _ in range(min(block, length - len(tokens))))
    rng = random.Random(f"req-{seed}-{index}")
    tokens.extend(rng.randrange(vocab) for _ in range(length - len(tokens)))
    return tokens
