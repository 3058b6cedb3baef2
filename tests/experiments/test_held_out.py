"""experiments/held_out.py: the latency model on grid points its fit did not see."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments.held_out import held_out, summary

HEADER = "# device: test-device\n# date: 2026-12-02\n"


def table(with_prefix: bool = True) -> pd.DataFrame:
    """Grid points costed by a known linear law of the step features."""
    pts = [(b, c, 0, 0) for b in (1, 2, 4, 8, 16) for c in (64, 512, 2000)]
    pts += [(0, 0, n, 0) for n in (16, 64, 256, 512, 1024, 2000)]
    pts += [(4, 256, n, 0) for n in (64, 256)]
    if with_prefix:
        pts += [(0, 0, n, c) for c in (256, 1024) for n in (64, 256)]
    rows = []
    for b, c, n, pre in pts:
        reqs, tokens = b + (n > 0), b + n
        pairs = b * (c + 1) + n * (pre + (n + 1) / 2)
        kv = b * (c + 1) + (pre + n if n else 0)
        max_kv = max(c + 1 if b else 0, pre + n)
        lat = 2e-3 + 3e-4 * reqs + 1e-4 * tokens + 2e-8 * pairs + 1e-7 * kv
        rows.append(
            dict(kind="step", grid="point", decode_batch=b, context=c, prefill_tokens=n,
                 prefix_tokens=pre, num_reqs=reqs, num_tokens=tokens, attn_pairs=pairs,
                 kv_tokens=kv, max_kv=max_kv, latency_s=lat)
        )  # fmt: skip
    return pd.DataFrame(rows)


def write(path, t: pd.DataFrame):
    path.write_text(HEADER)
    t.to_csv(path, mode="a", index=False)
    return path


def test_held_out_predicts_the_left_out_points_with_both_fits(tmp_path):
    path = write(tmp_path / "p.csv", table())
    out, models = held_out(path, "cached_prefix")
    assert set(models) == {"whole", "held_out"}
    assert len(out) == 4 and (out["prefix_tokens"] > 0).all()
    assert np.allclose(out["measured_s"], table().query("prefix_tokens > 0")["latency_s"])
    # A law the model can express: the whole fit is near exact on the points it saw.
    assert (out["whole_err"].abs() < 0.02).all(), out
    # Without them, the fit still predicts them finitely, from their features alone.
    assert (out["held_out_s"] > 0).all() and np.isfinite(out["held_out_s"]).all()
    s = summary(out)
    assert s["whole_max_abs_err"] == pytest.approx(out["whole_err"].abs().max())
    mixed, _ = held_out(path, "mixed")
    assert list(mixed["decode_batch"]) == [4, 4]


def test_held_out_says_when_a_profile_lacks_the_group(tmp_path):
    path = write(tmp_path / "old.csv", table(with_prefix=False))
    with pytest.raises(ValueError, match=r"old\.csv: no grid point of group 'cached_prefix'"):
        held_out(path, "cached_prefix")
