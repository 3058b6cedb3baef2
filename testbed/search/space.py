"""The deployment search's space: a list of values per knob, and the
configurations (deployments) it expands to, each as the overrides of a run.

Knobs (:data:`KNOBS`):

* ``replicas``: engine instances (colocated replicas, or prefill + decode ones);
* ``tensor_parallel``, ``pipeline_parallel``: the GPUs one instance spans;
* ``split``: ``colocated``, or a prefill:decode ratio (``1:1``, ``1:3``) that
  divides the instances between prefill and decode (``cluster=disagg``);
* ``max_num_seqs``, ``max_num_batched_tokens``, ``chunked_prefill``: the engine's
  batch limits (vLLM's names);
* ``policy``: a bundled scheduling policy (``policies/``);
* ``router``: the cluster's router (the prefill instance's, disaggregated).

A deployment uses ``replicas x tensor_parallel x pipeline_parallel`` GPUs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from testbed.errors import InputError

COLOCATED = "colocated"


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _split(v: Any) -> bool:
    return v == COLOCATED or (isinstance(v, str) and parse_split(v) is not None)


def _policy(v: Any) -> bool:
    from policies import REGISTRY

    return v in REGISTRY


def _router(v: Any) -> bool:
    from policies.routers import ROUTERS

    return v in ROUTERS


# knob -> (check, what is allowed)
KNOBS: dict[str, tuple[Any, str]] = {
    "replicas": (_positive_int, "integers >= 1"),
    "tensor_parallel": (_positive_int, "integers >= 1"),
    "pipeline_parallel": (_positive_int, "integers >= 1"),
    "split": (_split, f"{COLOCATED!r} or prefill:decode ratios such as '1:1'"),
    "max_num_seqs": (_positive_int, "integers >= 1"),
    "max_num_batched_tokens": (_positive_int, "integers >= 1"),
    "chunked_prefill": (lambda v: isinstance(v, bool), "true or false"),
    "policy": (_policy, "bundled policy names (policies/__init__.py's REGISTRY)"),
    "router": (_router, "router names (policies/routers.py)"),
}


def parse_split(text: str) -> tuple[int, int] | None:
    """``"1:3"`` -> (1, 3); None where it is not a ratio of two integers >= 1."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        return None
    return int(m[1]), int(m[2])


@dataclass(frozen=True)
class Space:
    """The values the search tries for each knob (the space is their product)."""

    replicas: tuple[int, ...]
    tensor_parallel: tuple[int, ...]
    pipeline_parallel: tuple[int, ...]
    split: tuple[str, ...]
    max_num_seqs: tuple[int, ...]
    max_num_batched_tokens: tuple[int, ...]
    chunked_prefill: tuple[bool, ...]
    policy: tuple[str, ...]
    router: tuple[str, ...]

    @classmethod
    def of(cls, mapping: Mapping[str, Any], where: str = "space") -> Space:
        """The space of a knob -> values mapping; an unknown knob, an empty list
        or a value a knob does not take is an :class:`InputError` naming it."""
        if unknown := sorted(set(mapping) - set(KNOBS)):
            raise InputError(f"{where}.{unknown[0]}: no such knob (knobs: {', '.join(KNOBS)})")
        if missing := [k for k in KNOBS if k not in mapping]:
            raise InputError(f"{where}.{missing[0]}: no values given (a list of one at least)")
        values = {}
        for knob, (ok, allowed) in KNOBS.items():
            given = mapping[knob]
            if isinstance(given, str | bytes) or not hasattr(given, "__iter__"):
                given = [given]
            given = list(dict.fromkeys(given))  # a value listed twice is tried once
            if not given:
                raise InputError(f"{where}.{knob}: an empty list (give one value at least)")
            for v in given:
                if not ok(v):
                    raise InputError(f"{where}.{knob}: {v!r} is not one of {allowed}")
            values[knob] = tuple(given)
        return cls(**values)

    @property
    def size(self) -> int:
        """Configurations in the space (the product of the lists' lengths)."""
        n = 1
        for f in fields(self):
            n *= len(getattr(self, f.name))
        return n

    def expand(self) -> list[Deployment]:
        """Every configuration of the space, in the knobs' order."""
        lists = [getattr(self, k) for k in KNOBS]
        return [
            Deployment(num, **dict(zip(KNOBS, combo, strict=True)))
            for num, combo in enumerate(itertools.product(*lists))
        ]


@dataclass(frozen=True)
class Deployment:
    """One configuration: a value of every knob (``num``: its place in the space)."""

    num: int
    replicas: int
    tensor_parallel: int
    pipeline_parallel: int
    split: str
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    policy: str
    router: str

    @property
    def id(self) -> str:
        return f"c{self.num:04d}"

    @property
    def gpus_per_instance(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_instance

    @property
    def disaggregated(self) -> bool:
        return self.split != COLOCATED

    def pools(self) -> tuple[int, int] | None:
        """(prefill, decode) instances of a disaggregated deployment; None where
        colocated. Raises ValueError where the ratio does not divide the instances."""
        if not self.disaggregated:
            return None
        p, d = parse_split(self.split)
        if self.replicas % (p + d):
            raise ValueError(
                f"split {self.split} needs a multiple of {p + d} instances, not {self.replicas}"
            )
        k = self.replicas // (p + d)
        return k * p, k * d

    @property
    def shape(self) -> str:
        """``TP4 PP1 x 2`` (colocated) or ``TP4 PP1 1P1D`` (disaggregated)."""
        parallel = f"TP{self.tensor_parallel} PP{self.pipeline_parallel}"
        if not self.disaggregated:
            return f"{parallel} x {self.replicas}"
        try:
            p, d = self.pools()
        except ValueError:
            return f"{parallel} x {self.replicas} ({self.split})"
        return f"{parallel} {p}P{d}D"

    @property
    def label(self) -> str:
        """The shape and the engine's settings, in one line."""
        chunked = "chunked" if self.chunked_prefill else "unchunked"
        return (
            f"{self.shape}, seqs {self.max_num_seqs}, tokens {self.max_num_batched_tokens}, "
            f"{chunked}, {self.policy}, {self.router}"
        )

    def knobs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in KNOBS}

    def engine_overrides(self) -> dict[str, Any]:
        """The engine group's fields this deployment sets."""
        return {
            "tensor_parallel_size": self.tensor_parallel,
            "pipeline_parallel_size": self.pipeline_parallel,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_chunked_prefill": self.chunked_prefill,
        }

    def overrides(self) -> list[str]:
        """The run's Hydra overrides for this deployment (the rate aside)."""
        out = [f"engine.{k}={str(v).lower()}" for k, v in self.engine_overrides().items()]
        out.append(f"policy={self.policy}")
        pools = self.pools()
        if pools is None:
            out += ["cluster=single", f"cluster.num_replicas={self.replicas}"]
        else:
            out += ["cluster=disagg", f"cluster.num_prefill={pools[0]}"]
            out.append(f"cluster.num_decode={pools[1]}")
        out.append(f"cluster.router={self.router}")
        return out


# Keys of a run's config that the search sets: a command line that sets one too
# is refused (the search's value would silently win, or the user's).
SET_BY_SEARCH = (
    "engine.tensor_parallel_size",
    "engine.pipeline_parallel_size",
    "engine.max_num_seqs",
    "engine.max_num_batched_tokens",
    "engine.enable_chunked_prefill",
    "policy",
    "cluster",
    "cluster.num_replicas",
    "cluster.num_prefill",
    "cluster.num_decode",
    "cluster.router",
    "trace.rate",
    "trace.time_scale",
    "load",
)
