"""How far the profiler has got and about how long its grid has left, for the
progress lines it prints (a default grid takes minutes on a small CPU machine)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from testbed.profiling.grid import Point


def point_work(point: Point, steps: int) -> int:
    """Tokens the engine computes for one grid point: its decoders' untimed
    prefills and its cached prefix, then ``steps`` steps of the point. The grid
    orders its decode points by batch size, so its largest come last and a grid's
    time is far from even over its points."""
    setup = point.decode_batch * point.context + point.prefix_tokens
    return setup + steps * (point.decode_batch * (1 + point.drafts) + point.prefill_tokens)


def seconds_left(
    done_work: Sequence[float], done_s: Sequence[float], todo_work: float, todo: int
) -> float | None:
    """Seconds the ``todo`` points still to measure (``todo_work`` tokens in all,
    :func:`point_work`) should take, at the pace of those measured so far (each
    one's work and seconds, fitted as seconds per token plus seconds per point,
    neither negative); None before three points with different work are measured
    (two fit any line)."""
    w, s = np.asarray(done_work, dtype=float), np.asarray(done_s, dtype=float)
    if not todo:
        return 0.0
    if len(w) < 3 or np.ptp(w) == 0:
        return None
    (per_token, per_point), *_ = np.linalg.lstsq(np.column_stack([w, np.ones_like(w)]), s)
    if per_point < 0:  # through the origin: seconds per token alone
        per_token, per_point = s.sum() / w.sum(), 0.0
    elif per_token < 0:  # the points' mean alone
        per_token, per_point = 0.0, s.mean()
    return per_token * todo_work + per_point * todo


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``1 h 2 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
