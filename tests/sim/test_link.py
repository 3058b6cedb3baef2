"""The KV link model: a transfer's time alone, and processor sharing."""

from __future__ import annotations

import math

import pytest

from testbed.sim.link import LINK_PRESETS, Link, LinkSpec


def run(spec: LinkSpec, transfers: list[tuple[float, str, float]]) -> dict[str, float]:
    """When each ``(start, name, bytes)`` transfer ends (data joins after the latency)."""
    link, ends = Link(spec), {}
    joins = sorted((t + spec.latency_s, name, b) for t, name, b in transfers)
    i = 0
    while i < len(joins) or link.remaining:
        t_join = joins[i][0] if i < len(joins) else math.inf
        t_done = link.next_finish()
        if t_join <= t_done:
            link.advance(t_join)
            link.add(joins[i][1], joins[i][2])
            i += 1
        else:
            link.advance(t_done)
            for name in link.pop_finished():
                ends[name] = t_done
    return ends


def test_a_transfer_alone_takes_latency_plus_bytes_over_bandwidth():
    spec = LinkSpec("l", latency_s=0.001, bandwidth_bytes_s=1e9)
    assert run(spec, [(2.0, "a", 5e8)]) == {"a": pytest.approx(2.501)}
    assert spec.alone_s(5e8) == pytest.approx(0.501)


def test_transfers_on_one_link_share_its_bandwidth():
    spec = LinkSpec("l", latency_s=0.0, bandwidth_bytes_s=100.0)
    # Together: each at half speed; the short one leaves at 2 x 100 / 100 = 2 s,
    # the long one has 300 - 100 left at full speed: 2 + 2 = 4 s.
    ends = run(spec, [(0.0, "short", 100), (0.0, "long", 300)])
    assert ends == {"short": pytest.approx(2.0), "long": pytest.approx(4.0)}
    # Staggered: b joins at 1 s when a has 100 of 200 left; both at 50/s until a
    # ends at 3 s (b has 200 left), then b alone: 5 s.
    ends = run(spec, [(0.0, "a", 200), (1.0, "b", 300)])
    assert ends == {"a": pytest.approx(3.0), "b": pytest.approx(5.0)}
    link = Link(spec)
    link.add("x", 100)
    link.advance(0.5)
    assert link.busy_s == 0.5


def test_presets_and_bad_specs():
    assert set(LINK_PRESETS) >= {"nvlink", "pcie", "infiniband", "cpu"}
    nv, pcie = LinkSpec.preset("nvlink"), LinkSpec.preset("pcie")
    assert nv.alone_s(1e9) < pcie.alone_s(1e9)
    with pytest.raises(ValueError, match="unknown link 'wifi'"):
        LinkSpec.preset("wifi")
    with pytest.raises(ValueError, match="bandwidth_bytes_s > 0"):
        LinkSpec("l", 0.0, 0.0)


def test_a_transfer_whose_rest_ends_within_an_ulp_of_now_is_through():
    """On a clock at 19.6 s a few hundredths of a byte at 450 GB/s take less than
    one ulp: the transfer is through now (else the clock could never pass it)."""
    link = Link(LinkSpec("l", 0.0, 450e9))
    link.now = 19.63308514108723
    link.add("a", 147456.0)
    link.remaining["a"] = 5e-4  # above 1e-9 of its size, below an ulp's worth
    assert link.next_finish() == link.now
    assert link.pop_finished() == ["a"] and not link.remaining
