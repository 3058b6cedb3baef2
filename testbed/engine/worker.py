"""One engine instance in its own process: the child side of a multi-process
real run (:mod:`testbed.engine.cluster`).

The parent sends requests (whole :class:`~testbed.core.Request` objects, pickled)
and a stop over a queue; the worker steps its engine whenever it has work, on a
wall clock that counts from the parent's origin (``time.perf_counter`` is
system-wide), and sends back, over its own pipe (a worker killed mid-message
spoils only its own), each step's row of the step log, each request when it
ends, and at exit its counters. A Ctrl-C that reaches the worker too (one process group)
ends it quietly: the parent decides what the run writes.
"""

from __future__ import annotations

import queue
import traceback

from testbed.core import WallClock
from testbed.engine.args import EngineArgs

IDLE_POLL_S = 0.02  # how long an idle worker waits for a message at a time


def step_row(res) -> tuple:
    """A step's :meth:`~testbed.metrics.StepLog.add` arguments after the replica."""
    return (
        res.start_s, res.latency_s, res.num_reqs, res.num_prefill_tokens,
        res.num_decode_tokens, res.kv_usage, res.num_waiting, res.num_running,
        res.num_preempted, res.kv_tokens, res.attn_pairs, res.max_kv, res.num_spec_reqs,
        res.num_draft_tokens, res.num_accepted_tokens,
    )  # fmt: skip


def worker_main(index: int, args: EngineArgs, inbox, outbox, model=None) -> None:
    """Build the engine (``model``: the resolved (config, folder, name), else
    ``args.model``), say ``ready``, wait for ``("start", origin)``, then serve
    ``("add", [requests])`` until ``("stop",)``."""
    try:
        from testbed.engine.factory import build_engine

        engine, executor, _ = build_engine(args, model=model)
        outbox.send(("ready", index))
        msg = inbox.get()
        if msg[0] != "start":
            return
        engine.clock = WallClock(origin=msg[1])
        sched = engine.scheduler
        while True:
            idle = not engine.has_unfinished_requests()
            try:
                msg = inbox.get(timeout=IDLE_POLL_S) if idle else inbox.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "stop":
                    break
                for req in msg[1]:
                    if not engine.add_request(req):
                        outbox.send(("done", index, req))
                continue
            if idle:
                continue
            res = engine.step()
            outbox.send(("step", index, step_row(res)))
            for req in res.finished:
                outbox.send(("done", index, req))
        outbox.send(
            (
                "exit",
                index,
                dict(
                    tokens_computed=executor.num_computed_tokens,
                    prefix_hits=sched.kv.stats.hits,
                    prefix_queries=sched.kv.stats.queries,
                    num_kv_blocks=sched.kv.num_blocks,
                ),
            )
        )
    except KeyboardInterrupt:
        return
    except Exception:  # the parent reports it, by the worker's name
        outbox.send(("error", index, traceback.format_exc()))
