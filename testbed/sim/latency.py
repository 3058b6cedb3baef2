"""Step-latency models: predict how long one engine step takes from its composition.

A step is summarised by five numbers (see :func:`step_features`):

* ``num_reqs``: requests in the batch (per-request CPU work: input preparation,
  sampling, bookkeeping);
* ``num_tokens``: tokens computed (every linear layer, the LM head);
* ``attn_pairs``: query-key pairs attention computes, ``sum_i n_i * (ctx_i + (n_i + 1) / 2)``
  for a request computing ``n_i`` tokens after ``ctx_i`` cached ones;
* ``kv_tokens``: cached tokens whose keys and values attention reads,
  ``sum_i (ctx_i + n_i)``;
* ``max_kv``: the most one request reads, ``max_i (ctx_i + n_i)``: attention
  kernels that pad to, or loop over chunks of, the longest context pay for
  unequal contexts beyond their total.

Two models map them to seconds. :class:`RooflineModel` charges FLOPs against
peak compute and bytes against memory bandwidth, from the model's shape and a
hardware spec sheet; it is what the simulator uses where no measurement exists,
and it says so (``kind = "roofline"``). :class:`ProfileModel` is fitted to a
profile table measured on the hardware by the project's profiler.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import pandas as pd

from testbed.core import SchedulerOutput
from testbed.models import DTYPE_BYTES, ModelSpec


def step_features(so: SchedulerOutput) -> tuple[int, int, float, int, int]:
    """``(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)`` of a scheduled step."""
    return so.features()


def decode_latencies(
    model: LatencyModel, num_reqs: int, context_tokens: int, k: int, longest_context: int
):
    """Latencies of ``k`` steps in which each of ``num_reqs`` requests decodes one
    token, after ``context_tokens`` cached tokens in total (``longest_context`` for
    the longest request) at the first. Bit for bit
    what :func:`step_features` + ``predict`` give for each such step, so the
    simulator's fast path predicts exactly what stepping would."""
    steps = np.arange(1, k + 1, dtype=np.int64)
    kv = context_tokens + num_reqs * steps
    return model.predict_many(
        num_reqs, num_reqs, kv.astype(np.float64), kv, longest_context + steps
    )


class LatencyModel(Protocol):
    kind: str  # "roofline" or "profile"
    source: str  # where its numbers come from

    def predict(
        self, num_reqs: int, num_tokens: int, attn_pairs: float, kv_tokens: int, max_kv: int
    ) -> float:
        """Seconds one step with this composition takes."""
        ...

    def predict_many(
        self,
        num_reqs: int,
        num_tokens: int,
        attn_pairs: np.ndarray,
        kv_tokens: np.ndarray,
        max_kv: np.ndarray,
    ) -> np.ndarray:
        """:meth:`predict` over arrays of attention work, with the same float operations
        in the same order (so each element equals the scalar prediction exactly)."""
        ...


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """A device from its spec sheet, plus how much of it an engine achieves."""

    name: str
    peak_flops: float  # dense FLOP/s at the model's dtype
    mem_bandwidth: float  # bytes/s
    memory_bytes: float
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s (MFU)
    bandwidth_efficiency: float = 0.8  # achieved fraction of bandwidth (MBU)
    step_overhead_s: float = 0.0  # per step: scheduling, input preparation, launches
    request_overhead_s: float = 0.0  # per request in the batch
    activation_reserve_bytes: float = 0.0
    source: str = ""

    # Keys of a hardware config (conf/hardware/) that configure the real engine
    # on the device rather than describe it.
    ENGINE_KEYS: ClassVar[tuple[str, ...]] = ("kv_cache_bytes", "threads", "cpus", "reference_cpus")

    @classmethod
    def from_config(cls, hardware: Mapping[str, Any]) -> HardwareSpec:
        """The spec of a hardware config group entry, less its engine settings."""
        return cls(**{k: v for k, v in hardware.items() if k not in cls.ENGINE_KEYS})

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "mem_bandwidth",
            "memory_bytes",
            "compute_efficiency",
            "bandwidth_efficiency",
            "step_overhead_s",
            "request_overhead_s",
            "activation_reserve_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(
                    f"hardware {self.name}: {name} must be a number >= 0, got {value!r}"
                )


class RooflineModel:
    """Analytic: compute-bound or memory-bound, whichever is slower, plus overheads."""

    kind = "roofline"

    def __init__(self, model: ModelSpec, hw: HardwareSpec, dtype: str = "bfloat16") -> None:
        self.model, self.hw, self.dtype = model, hw, dtype
        self.source = f"analytic roofline of {hw.name} spec sheet ({hw.source})"
        flops = hw.peak_flops * hw.compute_efficiency
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency
        self._s_per_token_flops = 2 * model.matmul_params / flops
        self._s_weights = model.weight_bytes(dtype) / bw
        self._s_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / flops
        self._s_per_kv_token = model.kv_bytes_per_token(dtype) / bw

    def predict(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        # max_kv: a roofline charges work and bytes, not how they are spread
        linear = max(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = max(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        hw = self.hw
        return hw.step_overhead_s + hw.request_overhead_s * num_reqs + linear + attention

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        linear = np.maximum(num_tokens * self._s_per_token_flops, self._s_weights)
        attention = np.maximum(attn_pairs * self._s_per_pair, kv_tokens * self._s_per_kv_token)
        hw = self.hw
        return hw.step_overhead_s + hw.request_overhead_s * num_reqs + linear + attention


FEATURES = ("num_reqs", "num_tokens", "attn_pairs", "kv_tokens", "max_kv")


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set), small problems only."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=0) <= 1e-12 * max(1.0, abs(grad).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


KNOTS = (2, 8, 32)  # batch sizes where a CPU or GPU GEMM changes regime
# Tokens computed past which a GPU's linear layers turn from reading their weights
# (the same time for 1 token as for 100) to compute-bound (a time per token): the
# roofline's knee, at about 150-300 tokens for 16-bit weights on an A100-H200. A
# CPU's GEMMs are compute-bound from the first token, and its fit leaves these at 0.
TOKEN_KNOTS = (128, 512)
KV_KNOTS = (8192, 32768)  # KV tokens read past which attention outgrows the caches
PAIR_KNOTS = (2**17, 2**19)  # attention pairs (a 512- and a 1,024-token prefill) likewise
GROUP_WEIGHTS = {"replay": 4.0, "point": 1.0}  # profile rows: realistic steps vs grid
# Profile rows of replayed steps (the profiler's busy replay and its sparse one):
# one group, "replay", for the fit's weights and its level.
REPLAY_GRIDS = ("replay", "replay_sparse")
# Decode-only batches of up to this many requests each get their own term (where
# the profile has at least DECODE_SIZE_ROWS of them): a CPU GEMM's cost is not
# smooth in its rows at small sizes (with one thread, the LM head of 2 or 3 rows
# reads its weights once per row, of 4 or more once in all, so 3 decodes cost
# more than 4).
DECODE_SIZES = 16
DECODE_SIZE_ROWS = 3


def decode_size(num_reqs: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """The size of each decode-only batch (each request computing one token) of
    at most :data:`DECODE_SIZES` requests; 0 for any other step."""
    reqs = np.asarray(num_reqs)
    plain = (np.asarray(num_tokens) == reqs) & (reqs <= DECODE_SIZES)
    return np.where(plain, reqs, 0).astype(np.int64)


def profile_basis(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> list:
    """The fitted model's terms: a constant; the batch size, also through concave
    ramps ``min(num_reqs, k)`` (a matrix product costs nearly the same for 1 and
    2 rows, then grows with rows); tokens, also through convex hinges (a GPU's
    weight-bound steps turning compute-bound, :data:`TOKEN_KNOTS`); attention
    pairs and KV tokens read, both also through convex hinges ``max(x - k, 0)``
    (work that outgrows the caches costs more per unit); and the longest context
    (kernels that loop over its chunks or pad to it). Small decode-only batches
    also get a term per size (:func:`decode_size`), which :class:`ProfileModel`
    fits with these and adds by lookup."""
    return [
        1.0,
        num_reqs,
        *ramps(num_reqs, KNOTS),
        num_tokens,
        *hinges(num_tokens, TOKEN_KNOTS),
        attn_pairs,
        *hinges(attn_pairs, PAIR_KNOTS),
        kv_tokens,
        *hinges(kv_tokens, KV_KNOTS),
        max_kv,
    ]


def ramps(x, knots: tuple) -> list:
    """Concave ramps ``min(x, k)`` of a number or an array."""
    if isinstance(x, np.ndarray):
        return [np.minimum(x, k) for k in knots]
    return [min(x, k) for k in knots]


def hinges(x, knots: tuple) -> list:
    """Convex hinges ``max(x - k, 0)`` of a number or an array."""
    if isinstance(x, np.ndarray):
        return [np.maximum(x - k, 0) for k in knots]
    return [max(x - k, 0) for k in knots]


class ProfileModel:
    """Fitted to measured steps: a non-negative combination of :func:`profile_basis`.

    Non-negative coefficients keep predictions positive and monotone in every
    feature, and growing at most linearly outside the measured grid. The fit
    minimises relative error, so short steps count as much as long ones.
    """

    kind = "profile"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header = read_profile_header(self.path)
        table = pd.read_csv(self.path, comment="#")
        if "max_kv" not in table.columns and {"kv_tokens", "num_reqs"} <= set(table.columns):
            # Older tables: as if every request read the same (exact for a grid).
            table["max_kv"] = np.ceil(table["kv_tokens"] / table["num_reqs"].clip(lower=1))
        missing = [c for c in (*FEATURES, "latency_s") if c not in table.columns]
        if missing:
            raise ValueError(f"{self.path}: profile table lacks columns {missing}")
        if "kind" in table.columns:
            table = table[table["kind"] == "step"]
        cols = [table[c].to_numpy(float) for c in FEATURES]
        smooth = profile_basis(*cols)
        size = decode_size(cols[0], cols[1])
        counts = np.bincount(size, minlength=DECODE_SIZES + 1)
        sizes = [k for k in range(1, DECODE_SIZES + 1) if counts[k] >= DECODE_SIZE_ROWS]
        terms = [*smooth, *((size == k).astype(float) for k in sizes)]
        x = np.column_stack([np.broadcast_to(b, len(table)) for b in terms])
        if len(table) < len(smooth):
            raise ValueError(f"{self.path}: {len(table)} step rows are too few to fit")
        y = table["latency_s"].to_numpy(float)
        # Relative error. A replay's steps are the mixes real workloads produce, so
        # together they weigh most; the grid's few points, together a quarter as
        # much, anchor the corners a replay does not reach (and extrapolation).
        w = 1 / y
        groups = table["grid"].to_numpy() if "grid" in table.columns else None
        if groups is not None:
            groups = np.where(np.isin(groups, REPLAY_GRIDS), "replay", groups)
            for g in np.unique(groups):
                share = GROUP_WEIGHTS.get(g, 1.0) / np.sqrt((groups == g).sum())
                w[groups == g] *= share
        self.coef = nnls(x * w[:, None], w * y)
        # The level: the replay's busy time. The fit's shape comes from relative
        # errors, whose least squares sit below the mean of noisy steps, and from
        # the grid's points, each batch repeated back to back, which ran 0.6-7.8% faster
        # against the model than the replay's steps in every pass measured on the
        # 2-core VM (experiments/results/fidelity_cpu1_level/README.md). Scaled so
        # that it predicts the replay's steps in total, the model's level is that
        # of a trace replayed on the engine, as the simulator uses it; ``level``
        # says by how much (1: a table without a replay).
        replay = groups == "replay" if groups is not None else np.zeros(len(y), dtype=bool)
        predicted = float((x[replay] @ self.coef).sum())  # 0 without a replay
        self.level = float(y[replay].sum()) / predicted if predicted > 0 else 1.0
        self.coef = self.coef * self.level
        self._coef = [float(c) for c in self.coef[: len(smooth)]]  # Python floats: fast
        # A decode-only batch's own term by its size (0: any other step).
        self._decode_extra = [0.0] * (DECODE_SIZES + 1)
        for k, c in zip(sizes, self.coef[len(smooth) :], strict=True):
            self._decode_extra[k] = float(c)
        pred = x @ self.coef
        self.fit_rel_error = float(np.median(np.abs(pred - y) / y))
        # The table's own digest: two profiles with the same header (a pass measured
        # again, a table edited) are told apart in every run directory.
        digest = hashlib.sha1(self.path.read_bytes()).hexdigest()[:10]
        self.source = (
            f"profile {self.path.name} ({self.header.get('device', '?')}, "
            f"{self.header.get('date', '?')}; sha1 {digest}"
            + (f"; level {self.level:.4f}, the replay's)" if replay.any() else ")")
        )

    def _smooth(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        total = 0.0
        basis = profile_basis(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        for c, b in zip(self._coef, basis, strict=True):
            total = total + c * b
        return total

    def predict(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> float:
        total = self._smooth(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        if num_tokens == num_reqs <= DECODE_SIZES:  # decode_size, for one step
            total = total + self._decode_extra[int(num_reqs)]
        return total

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        """:meth:`predict` where any feature may be an array: the same operations
        in the same order (exact agreement)."""
        if not isinstance(num_reqs, np.ndarray) and not isinstance(num_tokens, np.ndarray):
            return self.predict(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        total = self._smooth(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return total + np.asarray(self._decode_extra)[decode_size(num_reqs, num_tokens)]


def read_profile_header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a profile table."""
    header = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
    return header


def profile_path(profiles_dir: str | Path, hardware: str, model: str) -> Path:
    return Path(profiles_dir) / hardware / f"{model}.csv"


def make_latency_model(
    model: ModelSpec, hw: HardwareSpec, dtype: str, profiles_dir: str | Path | None
) -> LatencyModel:
    """The profile of (hardware, model) where one exists, else the roofline model."""
    if profiles_dir is not None:
        path = profile_path(profiles_dir, hw.name, model.name)
        if path.exists():
            return ProfileModel(path)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return RooflineModel(model, hw, dtype)


def step_column(steps, name: str) -> np.ndarray:
    """One column of a :class:`~testbed.metrics.steplog.StepLog` or of a
    ``steps.csv`` frame (the same columns), as floats."""
    values = steps.column(name) if hasattr(steps, "column") else steps[name]
    return np.asarray(values, dtype=np.float64)


def predict_logged_steps(model: LatencyModel, steps) -> np.ndarray:
    """The model's prediction of each logged step from its composition (``steps``:
    see :func:`step_column`)."""
    return model.predict_many(
        step_column(steps, "num_reqs"),
        step_column(steps, "num_prefill_tokens") + step_column(steps, "num_decode_tokens"),
        step_column(steps, "attn_pairs"),
        step_column(steps, "kv_tokens"),
        step_column(steps, "max_kv"),
    )


SPEED_WINDOW_S = 60.0  # run time over which :func:`speed_against` reports the speed's range
SPEED_WINDOW_STEPS = 20  # the fewest busy steps a window needs to be counted


def speed_by_window(start_s, latency_s, pred_s, width_s: float) -> pd.DataFrame:
    """A real run's speed window by window: for each ``width_s`` seconds of its
    clock from 0 (by when a step starts), the measured time of its steps over the
    model's prediction of them (``speed``) and how many steps there were
    (``steps``), indexed by the window's number; windows without a step are left
    out. The arrays: its busy steps' start times, latencies and predictions."""
    window = (np.asarray(start_s, dtype=np.float64) // width_s).astype(np.int64)
    groups = pd.DataFrame({"real": latency_s, "pred": pred_s}, copy=False).groupby(window)
    sums = groups.sum()
    return pd.DataFrame({"speed": sums["real"] / sums["pred"], "steps": groups.size()})


def speed_against(model: LatencyModel, steps, window_s: float = SPEED_WINDOW_S) -> dict[str, float]:
    """How fast a real run's machine ran against ``model`` (a profile of it): the
    run's busy time over the model's prediction of the same steps (``steps``: see
    :func:`step_column`). 1.2: its steps took 20% longer than the profile says (a
    machine slower now than when profiled, or a model that under-predicts these
    steps); 1.0: as profiled. ``_min`` and ``_max``: the lowest and highest of its
    :func:`speed_by_window` over windows of ``window_s`` holding at least
    :data:`SPEED_WINDOW_STEPS` busy steps (the whole run's where fewer than two
    windows do). Empty for a run without a busy step."""
    busy = step_column(steps, "num_reqs") > 0
    if not busy.any():
        return {}
    real = step_column(steps, "latency_s")[busy]
    pred = predict_logged_steps(model, steps)[busy]
    speed = float(real.sum() / pred.sum())
    windows = speed_by_window(step_column(steps, "start_s")[busy], real, pred, window_s)
    kept = windows.loc[windows["steps"] >= SPEED_WINDOW_STEPS, "speed"]
    low, high = (float(kept.min()), float(kept.max())) if len(kept) >= 2 else (speed, speed)
    return {"speed_vs_profile": speed, "speed_vs_profile_min": low, "speed_vs_profile_max": high}
