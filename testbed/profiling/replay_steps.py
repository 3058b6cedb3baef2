"""The profiler's replay: every step of a short synthetic trace replayed on the
engine, the batch mixes a real workload produces, which a grid alone does not
cover."""

from __future__ import annotations

from testbed.engine.replay import replay
from testbed.profiling.measure import feature_columns
from testbed.profiling.probes import idle_probe_rows
from testbed.sim.latency import step_features
from testbed.workload import to_requests
from traces.synthetic import synthetic_trace

# The profiler replay's prompt and output lengths.
REPLAY_LENGTHS = dict(
    prompt={"dist": "lognormal", "mean": 768, "cv": 0.8, "min": 16, "max": 1800},
    output={"dist": "lognormal", "mean": 192, "cv": 1.0, "min": 1, "max": 240},
)


def replay_kv_blocks(num_requests: int, block_size: int) -> int:
    """KV blocks that hold every request of the profiler's replay at once."""
    longest = REPLAY_LENGTHS["prompt"]["max"] + REPLAY_LENGTHS["output"]["max"]
    return num_requests * -(-longest // block_size) + 16


# The sparse replay's arrival rate (req/s): a request of the replay's lengths takes
# about 2.5 s alone on the 2-core CPU VM, so most run alone or in pairs.
SPARSE_RATE = 0.25


def measure_replay(
    engine,
    num_requests: int,
    vocab: int,
    idle_probe=None,
    rows: list[dict] | None = None,
    seed: int = 1234,
    rate: float = 2.5,
    name: str = "calibration",
    grid: str = "replay",
) -> list[dict]:
    """Every step of a short replay of the embedded synthetic trace (another seed
    than the default runs use): the batch mixes a real workload produces, which a
    grid alone does not cover. One row per step; with an ``idle_probe``, also
    one ``kind=idle_probe`` row per sample taken in the replay's idle gaps.
    Appended to ``rows`` where given, so that an interrupted or failed replay
    (re-raised here) leaves the steps it measured there.

    At the default ``rate`` the engine's batch fills, and only the last request
    decodes alone, at whatever context it has reached; the profiler also replays
    a few requests at :data:`SPARSE_RATE` (``name`` keeps their ids apart; their
    rows' ``grid`` is ``replay_sparse``, which the latency model fits as replay
    steps), whose one- and two-request decodes span every context, as a lightly
    loaded service (Azure conv at 70% of this engine's capacity) runs them."""

    # Longer prompts than the default trace, so that contexts reach the model's
    # length; a different seed and shape from any workload it is evaluated on.
    trace = synthetic_trace(num_requests=num_requests, rate=rate, seed=seed, **REPLAY_LENGTHS)
    requests = to_requests(trace, with_tokens=True, vocab_size=vocab, seed=seed)
    for r in requests:
        r.request_id = f"{name}-{r.request_id}"
    rows = [] if rows is None else rows

    def record(res) -> None:
        so = res.scheduler_output
        if not so.requests:
            return
        rows.append(
            dict(
                kind="step",
                grid=grid,
                decode_batch=so.num_decode_tokens,
                context=0,
                prefill_tokens=so.num_prefill_tokens,
                **feature_columns(step_features(so)),
                latency_s=res.latency_s,
                repeats=1,
            )
        )

    result = replay(engine, requests, on_step=record, idle_probe=idle_probe)
    rows += idle_probe_rows((s for _, s in result.extra.get("idle_probe", [])), "replay_gaps")
    if result.error is not None:  # replay keeps what it measured and returns
        raise result.error
    if result.partial:
        raise KeyboardInterrupt(f"profiler replay: {result.stop_reason}")
    return rows
