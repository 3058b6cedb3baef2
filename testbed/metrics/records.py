"""What ``requests.csv`` says of each request, kept as columns.

A run of a million requests need not keep a million :class:`Request` objects
(about 600 bytes each with their fields) once they have finished: the
simulator records each as it finishes, in about 150 bytes, and lets it go.
:func:`requests_frame` turns records, or requests, into the table.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import numpy as np
import pandas as pd

from testbed.core import Request, RequestStatus
from testbed.core.request import SERVED

_STATUS_NAMES = [s.name.lower() for s in RequestStatus]  # by status value
_FLOATS = (
    "arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "ttft_slo_s",
    "tpot_slo_s",
    "kv_transfer_start_s",
    "kv_transfer_end_s",
)
_INTS = (
    "index",
    "priority",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "preemptions",
    "status",
    "draft_tokens",
    "accepted_tokens",
    "kv_transfer_bytes",
    "kv_transfer_failed",
    "kv_recomputed_tokens",
)


def _float(v: float | None) -> float:
    return math.nan if v is None else v


class RequestRecords:
    """One record per request added, in columns; the table in the order of the
    requests' indices (their position in the trace)."""

    def __init__(self) -> None:
        self._floats = {name: array("d") for name in _FLOATS}
        self._ints = {name: array("q") for name in _INTS}
        self._ids: list[str] = []
        self._tenants: list[str] = []
        self._reasons: list[str] = []

    @classmethod
    def of(cls, requests: Sequence[Request]) -> RequestRecords:
        records = cls()
        for i, req in enumerate(requests):
            records.add(req, i)
        return records

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, req: Request, index: int) -> None:
        """Record ``req`` as it is now, as the trace's request number ``index``."""
        f, i = self._floats, self._ints
        f["arrival_s"].append(req.arrival_time)
        f["first_scheduled_s"].append(_float(req.first_scheduled_time))
        f["first_token_s"].append(_float(req.first_token_time))
        f["finish_s"].append(_float(req.finish_time))
        f["ttft_slo_s"].append(_float(req.ttft_slo_s))
        f["tpot_slo_s"].append(_float(req.tpot_slo_s))
        f["kv_transfer_start_s"].append(_float(req.kv_transfer_start))
        f["kv_transfer_end_s"].append(_float(req.kv_transfer_end))
        i["index"].append(index)
        i["priority"].append(req.priority)
        i["prompt_tokens"].append(req.num_prompt_tokens)
        i["output_tokens"].append(req.num_output_tokens)
        i["cached_tokens"].append(max(req.num_cached_tokens, 0))
        i["preemptions"].append(req.num_preemptions)
        i["status"].append(req.status)
        i["draft_tokens"].append(req.num_draft_tokens)
        i["accepted_tokens"].append(req.num_accepted_tokens)
        i["kv_transfer_bytes"].append(req.kv_transfer_bytes)
        i["kv_transfer_failed"].append(req.kv_transfer_failed)
        i["kv_recomputed_tokens"].append(req.kv_recomputed_tokens)
        self._ids.append(req.request_id)
        self._tenants.append(req.tenant)
        self._reasons.append(req.reject_reason or "")

    def frame(self) -> pd.DataFrame:
        """``requests.csv``'s table (docs/outputs.md)."""
        order = np.argsort(np.frombuffer(self._ints["index"], np.int64), kind="stable")

        def col(name: str) -> np.ndarray:
            values = self._floats[name] if name in self._floats else self._ints[name]
            dtype = np.float64 if name in self._floats else np.int64
            return np.frombuffer(values, dtype)[order]

        def objects(values: list[str]) -> list[str]:
            return [values[k] for k in order]

        first_tok, finish, n_out = col("first_token_s"), col("finish_s"), col("output_tokens")
        status = col("status")
        served = np.isin(status, [int(s) for s in SERVED])
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(served & (n_out > 1), (finish - first_tok) / (n_out - 1), math.nan)
        df = pd.DataFrame(
            {
                "request_id": objects(self._ids),
                "tenant": objects(self._tenants),
                "priority": col("priority"),
                "arrival_s": col("arrival_s"),
                "first_scheduled_s": col("first_scheduled_s"),
                "first_token_s": first_tok,
                "finish_s": finish,
                "prompt_tokens": col("prompt_tokens"),
                "output_tokens": n_out,
                "cached_tokens": col("cached_tokens"),
                "preemptions": col("preemptions"),
                "status": [_STATUS_NAMES[s] for s in status],
                "reason": objects(self._reasons),
                "ttft_slo_s": col("ttft_slo_s"),
                "tpot_slo_s": col("tpot_slo_s"),
                "draft_tokens": col("draft_tokens"),
                "accepted_tokens": col("accepted_tokens"),
                # Disaggregated prefill/decode: its prompt's KV from the prefill instance.
                "kv_transfer_start_s": col("kv_transfer_start_s"),
                "kv_transfer_end_s": col("kv_transfer_end_s"),
                "kv_transfer_bytes": col("kv_transfer_bytes"),
                "kv_transfer_failed": col("kv_transfer_failed").astype(bool),
                "kv_recomputed_tokens": col("kv_recomputed_tokens"),
                "tpot_s": tpot,
            }
        )
        df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
        df["e2e_s"] = df["finish_s"] - df["arrival_s"]
        df["queue_s"] = df["first_scheduled_s"] - df["arrival_s"]
        df.loc[~served, ["ttft_s", "e2e_s"]] = np.nan
        return df


def requests_frame(requests: Sequence[Request] | RequestRecords) -> pd.DataFrame:
    """``requests.csv``: one row per request, in both modes."""
    records = requests if isinstance(requests, RequestRecords) else RequestRecords.of(requests)
    return records.frame()
