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
from numpy._core.multiarray import interp as _interp  # np.interp without its checks

DATA_PATH = Path(__file__).with_name("data") / "attention_kernels.json"
DENSE_POINTS = 1024  # a published curve's grid, geometric between its ends
NORM_POINTS = 2049  # the p-norm's table on [0, 1]
FAR = 1e12  # a decode curve's far point, on the line past its last (as a multiple)


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
        # The published curves are piecewise linear in log-log; a step evaluates them
        # on dense geometric grids, linearly in between (within about 0.03% of the
        # log-log curve), and the p-norm as max x g(min / max) from a table of g:
        # arithmetic and interpolation only, the same on a number and an array.
        # Achieved FLOP/s (a fraction of peak) against causal length.
        self._log_len, self._eff = _prefill_table(prefill, path)
        self._prefill = _dense(self._log_len, self._eff, exp_y=False)
        # Decode: kernel time against ideal time (bytes / bandwidth), one request and
        # batched; past the last point the time grows as the ideal does (the last
        # utilisation), below the first it stays (the launch floor).
        self._log_t1, self._log_T1 = _decode_table(decode, {"batch_1": 1}, path)
        self._log_tb, self._log_Tb = _decode_table(decode, {"batch_16": 16, "batch_64": 64}, path)
        self._one_request = _dense(self._log_t1, self._log_T1, exp_y=True)
        self._batched = _dense(self._log_tb, self._log_Tb, exp_y=True)
        r = np.linspace(0.0, 1.0, NORM_POINTS)
        self._norm = Curve(r, (1.0 + r**self._p) ** (1.0 / self._p))
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

    # The two paths below do the same float operations in the same order (arithmetic
    # and the curves' interpolation), so an array's elements equal the numbers'.

    def _one(self, num_reqs, num_tokens, pairs, kv, longest, s_per_pair, per_token) -> float:
        length = max(pairs * (2.0 / num_tokens), 1.0)
        t_compute = pairs * s_per_pair / self._prefill.at(length)
        if num_reqs == 1:
            t_memory = self._one_request.at(kv * per_token)
        else:
            # The batched curve by total bytes (the published batches collapse onto it),
            # but no faster than the longest request would run alone.
            t_memory = max(
                self._batched.at(kv * per_token), self._one_request.at(longest * per_token)
            )
        # t_memory > 0 (the curves' launch floor), so the larger part is too.
        big, small = max(t_compute, t_memory), min(t_compute, t_memory)
        return big * self._norm.at(small / big)

    def _many(self, num_reqs, num_tokens, pairs, kv, longest, s_per_pair, per_token):
        length = np.maximum(pairs * (2.0 / num_tokens), 1.0)
        t_compute = pairs * s_per_pair / self._prefill.many(length)
        if num_reqs == 1:
            t_memory = self._one_request.many(kv * per_token)
        else:
            t_memory = np.maximum(
                self._batched.many(kv * per_token), self._one_request.many(longest * per_token)
            )
        big, small = np.maximum(t_compute, t_memory), np.minimum(t_compute, t_memory)
        return big * self._norm.many(small / big)


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


def _dense(log_x: np.ndarray, log_or_y: np.ndarray, exp_y: bool) -> Curve:
    """A curve published piecewise linear in log x (and in log y with ``exp_y``) on a
    geometric grid of ``DENSE_POINTS`` between its ends. With ``exp_y`` (a kernel time
    against an ideal time) the time past the last point grows as the ideal does (the
    last utilisation held): a far point on that line extends the curve."""
    grid = np.linspace(float(log_x[0]), float(log_x[-1]), DENSE_POINTS)
    y = np.interp(grid, log_x, log_or_y)
    if not exp_y:
        return Curve(np.exp(grid), y)
    x, t = np.exp(grid), np.exp(y)
    return Curve(np.append(x, x[-1] * FAR), np.append(t, t[-1] * FAR))


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
        """:meth:`at` of each element: numpy's interpolation (its compiled routine,
        which ``np.interp`` calls after checks these float arrays pass) does the same
        operations."""
        return _interp(v, self.x, self.y)


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
