"""What the deployment search rules out before simulating anything: a
configuration over the GPU budget, one the engine or the model does not allow,
and one whose weights leave no room for a KV cache large enough for the
trace's longest request. Each by the rule the simulator itself applies
(``testbed.build``: ``kv_blocks``, ``parallelism``, ``scheduler_config``), so
that a configuration dropped here is one whose run would be refused or could
not serve every request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from testbed.build import hardware_spec, kv_blocks, model_spec, parallelism, scheduler_config
from testbed.errors import InputError
from testbed.models import ModelSpec
from testbed.search.space import Deployment

BUDGET, INVALID, MEMORY = "budget", "invalid", "memory"  # the rules, as results name them


@dataclass(frozen=True)
class TraceStats:
    """What the checks and bounds read of the trace: each request's prompt and
    output tokens, and the most of its prompt a prefix cache could hold for it."""

    prompt: np.ndarray
    output: np.ndarray
    # Tokens of each prompt some other request's prompt shares as a prefix (by the
    # trace's prefix-block hashes), the last token never: an upper bound on its
    # prefix-cache hits whatever the cache, the routing and the order.
    cacheable: np.ndarray

    @classmethod
    def of(cls, trace: pd.DataFrame) -> TraceStats:
        prompt = trace["prompt_tokens"].to_numpy(np.int64)
        hashes = trace["prefix_hash_ids"] if "prefix_hash_ids" in trace else [None] * len(trace)
        block = int(trace.attrs.get("hash_block_tokens", 512))
        chains = [tuple(h) if isinstance(h, tuple | list | np.ndarray) else () for h in hashes]
        shared = shared_prefix_blocks(chains)
        cacheable = np.minimum(np.array(shared, np.int64) * block, prompt - 1).clip(0)
        return cls(prompt, trace["output_tokens"].to_numpy(np.int64), cacheable)

    @property
    def longest(self) -> int:
        """The most tokens one request holds in the KV cache (prompt and output)."""
        return int((self.prompt + self.output).max())


def shared_prefix_blocks(chains: list[tuple]) -> list[int]:
    """For each hash chain, the length of its longest prefix that another chain
    also starts with."""
    counts: Counter[tuple] = Counter()
    for chain in chains:
        counts.update(chain[:k] for k in range(1, len(chain) + 1))
    out = []
    for chain in chains:
        k = len(chain)
        while k and counts[chain[:k]] < 2:  # itself, and another
            k -= 1
        out.append(k)
    return out


@dataclass(frozen=True)
class Fit:
    """A deployment the checks keep: its engine fields and KV cache per instance."""

    engine: dict[str, Any]
    kv_tokens: int  # per instance


class Checker:
    """The static checks for one base config (model, hardware, engine, trace)."""

    def __init__(self, cfg: DictConfig, trace: pd.DataFrame, budget: int) -> None:
        self.cfg = cfg
        self.spec: ModelSpec = model_spec(cfg.model)
        self.hw = hardware_spec(cfg)
        self.base_engine = OmegaConf.to_container(cfg.engine, resolve=True)
        self.budget = budget
        self.stats = TraceStats.of(trace)
        self.max_model_len = int(
            self.base_engine["max_model_len"] or self.spec.max_position_embeddings
        )
        if self.stats.longest > self.max_model_len:
            raise InputError(
                f"trace={cfg.trace.name}: a request holds {self.stats.longest} tokens, beyond "
                f"the model's max_model_len {self.max_model_len}, so no configuration serves "
                "every request; cap the trace's lengths (trace.max_model_len=...) or take "
                "fewer requests (trace.num_requests)"
            )

    def engine(self, dep: Deployment) -> dict[str, Any]:
        """The engine group's fields for ``dep`` (the base config's, with its knobs)."""
        return {**self.base_engine, **dep.engine_overrides()}

    def check(self, dep: Deployment) -> Fit | tuple[str, str]:
        """``dep``'s engine and KV cache, or (rule, reason) where it cannot run."""
        if dep.gpus > self.budget:
            return BUDGET, f"{dep.gpus} GPUs, over the budget of {self.budget}"
        engine = self.engine(dep)
        try:
            dep.pools()
            parallelism(engine).check(self.spec)
            scheduler_config(engine, self.max_model_len)
        except (ValueError, InputError) as e:
            return INVALID, str(e)
        try:
            blocks = kv_blocks(
                engine, self.spec, self.hw, self.cfg.model.dtype, self.cfg.hardware.kv_cache_bytes
            )
        except InputError as e:
            return MEMORY, str(e)
        kv_tokens = blocks * int(engine["block_size"])
        if kv_tokens < self.stats.longest:
            return MEMORY, (
                f"its KV cache holds {kv_tokens} tokens an instance, fewer than the "
                f"trace's longest request ({self.stats.longest})"
            )
        return Fit(engine, kv_tokens)


def check_all(
    checker: Checker, deployments: list[Deployment]
) -> tuple[dict[int, Fit], dict[int, tuple[str, str]]]:
    """The deployments kept (by ``num``, with their fit) and those dropped (with
    the rule and the reason)."""
    kept: dict[int, Fit] = {}
    dropped: dict[int, tuple[str, str]] = {}
    for dep in deployments:
        result = checker.check(dep)
        if isinstance(result, Fit):
            kept[dep.num] = result
        else:
            dropped[dep.num] = result
    return kept, dropped
