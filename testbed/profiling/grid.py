"""The profiler's grid: the batch compositions it measures, and the engine
options under which each runs exactly as composed."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.engine.args import EngineArgs
from testbed.engine.device import pick_device

DECODE_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
CONTEXTS = (64, 256, 1024, 2000)
PREFILLS = (16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2000)


def interleave(first: list, second: list) -> list:
    """Both lists' items, each list in its own order, spread evenly over the
    result, so that any stretch of it holds both in proportion. The profiler
    measures the points in the grid's order, and a VM's speed drifts over the
    minutes a pass takes: measured one kind after the other, decodes and
    prefills would see different speeds and the fit's split between their costs
    would be off by as much (docs/fidelity.md)."""
    n, m = len(first), len(second)
    keyed = [((i + 0.5) / n, 0, i) for i in range(n)] + [((j + 0.5) / m, 1, j) for j in range(m)]
    return [(first, second)[k][i] for _, k, i in sorted(keyed)]


# (decode batch, decode context, prefill tokens[, cached prefix tokens]) per
# point (see Point). Every small decode batch: a GEMM of a few rows is not smooth
# in their number (see testbed.sim.fitting.DECODE_SIZES). Prefills after a cached
# prefix, as a trace with prefix sharing (Mooncake's conversations, a shared
# system prompt) produces them: from scratch a prefill's attention pairs, KV
# tokens read and longest context all follow from its length, so only these
# points tell the latency model what attention over a long cached context costs
# beside the tokens computed.
PREFIX_POINTS = [(0, 0, p, c) for c in (256, 1024) for p in (64, 256, 768)] + [(4, 256, 256, 1024)]
# Many short prompts prefilled in one step (a burst of arrivals, or a policy that
# packs short requests first), alone and beside decodes: the same tokens as one
# long prompt cost more attention calls, sampled rows and per-sequence work, and
# far fewer attention pairs, which only these points show the latency model.
PACKED_POINTS = [
    (0, 0, 512, 0, 0, 8),
    (0, 0, 512, 0, 0, 16),
    (0, 0, 2048, 0, 0, 16),
    (0, 0, 2048, 0, 0, 48),
    (16, 256, 1024, 0, 0, 16),
    (32, 256, 512, 0, 0, 16),
]
# Speculative decoding's verification steps: each decoder's last token and 3
# drafts (4 query tokens after its context), the shape no other point has.
DRAFT_POINTS = [(b, c, 0, 0, 3) for b in (1, 4, 16, 64) for c in (256, 1024)]
# The engine batches up to max_num_seqs (256) on a CPU too: a burst of short
# requests decodes a hundred at once, past the batches above, where an
# extrapolated fit missed its steps by 30% (docs/fidelity.md).
LARGE_DECODES = [(128, c, 0) for c in (64, 256)]
# Decode points and points with a prefill are interleaved (see interleave).
DEFAULT_GRID = interleave(
    [(b, c, 0) for b in DECODE_BATCHES for c in CONTEXTS] + DRAFT_POINTS + LARGE_DECODES,
    [(0, 0, p) for p in PREFILLS]
    + [(b, 256, p) for b in (4, 16) for p in (64, 256, 1024)]
    + PREFIX_POINTS
    + PACKED_POINTS,
)
# A GPU's engine batches up to the engine's max_num_seqs (256) and a step of 8B
# weights costs about as much for 1 as for 100 decodes, so the grid goes on from
# the default one to 256 decodes (with at most 256k cached tokens in all: 34 GB of
# an 8B model's KV cache; any more and the decoders' untimed prefills dominate the
# profiler's time), to contexts of 4096 and to mixes with 64 decodes. The default
# grid's points come first, so that a profile cut short by its time limit
# (``max_grid_s``) has those.
GPU_GRID = DEFAULT_GRID + interleave(
    [
        (b, c, 0)
        for b in (128, 256)
        for c in CONTEXTS
        if b * c <= 2**18 and (b, c, 0) not in LARGE_DECODES
    ]
    + [(b, 4096, 0) for b in (1, 4, 16, 64)],
    [(64, 256, p) for p in (64, 256, 1024)],
)
GRIDS = {
    "default": DEFAULT_GRID,
    "gpu": GPU_GRID,
    "quick": interleave(
        [(b, 128, 0) for b in (1, 4, 16)] + [(4, 128, 0, 0, 3)],
        [(0, 0, p) for p in (32, 256)] + [(4, 128, 128), (0, 0, 64, 256), (0, 0, 256, 0, 0, 8)],
    ),
}
GRID_CHOICES = ("auto", *GRIDS)  # auto: gpu on a CUDA device, else default


def grid_points(name: str, device: str | None) -> tuple[str, list[tuple[int, ...]]]:
    """The grid called ``name`` (``auto``: ``gpu`` where the engine runs on a GPU,
    ``default`` elsewhere) and its points."""
    if name == "auto":
        name = "default" if pick_device(device).type == "cpu" else "gpu"
    if name not in GRIDS:
        raise ValueError(f"unknown profile grid {name!r}; known: {', '.join(GRID_CHOICES)}")
    return name, GRIDS[name]


PREFILL_BUDGET = 2048  # tokens per step beyond the decodes: the largest prefill point fits


@dataclass
class Point:
    """One grid point: ``decode_batch`` requests each decoding after ``context``
    tokens (verifying ``drafts`` draft tokens too, as speculative decoding's
    steps do), beside ``prefills`` requests prefilling ``prefill_tokens`` tokens
    in all (split as evenly as they go), each after ``prefix_tokens`` prompt
    tokens the engine already holds in its prefix cache (a whole number of KV
    blocks)."""

    decode_batch: int
    context: int
    prefill_tokens: int
    prefix_tokens: int = 0
    drafts: int = 0
    prefills: int = 1

    def label(self) -> str:
        """``decodes x context + prefill`` (``/prompts``, ``@prefix``, ``~drafts``)."""
        text = f"{self.decode_batch}x{self.context}+{self.prefill_tokens}"
        text += f"/{self.prefills}" if self.prefills > 1 else ""
        text += f"@{self.prefix_tokens}" if self.prefix_tokens else ""
        return text + (f"~{self.drafts}" if self.drafts else "")

    def prompt_lens(self) -> list[int]:
        """Each prefilling request's new tokens (none without a prefill)."""
        if not self.prefill_tokens:
            return []
        n, extra = divmod(self.prefill_tokens, self.prefills)
        return [n + (i < extra) for i in range(self.prefills)]


def decoder_output(point: Point, steps: int) -> int:
    """Output tokens each of a point's decoders is asked for: enough that none
    finishes before the point's ``steps`` timed and warm-up steps are over (each
    may accept all its drafts), however many steps their own prefills take (they
    are aborted afterwards)."""
    return steps * (1 + point.drafts) + 8 + -(-point.decode_batch * point.context // PREFILL_BUDGET)


def fit_args(args: EngineArgs, points: list[Point], repeats: int, warmup: int) -> None:
    """Engine options under which every point runs as measured: no prefix caching,
    a token budget for the largest decode batch plus a prefill, a context long
    enough for every point and a KV cache that holds any one point at once (no
    preemption while timing; on a GPU no more of the card than the largest point
    needs)."""
    steps = repeats + warmup
    bs = args.block_size

    def blocks(tokens: int) -> int:
        return -(-tokens // bs)

    prompt = max(p.prefix_tokens + p.prefill_tokens + 1 for p in points)
    longest = max(max(p.context + decoder_output(p, steps) for p in points), prompt)
    need = max(p.decode_batch * blocks(p.context + decoder_output(p, steps)) for p in points)
    # a point's prefills (each after its cached prefix) beside them
    need += max(sum(blocks(p.prefix_tokens + n + 1) for n in p.prompt_lens()) for p in points)
    args.enable_prefix_caching = False
    batch = max(p.decode_batch + p.prefills for p in points)
    args.max_num_seqs = max(args.max_num_seqs, batch)
    args.max_num_batched_tokens = max(p.decode_batch * (1 + p.drafts) for p in points)
    args.max_num_batched_tokens += 1 + PREFILL_BUDGET
    args.max_model_len = max(args.max_model_len or 0, longest + 16)
    args.num_kv_blocks = max(args.num_kv_blocks or 0, need + 16)
