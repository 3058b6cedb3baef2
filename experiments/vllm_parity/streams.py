"""Synthetic request streams in the replay tool's CSV format.

Columns: ``request_id``, ``arrival_step`` (the scheduler step it joins),
``arrival_s`` (its arrival time: distinct within a step, so that no two
requests tie on it), ``prompt_tokens``, ``output_tokens``, ``prefix_hash_ids``
(``|``-separated; hash id h always stands for the same block of tokens, so
requests with the same leading ids share a prefix) and, with priority classes,
``priority`` (lower first); with tenants, ``tenant`` (``t0`` the busiest: tenant
k is drawn with weight 1/(k+1)); with an SLO range, ``ttft_slo_s`` (uniform in
it; arrival_s plus it is the request's deadline). Tenants and SLOs draw from
their own generator, so adding them leaves the other columns as they were.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StreamSpec:
    n: int = 50
    rate: float = 4.0  # mean arrivals per step (Poisson)
    prompt: tuple[int, int] = (20, 600)
    output: tuple[int, int] = (5, 100)
    hash_block: int = 16  # tokens per prefix hash id (the block size)
    num_prefixes: int = 3  # distinct shared prefixes (system prompts)
    prefix_blocks: tuple[int, int] = (4, 16)  # length of each, in hash blocks
    share_frac: float = 0.5  # fraction of requests that start with one
    priority_classes: int = 0  # 0: no priority column
    num_tenants: int = 0  # 0: no tenant column
    ttft_slo_s: tuple[float, float] | None = None  # None: no ttft_slo_s column
    seed: int = 1


def write_stream(spec: StreamSpec, path: Path) -> Path:
    rng = random.Random(spec.seed)
    prefixes = [
        [1000 * (k + 1) + j for j in range(rng.randint(*spec.prefix_blocks))]
        for k in range(spec.num_prefixes)
    ]
    columns = ["request_id", "arrival_step", "arrival_s", "prompt_tokens", "output_tokens"]
    columns.append("prefix_hash_ids")
    if spec.priority_classes:
        columns.append("priority")
    if spec.num_tenants:
        columns.append("tenant")
    if spec.ttft_slo_s is not None:
        columns.append("ttft_slo_s")
    extra = random.Random(f"tenants-slos-{spec.seed}")
    weights = [1.0 / (k + 1) for k in range(spec.num_tenants)]
    t = 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(columns)
        for i in range(spec.n):
            if i:
                t += rng.expovariate(spec.rate)
            prompt = rng.randint(*spec.prompt)
            output = rng.randint(*spec.output)
            hashes: list[int] = []
            if prefixes and rng.random() < spec.share_frac:
                prefix = rng.choice(prefixes)
                hashes = prefix[: min(len(prefix), prompt // spec.hash_block)]
            row = [f"r{i}", int(t), f"{t:.6f}", prompt, output, "|".join(map(str, hashes))]
            if spec.priority_classes:
                row.append(rng.randrange(spec.priority_classes))
            if spec.num_tenants:
                row.append(f"t{extra.choices(range(spec.num_tenants), weights)[0]}")
            if spec.ttft_slo_s is not None:
                row.append(f"{extra.uniform(*spec.ttft_slo_s):.4f}")
            out.writerow(row)
    return path
