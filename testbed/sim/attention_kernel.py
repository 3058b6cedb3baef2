"""One decoder layer's attention time on one GPU, from published kernel measurements.

Two published curves per GPU, both in ``data/attention_kernels.json`` with their
sources (``docs/gpu_latency_sources.md`` explains each):

* **prefill**: achieved FLOP/s of a causal forward pass against sequence length
  (FlashAttention-3 on Hopper, FlashAttention-2 elsewhere), kept as fractions of
  the measuring GPU's peak;
* **decode**: kernel time against the ideal time ``bytes / bandwidth`` of the
  KV cache it reads, for one request and for a batch (FlashInfer's batch-decode
  bandwidth utilisation; its batches of 16 and 64 fall on one curve of total
  bytes). Kept in time rather than bytes so that a sibling GPU with another
  bandwidth keeps the measured latency floor.

A step (prefill chunks and decodes mixed) is known only by its aggregates::

    t_compute = 4 * heads * head_dim * attn_pairs / (eff(L) * peak_flops)
        L = 2 * attn_pairs / num_tokens      (causal length with the same keys per query)
    t_memory  = one-request curve at bytes / mem_bandwidth             (num_reqs == 1)
              = max(batch curve there, one-request curve at max_kv)    (num_reqs > 1)
        bytes = kv_tokens * 2 * kv_heads * head_dim * dtype
    seconds   = (t_compute**p + t_memory**p) ** (1 / p)

``p`` (3) sits between ``max`` (p = inf) and the sum (p = 1): FlashInfer's
append figure (128 or 256 queries against a long cache, near the ridge point)
lies between the two, closest to p = 3. Query and output bytes are left out of
``t_memory``: the decode curves count the KV cache read, and the prefill curves
already include a prefill kernel's own traffic.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path

import numpy as np

DATA_PATH = Path(__file__).with_name("data") / "attention_kernels.json"


class AttentionKernel:
    """Seconds of one decoder layer's attention on one GPU (its share of heads), from
    published kernel measurements."""

    def __init__(self, gpu: str, data_path: Path | None = None) -> None:
        path = Path(data_path) if data_path is not None else DATA_PATH
        data = json.loads(path.read_text())
        gpus = data["gpus"]
        if gpu not in gpus:
            raise ValueError(
                f"{path}: no attention-kernel figures for GPU {gpu!r}; "
                f"known: {', '.join(sorted(gpus))}"
            )
        self.gpu = gpu
        entry = gpus[gpu]
        prefill = _entry(data, "prefill_curves", entry["prefill"], path)
        decode = _entry(data, "decode_curves", entry["decode"], path)
        self._p = float(data["combine_exponent"])
        # Achieved FLOP/s (a fraction of peak) against log causal length.
        self._log_len, self._eff = _prefill_table(prefill, path)
        self._prefill = Curve(self._log_len, self._eff)
        # Decode curves: log kernel time against log ideal time, one request and
        # batched; past their last point the time grows as the ideal does (the last
        # utilisation), below their first it stays (the launch floor).
        self._log_t1, self._log_T1 = _decode_table(decode, {"batch_1": 1}, path)
        self._log_tb, self._log_Tb = _decode_table(decode, {"batch_16": 16, "batch_64": 64}, path)
        self._one_request = Curve(self._log_t1, self._log_T1)
        self._batched = Curve(self._log_tb, self._log_Tb)
        self._last1, self._lastb = float(self._log_t1[-1]), float(self._log_tb[-1])
        self.source = (
            f"attention on {gpu}: {prefill['kernel']} prefill ({_title(data, prefill)}), "
            f"decode bandwidth ({_title(data, decode)}); {entry['scaling']}"
        )

    def seconds(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv, **shape):
        """Seconds of one layer's attention for a step of ``num_reqs`` requests computing
        ``num_tokens`` tokens (scalars) with ``attn_pairs`` query-key pairs, ``kv_tokens``
        keys read in all and ``max_kv`` by the longest request (scalars or float64 arrays:
        an array gives, element by element, exactly what the scalar call gives), for the
        layer ``shape`` that :meth:`shaped` takes."""
        shaped = self.shaped(**shape)
        if any(isinstance(x, np.ndarray) and x.ndim for x in (attn_pairs, kv_tokens, max_kv)):
            return shaped.many(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return shaped.one(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)

    def shaped(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        peak_flops: float,
        mem_bandwidth: float,
    ) -> ShapedAttention:
        """:meth:`seconds` of one layer shape on one GPU (``num_heads`` and
        ``num_kv_heads`` on that GPU, the element size, the GPU's peaks), its
        constants computed once: a simulated step calls it once."""
        return ShapedAttention(
            self,
            4.0 * num_heads * head_dim / peak_flops,
            float(2 * num_kv_heads * head_dim * dtype_bytes) / mem_bandwidth,
        )

    # The two paths below do the same float operations in the same order (numpy's
    # ufuncs for log, exp and power, on a number or an array alike; the curves'
    # own interpolation), so an array's elements equal the numbers' results.

    def _one(self, num_reqs, num_tokens, pairs, kv, longest, s_per_pair, per_token) -> float:
        p = self._p
        length = max(pairs * (2.0 / num_tokens), 1.0)
        t_compute = pairs * s_per_pair / self._prefill.at(float(np.log(length)))
        log_ideal = float(np.log(max(kv * per_token, 1e-12)))
        if num_reqs == 1:
            log_T = self._one_request.at(log_ideal) + max(log_ideal - self._last1, 0.0)
        else:
            # The batched curve by total bytes (the published batches collapse onto it),
            # but no faster than the longest request would run alone.
            log_longest = float(np.log(max(longest * per_token, 1e-12)))
            log_T = max(
                self._batched.at(log_ideal) + max(log_ideal - self._lastb, 0.0),
                self._one_request.at(log_longest) + max(log_longest - self._last1, 0.0),
            )
        return float(np.power(np.power(t_compute, p) + np.exp(log_T * p), 1.0 / p))

    def _many(self, num_reqs, num_tokens, pairs, kv, longest, s_per_pair, per_token):
        p = self._p
        length = np.maximum(pairs * (2.0 / num_tokens), 1.0)
        t_compute = pairs * s_per_pair / self._prefill.many(np.log(length))
        log_ideal = np.log(np.maximum(kv * per_token, 1e-12))
        if num_reqs == 1:
            log_T = self._one_request.many(log_ideal) + np.maximum(log_ideal - self._last1, 0.0)
        else:
            log_longest = np.log(np.maximum(longest * per_token, 1e-12))
            log_T = np.maximum(
                self._batched.many(log_ideal) + np.maximum(log_ideal - self._lastb, 0.0),
                self._one_request.many(log_longest) + np.maximum(log_longest - self._last1, 0.0),
            )
        # Ufuncs only (np.power, not **): ** on numpy scalars can differ in the last bit.
        return np.power(np.power(t_compute, p) + np.exp(log_T * p), 1.0 / p)


class ShapedAttention:
    """:meth:`AttentionKernel.seconds` of one layer shape: :meth:`one` for numbers,
    :meth:`many` for arrays of pairs, keys and longest contexts."""

    def __init__(self, kernel: AttentionKernel, s_per_pair: float, per_token: float) -> None:
        self.kernel, self.s_per_pair, self.per_token = kernel, s_per_pair, per_token

    def one(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        if num_tokens <= 0 or num_reqs <= 0:
            return 0.0
        return self.kernel._one(
            num_reqs, num_tokens, float(attn_pairs), float(kv_tokens), float(max_kv),
            self.s_per_pair, self.per_token,
        )  # fmt: skip

    def many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> np.ndarray:
        pairs = np.asarray(attn_pairs, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        longest = np.asarray(max_kv, dtype=np.float64)
        if num_tokens <= 0 or num_reqs <= 0:
            return np.zeros(np.broadcast(pairs, kv, longest).shape)
        return self.kernel._many(
            num_reqs, num_tokens, pairs, kv, longest, self.s_per_pair, self.per_token
        )


class Curve:
    """Piecewise-linear ``y(x)``, flat beyond its ends, on a number (:meth:`at`, in
    Python: ``np.interp``'s own operations, without its per-call cost) or an array
    (:meth:`many`, ``np.interp``), the two equal bit for bit."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if len(x) < 2 or not (np.diff(x) > 0).all():
            raise ValueError(f"a curve needs 2+ points at increasing x, got {x.tolist()}")
        self.x, self.y, self.slope = x, y, np.diff(y) / np.diff(x)
        self._x, self._y, self._slope = x.tolist(), y.tolist(), self.slope.tolist()

    def at(self, v: float) -> float:
        xs = self._x
        if v <= xs[0]:
            return self._y[0]
        if v >= xs[-1]:
            return self._y[-1]
        j = bisect_right(xs, v) - 1
        return self._y[j] + (v - xs[j]) * self._slope[j]

    def many(self, v: np.ndarray) -> np.ndarray:
        """:meth:`at` of each element: numpy's interpolation does the same operations."""
        return np.interp(v, self.x, self.y)


def _entry(data: dict, table: str, name: str, path: Path) -> dict:
    if name not in data[table]:
        raise ValueError(f"{path}: {table} has no curve {name!r}")
    return data[table][name]


def _title(data: dict, curve: dict) -> str:
    s = data["sources"][curve["source"]]
    return f"{s['figure'].split(':')[0]} of {s['url'].split(' ')[0]}, {s['date']}"


def _prefill_table(curve: dict, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(log sequence length, efficiency as a fraction of the measuring GPU's peak)."""
    pts = sorted((p["seq_len"], p["tflops"]) for p in curve["points"])
    if len(pts) < 2 or any(t <= 0 or n <= 0 for n, t in pts):
        raise ValueError(f"{path}: prefill curve for {curve['gpu']} needs 2+ positive points")
    lengths, tflops = np.array(pts, dtype=np.float64).T
    return np.log(lengths), tflops * 1e12 / float(curve["peak_flops"])


def _decode_table(curve: dict, batches: dict[str, int], path: Path):
    """(log ideal time, log kernel time) of the batches' points on one axis: each point
    is a batch's (sequence length, utilisation %) at ``bytes_per_token`` and the
    measuring GPU's bandwidth. Points at the same total size are averaged, and the
    times made non-decreasing (a reading that dips is held at its predecessor)."""
    by_ideal: dict[float, list[float]] = {}
    for key, batch in batches.items():
        for seq_len, util in curve[key]:
            if not 0 < util <= 100:
                raise ValueError(f"{path}: {curve['gpu']} {key}: utilisation {util} is not in %")
            ideal = batch * seq_len * curve["bytes_per_token"] / curve["mem_bandwidth"]
            by_ideal.setdefault(ideal, []).append(ideal / (util / 100.0))
    ideal = np.array(sorted(by_ideal))
    time = np.maximum.accumulate(np.array([np.mean(by_ideal[t]) for t in ideal]))
    return np.log(ideal), np.log(time)
