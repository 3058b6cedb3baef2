"""Requests and their sampling parameters.

A :class:`Request` is the one object that travels through the whole testbed:
the trace loader creates it, the scheduler moves it between queues and counts
its computed tokens, the data plane (simulated or real) reads it to build a
batch, and the metrics read its timestamps. Prompts are either real token ids
or, for traces that carry only lengths, a length plus optional prefix-block
hash ids (so that prefix caching still sees which requests share a prefix).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

STAND_IN_TOKEN = 0  # what a simulated data plane "samples"


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status at or above ``FINISHED_STOPPED`` is final."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # blocks allocated, KV arriving from another instance
    RUNNING = 2
    PREEMPTED = 3  # back in the waiting queue, will recompute from scratch
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH = 5  # max_tokens, the trace's output length, or max_model_len
    FINISHED_ABORTED = 6
    REJECTED = 7  # never served; ``reject_reason`` says why

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# Finished by being served to the end: a stop token or its length (not aborted, not rejected).
SERVED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass(slots=True)
class SamplingParams:
    """How to sample a request's output (the vLLM convention).

    ``max_tokens=None`` means "until EOS or the model's context length".
    ``ignore_eos`` is what trace replay uses: the trace fixes each output length.
    ``temperature=0`` is greedy. ``seed`` makes a sampled request reproducible.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(slots=True, eq=False)
class Request:
    """One inference request and everything measured about it.

    Give ``prompt_token_ids`` when the prompt has real tokens, or only
    ``num_prompt_tokens`` for a length-only trace row; ``prefix_hash_ids`` (with
    ``hash_block_tokens`` tokens per id, as in the Mooncake traces) then says
    which requests share which prefix blocks. ``target_output_tokens`` is the
    output length a replayed trace asks for: the request stops there, and oracle
    policies (SJF, SRPT) may read it.
    """

    request_id: str
    prompt_token_ids: Sequence[int] | None = None
    num_prompt_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    target_output_tokens: int | None = None
    predicted_output_tokens: int | None = None  # a length predictor's guess, if any
    eos_token_id: int | None = None
    tenant: str = "default"
    priority: int = 0  # lower is more urgent (the vLLM convention)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    arrival_time: float = 0.0
    prefix_hash_ids: Sequence[int] | None = None
    hash_block_tokens: int = 512
    # Disaggregated prefill/decode: the number of prompt tokens whose KV is
    # computed on another instance and arrives over a KV link.
    remote_kv_tokens: int = 0
    # vLLM's kv_transfer_params: {"do_remote_decode": True} sends a request's KV on
    # when it finishes (a prefill instance); {"do_remote_prefill": True,
    # "remote_instance": ..., ...} takes it from there (testbed.core.kv_connector).
    kv_transfer_params: dict | None = None

    # --- state owned by the scheduler ---
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: Sequence[int] = ()  # drafts to verify (a list when there are any)
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1: not yet
    num_preemptions: int = 0
    finish_reason: str | None = None
    reject_reason: str | None = None
    arrival_seq: int = -1  # tie-breaker, set by the scheduler on arrival
    max_num_tokens: int = 0  # prompt + output at which it stops, set by the scheduler

    # --- timestamps (seconds on the run's clock) ---
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: array | None = None  # when each output token came (from the first)

    # --- spec-decode counters ---
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    # --- its KV transfer (disaggregated prefill/decode) ---
    kv_transfer_start: float | None = None
    kv_transfer_end: float | None = None
    kv_transfer_bytes: int = 0
    kv_transfer_failed: bool = False  # its prompt was recomputed here instead
    kv_recomputed_tokens: int = 0  # prompt tokens computed here because the transfer failed

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.target_output_tokens is not None and self.sampling_params.max_tokens is None:
            self.sampling_params.max_tokens = self.target_output_tokens

    # --- token counts ---
    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: what the computed count catches up with."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def max_output_tokens(self) -> int | None:
        """The most output tokens this request may produce (None: unbounded)."""
        caps = [c for c in (self.sampling_params.max_tokens, self.target_output_tokens) if c]
        return min(caps) if caps else None

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def is_prefill(self) -> bool:
        """True while the request has prompt tokens left to compute."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def block_content(self, index: int, block_size: int) -> Hashable | None:
        """A key equal for two requests exactly when block ``index`` holds the same tokens.

        None when the block's contents are unknown (a length-only prompt without
        prefix hashes, or stand-in output tokens of a simulation): such a block is
        never shared through the prefix cache.
        """
        start = index * block_size
        end = start + block_size
        if self.prompt_token_ids is not None:
            n_prompt = self.num_prompt_tokens
            if end <= n_prompt:
                return tuple(self.prompt_token_ids[start:end])
            out = self.output_token_ids
            if end - n_prompt > len(out):
                return None
            head = tuple(self.prompt_token_ids[start:n_prompt]) if start < n_prompt else ()
            return head + tuple(out[max(0, start - n_prompt) : end - n_prompt])
        hashes = self.prefix_hash_ids
        if hashes is None or self.hash_block_tokens % block_size != 0:
            return None
        per_hash = self.hash_block_tokens // block_size
        h = index // per_hash
        # A hash id covers hash_block_tokens tokens; the last id may cover a
        # partial block of the prompt, and then only its full blocks are known.
        if h >= len(hashes) or end > self.num_prompt_tokens:
            return None
        return (hashes[h], index % per_hash)

    def keep_counts_only(self) -> None:
        """Free a finished simulated request's per-token records: its stand-in
        output becomes its count (:class:`StandInOutput`) and its token times go
        (the simulator has pooled its gaps by then). A million requests' tokens
        would otherwise take gigabytes."""
        self.output_token_ids = StandInOutput.of(len(self.output_token_ids))
        self.token_times = None

    def __repr__(self) -> str:  # short: requests show up in assertion messages
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )


class StandInOutput(Sequence[int]):
    """A finished simulated request's output: ``n`` stand-in tokens, kept as their
    count (immutable: requests with as many tokens share one, :meth:`of`)."""

    __slots__ = ("_n",)
    _made: ClassVar[dict[int, StandInOutput]] = {}

    def __init__(self, n: int) -> None:
        self._n = n

    @classmethod
    def of(cls, n: int) -> StandInOutput:
        if (made := cls._made.get(n)) is None:
            made = cls._made[n] = cls(n)
        return made

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [STAND_IN_TOKEN] * len(range(*index.indices(self._n)))
        if not -self._n <= index < self._n:
            raise IndexError(f"output token {index} of {self._n}")
        return STAND_IN_TOKEN

    def __repr__(self) -> str:
        return f"StandInOutput({self._n})"
