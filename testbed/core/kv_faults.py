"""Injected faults of KV transfers between a prefill and a decode instance, for
fault experiments and tests: which transfers fail and how. A transfer is struck
by a hash of its request's id and the seed, so the simulator and the real engine
fail the same requests.

``fail``: the transfer errors (the sender cannot send); ``hang``: it never
completes and the receiver's timeout ends it. Either way the decode instance
recomputes the prompt (``kv_transfer_failed``, ``kv_recomputed_tokens``) and the
prefill instance frees the blocks it kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

FAULT_KINDS = ("fail", "hang")


@dataclass(frozen=True)
class KVFaults:
    """A fraction ``rate`` of transfers fails as ``kind``; the rest are untouched."""

    kind: str = "fail"
    rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"KV fault kind must be one of {FAULT_KINDS}, not {self.kind!r}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"KV fault rate must be within [0, 1], not {self.rate}")

    def strikes(self, request_id: str) -> str | None:
        """The fault of the transfer of ``request_id``'s KV (its decode-side id), or None."""
        if self.rate <= 0.0:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        return self.kind if int.from_bytes(digest, "little") < self.rate * 2.0**64 else None
