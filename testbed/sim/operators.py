"""Measured per-operator times of one decoder layer on one GPU, and a curve fitted to them.

The tables are Vidur's published CUDA timings (``testbed/sim/data/README.md``), made
compact by ``scripts/compact_vidur_profiles.py``: per model shape and tensor-parallel
degree, each operator's median time at a thinned grid of token counts. A shape and
degree that a table measured read that table; any other (a new model, the LM head,
MoE experts) reads a GEMM curve and elementwise rates fitted to every table of the
GPU, whose parameters the same script stored beside the tables.

The fitted GEMM time of an ``(m x k) @ (k x n)`` product on one GPU: memory-bound or
compute-bound, whichever is slower, each with its own fixed cost (the memory-bound
GEMV-like kernels of a few tokens start sooner than tiled ones)::

    t = max(t0_mem + bytes / B, t0_compute + 2 m k n / F(m))
    F(m) = F_max * m / (m + m_half),  bytes = dtype_bytes * (m k + k n + m n)

and of an elementwise op over ``e = tokens x width`` elements, a fixed cost ``t0`` where
small and bandwidth-bound where large, joined by a q-norm (q fitted: 1 would add them,
infinity take the larger)::

    t = (t0**q + (e / rate)**q) ** (1 / q)

(one fit per kind: norm, act, add, rope, emb, and norm/act/add pooled).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"

# One decoder layer's operators, in the order they run; the embedding is separate.
OPS = ("qkv", "o", "mlp_up", "mlp_down", "input_norm", "post_norm", "rope", "act", "add")
LINEAR_OPS = ("qkv", "o", "mlp_up", "mlp_down")
# Our name -> Vidur's column (time_stats.<name>.median).
VIDUR_OPS = {
    "qkv": "attn_pre_proj",
    "o": "attn_post_proj",
    "mlp_up": "mlp_up_proj",
    "mlp_down": "mlp_down_proj",
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "rope": "attn_rope",
    "act": "mlp_act",
    "add": "add",
    "emb": "emb",
}
# The elementwise fit each non-GEMM op reads.
ELEMENTWISE_KIND = {
    "input_norm": "norm",
    "post_norm": "norm",
    "rope": "rope",
    "act": "act",
    "add": "add",
    "emb": "emb",
}
POOLED = "pooled"  # the elementwise fit over norm, act and add rows together


@dataclass(frozen=True)
class LayerShape:
    """The shape of one decoder layer (what the operator times depend on)."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LayerShape.{name} must be a positive integer, got {value!r}")

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads on one rank: split over ``tp``, replicated where fewer than ``tp``."""
        if self.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_heads={self.num_heads}")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_kv_heads={self.num_kv_heads}")
        return max(self.num_kv_heads // tp, 1)

    def gemm_dims(self, tp: int) -> dict[str, tuple[float, float]]:
        """(k, n) of each linear op on one of ``tp`` ranks; m is the number of tokens."""
        heads = self.num_heads // tp
        qkv = (heads + 2 * self.kv_heads_per_rank(tp)) * self.head_dim
        up = (2 if self.gated else 1) * self.intermediate / tp
        return {
            "qkv": (self.hidden, qkv),
            "o": (heads * self.head_dim, self.hidden),
            "mlp_up": (self.hidden, up),
            "mlp_down": (self.intermediate / tp, self.hidden),
        }

    def elementwise_widths(self, tp: int) -> dict[str, float]:
        """Elements per token of each non-GEMM op on one rank (rope: q and k heads;
        act: its output; norms, add and the embedding: the full hidden state)."""
        heads = self.num_heads // tp + self.kv_heads_per_rank(tp)
        return {
            "input_norm": self.hidden,
            "post_norm": self.hidden,
            "rope": heads * self.head_dim,
            "act": self.intermediate / tp,
            "add": self.hidden,
            "emb": self.hidden,
        }


@dataclass(frozen=True)
class GemmFit:
    """The fitted GEMM curve's parameters (see the module docstring)."""

    t0_mem_s: float
    t0_compute_s: float
    flops_max: float
    m_half: float
    bytes_per_s: float

    def seconds(self, m: float, k: float, n: float, dtype_bytes: float = 2) -> float:
        compute = 2.0 * m * k * n * (m + self.m_half) / (self.flops_max * m)
        memory = dtype_bytes * (m * k + k * n + m * n) / self.bytes_per_s
        return max(self.t0_mem_s + memory, self.t0_compute_s + compute)

    def describe(self) -> str:
        return (
            f"GEMM max(t0m + bytes/B, t0c + 2mkn/(F*m/(m+m_half))), "
            f"t0m={self.t0_mem_s * 1e6:.1f} us, t0c={self.t0_compute_s * 1e6:.1f} us, "
            f"F={self.flops_max / 1e12:.0f} TFLOP/s, m_half={self.m_half:.0f}, "
            f"B={self.bytes_per_s / 1e12:.2f} TB/s"
        )


@dataclass(frozen=True)
class ElementwiseFit:
    """An elementwise op's fitted time (see the module docstring)."""

    t0_s: float
    elements_per_s: float
    q: float

    def seconds(self, elements: float) -> float:
        q = self.q
        return (self.t0_s**q + (elements / self.elements_per_s) ** q) ** (1.0 / q)


@dataclass(frozen=True)
class Fit:
    """The fitted curves of one GPU (from all its tables, or all but one model's)."""

    gemm: GemmFit
    elementwise: dict[str, ElementwiseFit]

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str) -> Fit:
        try:
            gemm = GemmFit(**obj["gemm"])
            elementwise = {k: ElementwiseFit(**v) for k, v in obj["elementwise"].items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: bad fit parameters ({e})") from e
        missing = {*ELEMENTWISE_KIND.values(), POOLED} - set(elementwise)
        if missing:
            raise ValueError(f"{where}: elementwise fits missing: {sorted(missing)}")
        return cls(gemm, elementwise)

    def to_json(self) -> dict[str, Any]:
        return {
            "gemm": vars(self.gemm),
            "elementwise": {k: vars(v) for k, v in self.elementwise.items()},
        }


class Knots:
    """One op's times at a thinned token grid: linear between knots, and beyond the last
    knot linear with the ``tail`` slope (fitted over the upper half of the measured range,
    so that two close knots at the end do not set it)."""

    __slots__ = ("_ms", "_slope", "_tokens")

    def __init__(self, tokens: list[float], ms: list[float], tail_ms_per_token: float) -> None:
        self._tokens, self._ms, self._slope = list(tokens), list(ms), tail_ms_per_token

    def seconds(self, num_tokens: float) -> float:
        xs, ys = self._tokens, self._ms
        if num_tokens >= xs[-1]:
            return (ys[-1] + (num_tokens - xs[-1]) * self._slope) * 1e-3
        if num_tokens <= xs[0]:
            return ys[0] * 1e-3
        i = bisect.bisect_right(xs, num_tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return (y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)) * 1e-3


@dataclass(frozen=True)
class Table:
    """One model's measured operators at each tensor-parallel degree it was measured."""

    model: str
    shape: LayerShape
    num_tokens: tuple[int, int]  # the measured range
    ops: dict[int, dict[str, Knots]]  # tp -> op (OPS that it measured, and "emb") -> knots

    def matches(self, shape: LayerShape) -> bool:
        # the whole layer shape, head_dim and gating included; not the vocabulary: the
        # LM head is not in the tables (so Llama-3-70B reads Llama-2-70B's table)
        return self.shape == shape


class LayerOps:
    """One layer's operator times on one rank at a given shape and TP degree.

    ``seconds(num_tokens)`` is memoized by token count: a simulator calls it once a step."""

    def __init__(
        self,
        source: str,
        measured: bool,
        ops: dict[str, Callable[[float], float]],
        emb: Callable[[float], float],
    ) -> None:
        self.source, self.measured = source, measured
        self._ops, self._emb = ops, emb
        self._cache: dict[int, dict[str, float]] = {}

    def seconds(self, num_tokens: int) -> dict[str, float]:
        """Seconds of each op in ``OPS`` for one layer on one TP rank over ``num_tokens``
        tokens. Token counts beyond the measured grid are extrapolated linearly (the
        table's tail slope, or the fitted curve); an op the table's model lacks (phi-2
        has no post-attention norm) costs 0."""
        got = self._cache.get(num_tokens)
        if got is None:
            if num_tokens < 1:
                raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
            got = {op: (f(num_tokens) if (f := self._ops.get(op)) else 0.0) for op in OPS}
            self._cache[num_tokens] = got
        return dict(got)

    def emb_s(self, num_tokens: int) -> float:
        """Seconds of the embedding lookup over ``num_tokens`` tokens on one rank."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        return self._emb(num_tokens)


def gpus(data_dir: Path | None = None) -> list[str]:
    """The GPUs with operator tables in ``data_dir`` (default: the bundled data)."""
    folder = Path(data_dir) if data_dir is not None else DATA_DIR
    return sorted(p.stem.removeprefix("operators_") for p in folder.glob("operators_*.json"))


class OperatorTimes:
    """One GPU's per-layer operator times: the measured table where one matches the shape
    and TP degree, else the fitted curve."""

    def __init__(self, gpu: str, tables: list[Table], fit: Fit, origin: str) -> None:
        self.gpu, self.tables, self.fit, self._origin = gpu, tables, fit, origin
        self._layers: dict[tuple[LayerShape, int, bool], LayerOps] = {}

    @classmethod
    def load(
        cls, gpu: str, data_dir: Path | None = None, exclude: str | None = None
    ) -> OperatorTimes:
        """Read ``operators_<gpu>.json``. ``exclude`` (a model, as ``org/name`` or
        ``name``) leaves that model's table out and uses the curve fitted without it:
        the leave-one-out check."""
        folder = Path(data_dir) if data_dir is not None else DATA_DIR
        path = folder / f"operators_{gpu.lower()}.json"
        if not path.is_file():
            raise ValueError(
                f"no operator times for GPU {gpu!r} in {folder}; known: {gpus(folder)}"
            )
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
        tables = [_table(t, f"{path}: tables[{i}]") for i, t in enumerate(obj.get("tables", []))]
        fit_obj = obj.get("fit")
        if exclude is not None:
            names = {t.model: t.model for t in tables} | {
                t.model.split("/")[-1]: t.model for t in tables
            }
            if exclude not in names:
                raise ValueError(f"{path}: no table for model {exclude!r}; known: {sorted(names)}")
            model = names[exclude]
            tables = [t for t in tables if t.model != model]
            fit_obj = obj.get("fit_without", {}).get(model)
            if fit_obj is None:
                raise ValueError(f"{path}: fit_without has no entry for {model!r}")
        if fit_obj is None:
            raise ValueError(f"{path}: missing field 'fit'")
        fit = Fit.from_json(fit_obj, f"{path}: fit")
        src = obj.get("source", {})
        origin = f"vidur {gpu.lower()} {src.get('commit', '?')}"
        return cls(gpu.lower(), tables, fit, origin)

    def table_for(self, shape: LayerShape, tp: int) -> Table | None:
        """The table that measured this shape at this TP degree (the widest token range
        where two did), else None."""
        found = [t for t in self.tables if t.matches(shape) and tp in t.ops]
        found.sort(key=lambda t: (-t.num_tokens[1], t.model))
        return found[0] if found else None

    def layer(self, shape: LayerShape, tp: int, fitted: bool = False) -> LayerOps:
        """One layer's operators on one of ``tp`` ranks (``fitted``: the fitted curve even
        where a table matches, for checking the curve)."""
        key = (shape, tp, fitted)
        if key not in self._layers:
            self._layers[key] = self._build(shape, tp, fitted)
        return self._layers[key]

    def _build(self, shape: LayerShape, tp: int, fitted: bool) -> LayerOps:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        table = None if fitted else self.table_for(shape, tp)
        if table is not None:
            knots = table.ops[tp]
            ops = {op: knots[op].seconds for op in OPS if op in knots}
            return LayerOps(
                f"measured: {table.model} ({self._origin}, tp={tp})",
                True,
                ops,
                knots["emb"].seconds,
            )
        dims, widths, fit = shape.gemm_dims(tp), shape.elementwise_widths(tp), self.fit
        ops: dict[str, Callable[[float], float]] = {}
        for op, (k, n) in dims.items():
            ops[op] = lambda m, k=k, n=n: fit.gemm.seconds(m, k, n)
        for op, width in widths.items():
            curve = fit.elementwise[ELEMENTWISE_KIND[op]]
            ops[op] = lambda t, c=curve, w=width: c.seconds(t * w)
        emb = ops.pop("emb")
        return LayerOps(f"fitted: {fit.gemm.describe()} ({self._origin}, tp={tp})", False, ops, emb)

    def gemm_s(self, m: int, k: int, n: int, dtype_bytes: int = 2) -> float:
        """Seconds of one ``(m x k) @ (k x n)`` GEMM on one GPU, from the fitted curve
        (``dtype_bytes`` scales the memory term only: the compute rate is the fp16 one
        measured)."""
        if min(m, k, n) <= 0:
            raise ValueError(f"GEMM dimensions must be positive, got m={m} k={k} n={n}")
        return self.fit.gemm.seconds(m, k, n, dtype_bytes)

    def elementwise_s(self, num_tokens: int, width: int, kind: str | None = None) -> float:
        """Seconds of a norm/activation/add over ``num_tokens x width`` elements, fitted
        (``kind``: "norm", "act", "add", "rope" or "emb" for that op's own fit; default
        norm, act and add pooled)."""
        fits = self.fit.elementwise
        key = POOLED if kind is None else kind
        if key not in fits:
            raise ValueError(f"unknown elementwise kind {kind!r}; known: {sorted(fits)}")
        if num_tokens < 0 or width < 0:
            raise ValueError(f"num_tokens and width must be >= 0, got {num_tokens}, {width}")
        return fits[key].seconds(num_tokens * width)


def _table(obj: dict[str, Any], where: str) -> Table:
    """A table from its JSON form, checked field by field."""
    try:
        shape = LayerShape(**obj["shape"])
        model = str(obj["model"])
        lo, hi = obj["num_tokens"]
        ops: dict[int, dict[str, Knots]] = {}
        for tp, per_op in obj["tp"].items():
            ops[int(tp)] = {}
            for op, k in per_op.items():
                if op not in VIDUR_OPS:
                    raise ValueError(f"tp {tp}: unknown op {op!r}")
                tokens, ms = k["tokens"], k["ms"]
                if len(tokens) < 2 or len(tokens) != len(ms) or sorted(tokens) != tokens:
                    raise ValueError(f"tp {tp} op {op}: tokens/ms not two matching sorted lists")
                ops[int(tp)][op] = Knots(tokens, ms, float(k["tail"]))
            if "emb" not in ops[int(tp)]:
                raise ValueError(f"tp {tp}: missing op 'emb'")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
    return Table(model, shape, (int(lo), int(hi)), ops)
