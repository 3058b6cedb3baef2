"""The scheduler's half of a KV connector, as vLLM V1 splits it
(``KVConnectorBase_V1``'s scheduler-side methods): what a request's KV that lives
on another instance means for scheduling. The data side that moves the bytes is
the engine's (or the simulator's); the two meet in ``SchedulerOutput
.kv_connector_metadata`` (what to move this step) and in the finished-sending /
finished-receiving ids the data side reports back
(:meth:`testbed.core.scheduler.Scheduler.update_connector_output`).

:class:`PDConnector` is disaggregated prefill/decode: on a prefill instance
(``producer``) a request sent with ``kv_transfer_params={"do_remote_decode":
True}`` keeps its blocks after it finishes, until its KV has been sent; on a
decode instance (``consumer``) a request with ``{"do_remote_prefill": True,
...}`` takes its prompt's KV from the producer those params name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed.core.request import SERVED, Request, SamplingParams

LEG_SUFFIX = "@prefill"  # a prefill leg's id: its request's, with this after


class KVConnector:
    """No KV from elsewhere, nothing kept after a request finishes (the base: a
    connector overrides what it needs)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of ``request``, past the ``num_computed_tokens`` it has locally,
        whose KV another instance provides (loaded before the request runs)."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """``request`` got ``block_ids`` for its ``num_external_tokens`` remote tokens."""

    def build_connector_meta(self, out) -> Any:
        """What the data side must do in this step (``out``: the step's schedule)."""
        return None

    def update_connector_output(self, finished_sending: set[str], finished_recving: set[str]):
        """The data side finished sending the KV of ``finished_sending`` and receiving
        that of ``finished_recving``."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """``request`` finished here: whether its blocks must stay allocated until its
        KV has been sent (the scheduler frees them on ``finished_sending``), and the
        params the instance that continues it needs."""
        return False, None


@dataclass
class KVLoad:
    """One request's KV to receive: from which instance, and the request's blocks
    here and there."""

    request_id: str
    num_tokens: int
    block_ids: list[int]
    remote_instance: int | None
    remote_request_id: str | None
    remote_block_ids: list[int] | None


@dataclass
class PDMetadata:
    """A step's transfers to start: the loads of requests that got their blocks."""

    loads: list[KVLoad] = field(default_factory=list)


class PDConnector(KVConnector):
    """Disaggregated prefill/decode (vLLM's NIXL connector's protocol, with the
    transport left to the data side)."""

    def __init__(self, role: str, instance: int = 0) -> None:
        if role not in ("producer", "consumer", "both"):
            raise ValueError(f"PDConnector role must be producer, consumer or both, not {role!r}")
        self.role, self.instance = role, instance
        self._to_load: list[KVLoad] = []
        self._received: set[str] = set()  # loaded (or failed): never asked again

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if self.role == "producer" or not params or not params.get("do_remote_prefill"):
            return 0
        if request.request_id in self._received:  # preempted since: recompute here
            return 0
        # The remote instance computed the prompt; the last token is computed here
        # (its logits give the first token).
        return max(0, request.num_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params or {}
        self._to_load.append(
            KVLoad(
                request.request_id,
                num_external_tokens,
                list(block_ids),
                params.get("remote_instance"),
                params.get("remote_request_id"),
                params.get("remote_block_ids"),
            )
        )

    def build_connector_meta(self, out) -> PDMetadata | None:
        if not self._to_load:
            return None
        meta, self._to_load = PDMetadata(self._to_load), []
        return meta

    def update_connector_output(self, finished_sending: set[str], finished_recving: set[str]):
        self._received |= finished_recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._received.discard(request.request_id)
        params = request.kv_transfer_params
        if self.role == "consumer" or not params or not params.get("do_remote_decode"):
            return False, None
        return True, {
            "do_remote_prefill": True,
            "remote_instance": self.instance,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "num_tokens": request.num_computed_tokens,
        }


def prefill_leg(request: Request) -> Request:
    """The request as its prefill instance gets it: the same prompt, one token."""
    return Request(
        request_id=request.request_id + LEG_SUFFIX,
        prompt_token_ids=request.prompt_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
        tenant=request.tenant,
        priority=request.priority,
        ttft_slo_s=request.ttft_slo_s,
        arrival_time=request.arrival_time,
        prefix_hash_ids=request.prefix_hash_ids,
        hash_block_tokens=request.hash_block_tokens,
        kv_transfer_params={"do_remote_decode": True},
    )


def hand_over(leg: Request, request: Request) -> bool:
    """A prefill leg is back from its instance: True if ``request`` goes on to a
    decode instance (it takes the leg's transfer params, first scheduled time and
    prefix hit); False if the leg was refused or aborted, and so is ``request``
    (the leg's status, reasons and time copied)."""
    if leg.status in SERVED and leg.kv_transfer_params:
        request.kv_transfer_params = leg.kv_transfer_params
        request.first_scheduled_time = leg.first_scheduled_time
        request.num_cached_tokens = leg.num_cached_tokens
        return True
    request.status, request.finish_time = leg.status, leg.finish_time
    request.finish_reason, request.reject_reason = leg.finish_reason, leg.reject_reason
    return False
