"""The run's summary on the console: its headline metrics, why requests were
rejected, and what to make of them where the engine was overloaded. (How far a
real run's machine ran from its profile is a row here; what that means for a
comparison with a simulation, the sweep summary says.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def number(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``; "-" where it is absent (null or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


def cluster_label(m: Mapping[str, Any]) -> str:
    """The cluster's shape for the header ("" for one engine)."""
    if m.get("disaggregated"):
        return (
            f"disaggregated {m['num_prefill']} prefill + {m['num_decode']} decode "
            f"(router {m['router']}, pairing {m['pairing']}, decider {m['decider']})"
        )
    replicas = m.get("num_replicas", 1)
    return f"{replicas} replicas, router {m['router']}" if replicas > 1 else ""


def latency_rows(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Throughput and latencies; one line in words where nothing finished."""
    if not m["num_finished"]:
        ran = m.get("duration_s")
        during = f" in the {ran:.3g} s it ran" if ran else ""
        return [("throughput, latencies", f"none: no request finished{during}")]
    return [
        (
            "throughput (req/s, out tok/s)",
            f"{number(m['throughput_req_s'], '.3f')}, "
            f"{number(m['throughput_output_tok_s'], '.1f')}",
        ),
        ("TTFT mean / p99 (s)", f"{m['ttft_s_mean']:.4f} / {m['ttft_s_p99']:.4f}"),
        ("TPOT mean / p99 (s)", f"{number(m['tpot_s_mean'], '.4f')} / "
         f"{number(m['tpot_s_p99'], '.4f')}"),
        ("E2E mean / p99 (s)", f"{m['e2e_s_mean']:.3f} / {m['e2e_s_p99']:.3f}"),
    ]  # fmt: skip


def print_summary(m: Mapping[str, Any]) -> None:
    rows = [
        ("requests (finished / rejected)", f"{m['num_finished']} / {m['num_rejected']}"),
        *latency_rows(m),
        (
            "preemptions, prefix hit rate",
            f"{m['num_preemptions']}, {m['prefix_cache_hit_rate']:.3f}",
        ),
        (
            "KV usage mean / max",
            f"{number(m['kv_usage_mean'], '.3f')} / {number(m['kv_usage_max'], '.3f')}",
        ),
        ("latency model", str(m.get("latency_model"))),
        ("wall time (s)", f"{m['wall_s']:.2f}"),
    ]
    # The simulated machine, where it is not the profiled one.
    slower = [f"x {m['latency_scale']:.4g}"] if m.get("latency_scale", 1.0) != 1.0 else []
    slower += [m["speed_trace"]] if m.get("speed_trace") else []
    if slower:
        rows.insert(-1, ("step latencies", ", ".join(slower)))
    speed = m.get("speed_vs_profile")
    if speed is not None:
        low, high = m["speed_vs_profile_min"], m["speed_vs_profile_max"]
        spread = f" ({low:.3f}-{high:.3f} minute by minute)" if high > low else ""
        rows.insert(-1, ("speed vs profile", f"{speed:.3f}x its step time{spread}"))
    if m.get("spec_num_drafts") is not None:
        per_pos = ", ".join(f"{r:.2f}" for r in m["spec_acceptance_rate_per_pos"])
        rows.insert(
            -2,
            (
                "speculation: accepted, length",
                f"{m['spec_acceptance_rate']:.3f} of {m['spec_num_draft_tokens']} draft tokens, "
                f"{m['spec_mean_acceptance_length']:.2f} tokens per verification "
                f"(by position: {per_pos or '-'})",
            ),
        )
    if m.get("spec_acceptance_model"):  # a simulation's: a measured table or a given rate
        rows.insert(-2, ("speculation: acceptance model", m["spec_acceptance_model"]))
    if m.get("top_reject_reasons"):
        rows.insert(1, ("rejected because", m["top_reject_reasons"]))
    head = f"{m['mode']} | {m['policy']} | {m['trace']} | {m['model']} on {m['hardware']}"
    if cluster := cluster_label(m):
        head += f" | {cluster}"
    if m.get("partial"):
        head += f" | PARTIAL ({m.get('stop_reason')})"
    width = max(len(k) for k, _ in rows)
    print(head)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if m.get("overloaded"):
        print(
            f"  OVERLOADED: from the first quarter's arrivals to the last, "
            f"{m['finished_per_arrival']:.0%} as many requests finished as arrived "
            f"({m['waiting_at_last_arrival']} still waiting at the last arrival; offered "
            f"{m['offered_req_s']:.3g} req/s, served {m['throughput_req_s']:.3g}): latencies "
            "measure the backlog. Lower the load (load=0.7: 70% of this engine's capacity; "
            "or trace.rate) or add replicas."
        )
