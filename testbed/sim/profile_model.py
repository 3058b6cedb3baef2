"""The latency model fitted to a measured profile table of the hardware and model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.profile_table import REPLAY_GRIDS, read_profile_header
from testbed.sim.fitting import DECODE_SIZE_ROWS, DECODE_SIZES, decode_size, nnls, profile_basis
from testbed.sim.latency import FEATURES

GROUP_WEIGHTS = {"replay": 4.0, "point": 1.0}  # profile rows: realistic steps vs grid


def spec_requests(table: pd.DataFrame) -> np.ndarray:
    """Requests verifying drafts in each row of a profile table: its grid's
    verification points' decoders (``drafts`` > 0), else none."""
    if "drafts" not in table.columns or "decode_batch" not in table.columns:
        return np.zeros(len(table))
    drafts = table["drafts"].fillna(0).to_numpy(float)
    return np.where(drafts > 0, table["decode_batch"].fillna(0).to_numpy(float), 0.0)


class ProfileModel:
    """Fitted to measured steps: a non-negative combination of :func:`profile_basis`.

    Non-negative coefficients keep predictions positive and monotone in every
    feature, and growing at most linearly outside the measured grid. The fit
    minimises relative error, so short steps count as much as long ones.

    Where the table has verification points (decoders each verifying drafts),
    the fit also has a term per request verifying drafts: such a request is a
    multi-token query that the step features count as prefill-like tokens, but
    that some attention paths run per sequence (the torch reference's loop: about
    0.4 ms per request for stories260K on one core, at any context; the CPU path's
    C++ kernel about 0.01 ms). :meth:`verification_s` gives it.
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
        verifying = spec_requests(table)
        if verifying.any():
            terms.append(verifying)
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
        # the grid's points, each batch repeated back to back, which run faster
        # against the model than a replay's steps (docs/fidelity.md). Scaled so
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
        for k, c in zip(sizes, self.coef[len(smooth) : len(smooth) + len(sizes)], strict=True):
            self._decode_extra[k] = float(c)
        # Per request verifying drafts (0: a table without verification points).
        self._per_spec_request = float(self.coef[-1]) if verifying.any() else 0.0
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

    def verification_s(self, num_spec_reqs):
        """What ``num_spec_reqs`` requests verifying drafts add to a step's
        :meth:`predict` (a number or an array)."""
        return self._per_spec_request * num_spec_reqs

    def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
        """:meth:`predict` where any feature may be an array: the same operations
        in the same order (exact agreement)."""
        if not isinstance(num_reqs, np.ndarray) and not isinstance(num_tokens, np.ndarray):
            return self.predict(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        total = self._smooth(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)
        return total + np.asarray(self._decode_extra)[decode_size(num_reqs, num_tokens)]
