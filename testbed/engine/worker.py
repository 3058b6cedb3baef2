"""One engine instance in its own process: the child side of a multi-process
real run (:mod:`testbed.engine.cluster`).

The parent sends requests (whole :class:`~testbed.core.Request` objects, pickled)
and a stop over a queue; the worker steps its engine whenever it has work, on a
wall clock that counts from the parent's origin (``time.perf_counter`` is
system-wide), and sends back, over its own pipe (a worker killed mid-message
spoils only its own), each step's row of the step log with its KV usage and
prefix-cache changes (what the parent's routers read), each request when it
ends, and at exit its counters.

In a disaggregated cluster the workers also form a ``torch.distributed`` group
(gloo on CPU, NCCL on GPUs) that moves KV: a decode worker whose connector asks
for a request's prompt KV posts a receive from the prefill worker holding it and
asks it, through the parent, to send (``pull`` / ``send``); the prefill worker
gathers the blocks and sends them; as each side's transfer completes its
scheduler hears of it (``update_connector_output``). A load that fails (the
prefill worker died or cannot send, or the receive timed out) is recomputed on
the decode worker, and the prefill worker is told to free the blocks it kept
(``kv_failed`` / ``release``, through the parent). A Ctrl-C that reaches the
worker too (one process group) ends it quietly: the parent decides what the run
writes.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from testbed.core import WallClock
from testbed.core.kv_connector import LEG_SUFFIX, KVLoad
from testbed.core.kv_faults import KVFaults
from testbed.engine.args import EngineArgs
from testbed.metrics.steplog import step_row

IDLE_POLL_S = 0.02  # how long an idle worker waits for a message at a time
XFER_POLL_S = 0.0005  # ... while a KV transfer is under way
TAG_STRIDE = 1 << 20  # transfer tags: the receiving worker's index * this + a count
STOP_DRAIN_S = 2.0  # at the stop, how long sends under way may take to end


class Pending:
    """A point-to-point send or receive under way: gloo completes one only in its
    ``wait``, so a thread waits and the worker's loop polls it. (Never with gloo's
    own timeout: one that expires closes the pair to that peer for good.)"""

    def __init__(self, work) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

        def wait() -> None:
            try:
                work.wait()
            except BaseException as e:  # the peer died, or the group broke: polled
                self.error = e
            self._done.set()

        threading.Thread(target=wait, daemon=True).start()

    @property
    def finished(self) -> bool:
        """Ended, completed or failed (:attr:`error`)."""
        return self._done.is_set()


@dataclass
class Receive:
    """A load under way: its receive, the buffer it fills, blocks, when it began."""

    work: Pending
    load: KVLoad
    buffer: Any
    num_blocks: int
    start: float


class KVTransport:
    """The data side of the worker's KV connector: point-to-point sends and
    receives of gathered blocks, polled from the worker's loop.

    A load fails (the scheduler recomputes the prompt, the parent tells the prefill
    worker to free its blocks) when its receive errors (the peer died), when the
    prefill worker cannot send (``fail_load``), when the parent reports the prefill
    worker dead (``peer_dead``), or when it has not completed within ``timeout_s``.
    ``faults`` are injected on the sending side (:mod:`testbed.core.kv_faults`)."""

    def __init__(
        self, index: int, engine, executor, outbox, faults: KVFaults, timeout_s: float
    ) -> None:
        import torch.distributed as dist

        self.dist, self.index = dist, index
        self.engine, self.executor, self.outbox = engine, executor, outbox
        self.faults, self.timeout_s = faults, timeout_s
        self.recvs: dict[int, Receive] = {}  # by tag
        self.sends: dict[str, tuple[Pending, Any]] = {}  # by leg id: (work, buffer)
        self.abandoned: list[Receive] = []  # given up on: buffers kept while gloo holds them
        self._count = 0

    @property
    def busy(self) -> bool:
        return bool(self.recvs or self.sends)

    def start_loads(self, meta) -> None:
        """Post a receive for each load the connector asked for; ask for the send."""
        import torch

        bs = self.engine.scheduler.kv.block_size
        for load in meta.loads:
            n = -(-load.num_tokens // bs)
            buf = torch.empty(self.executor.kv_shape(n), dtype=self.executor.kv_caches[0][0].dtype)
            self._count += 1
            tag = self.index * TAG_STRIDE + self._count % TAG_STRIDE
            start = self.engine.clock()
            try:
                work = Pending(self.dist.irecv(buf, src=load.remote_instance, tag=tag))
            except RuntimeError:  # the pair to that worker is closed: it died
                self._failed(load, start)
                continue
            self.recvs[tag] = Receive(work, load, buf, n, start)
            self.outbox.send(
                ("pull", self.index, load.remote_instance, load.remote_request_id, tag, n)
            )

    def send(self, leg_id: str, dst: int, tag: int, n: int) -> None:
        """Send the first ``n`` blocks of a finished leg's KV to ``dst`` (or say it
        cannot: ``nosend``)."""
        sched = self.engine.scheduler
        fault = self.faults.strikes(leg_id.removesuffix(LEG_SUFFIX))
        if fault == "hang":  # never sent: the receiver's timeout ends it
            return
        if fault == "fail" or leg_id not in sched.sending:
            self.release(leg_id)
            self.outbox.send(("nosend", self.index, dst, tag))
            return
        buf = self.executor.gather_kv(sched.kv.get_block_ids(leg_id)[:n]).contiguous()
        try:
            work = Pending(self.dist.isend(buf, dst=dst, tag=tag))
        except RuntimeError:  # the receiver died: nothing to send to
            self.release(leg_id)
            return
        self.sends[leg_id] = (work, buf)

    def release(self, leg_id: str) -> None:
        """Free a finished leg's blocks (its KV is not wanted, or cannot be sent),
        unless a send of them is under way (it frees them as it ends)."""
        sched = self.engine.scheduler
        if leg_id not in self.sends and leg_id in sched.sending:
            sched.update_connector_output({leg_id}, (), self.engine.clock())

    def fail(self, tag: int) -> None:
        """Give up on the load received under ``tag``."""
        rec = self.recvs.pop(tag, None)
        if rec is None:
            return
        if not rec.work.finished:
            self.abandoned.append(rec)
        self._failed(rec.load, rec.start)

    def peer_dead(self, src: int) -> None:
        """Worker ``src`` died: every load from it fails."""
        for tag in [t for t, rec in self.recvs.items() if rec.load.remote_instance == src]:
            self.fail(tag)

    def _failed(self, load: KVLoad, start: float) -> None:
        sched, now = self.engine.scheduler, self.engine.clock()
        req = sched.requests.get(load.request_id)
        if req is not None:
            req.kv_transfer_start, req.kv_transfer_end = start, now
        sched.update_connector_output((), (), now, {load.request_id})
        self.outbox.send(("kv_failed", self.index, load.remote_instance, load.remote_request_id))

    def finish_sends(self, within_s: float) -> None:
        """Let the sends under way end (their blocks freed), for up to ``within_s``."""
        deadline = time.perf_counter() + within_s
        while self.sends and time.perf_counter() < deadline:
            time.sleep(XFER_POLL_S)
            self.poll()

    def poll(self) -> None:
        """Finish the transfers that have ended, on both schedulers' side; fail the
        receives that errored or ran past the timeout."""
        sched, now = self.engine.scheduler, self.engine.clock
        for tag, rec in list(self.recvs.items()):
            if not rec.work.finished:
                if now() - rec.start > self.timeout_s:
                    self.fail(tag)
                continue
            if rec.work.error is not None:
                self.fail(tag)
                continue
            del self.recvs[tag]
            self.executor.scatter_kv(rec.load.block_ids[: rec.num_blocks], rec.buffer)
            req = sched.requests[rec.load.request_id]
            req.kv_transfer_start, req.kv_transfer_end = rec.start, now()
            req.kv_transfer_bytes = rec.buffer.numel() * rec.buffer.element_size()
            sched.update_connector_output((), {rec.load.request_id}, now())
        # A send that ended, sent or not (a receiver that died fails on its side).
        ended = {leg for leg, (work, _) in self.sends.items() if work.finished}
        if ended:
            for leg in ended:
                del self.sends[leg]
            sched.update_connector_output(ended, (), now())


def step_message(index: int, res, sched) -> tuple:
    """What a worker tells the parent after a step: the step log's row, its KV
    usage now (the step's finished requests freed: what a router reads), and the
    keys its prefix cache made findable or dropped since the last message (when
    the cluster asks for them: ``kv.record_events``)."""
    return ("step", index, step_row(res), sched.kv_usage, sched.kv.take_events())


def kv_message(index: int, sched) -> tuple:
    """What a worker tells the parent when its KV cache changed between steps (a
    transfer ended: blocks freed or filled): its usage and cache changes."""
    return ("kv", index, sched.kv_usage, sched.kv.take_events())


def worker_main(
    index: int,
    args: EngineArgs,
    inbox,
    outbox,
    model=None,
    dist_init=None,
    kv_events: bool = False,
) -> None:
    """Build the engine (``model``: the resolved (config, folder, name), else
    ``args.model``; ``dist_init``: ``(init_method, world_size, backend)`` of the KV
    group; ``kv_events``: report the prefix cache's changes with each step), say
    ``ready``, wait for ``("start", origin)``, then serve the parent's messages
    (:func:`_handle`) until ``("stop",)``."""
    try:
        from testbed.engine.factory import build_engine

        engine, executor, _ = build_engine(args, model=model)
        if kv_events:
            engine.scheduler.kv.record_events()
        transport = None
        if dist_init is not None:
            import torch.distributed as dist

            method, world, backend = dist_init
            dist.init_process_group(backend, init_method=method, rank=index, world_size=world)
            kv_cfg = args.kv_transfer_config or {}
            faults = KVFaults(**kv_cfg.get("kv_faults", {}))
            timeout = kv_cfg.get("kv_timeout_s", float("inf"))
            transport = KVTransport(index, engine, executor, outbox, faults, timeout)
        outbox.send(("ready", index))
        msg = inbox.get()
        if msg[0] != "start":
            return
        engine.clock = WallClock(origin=msg[1])
        sched = engine.scheduler
        while True:
            runnable = bool(sched.running or sched.waiting or sched.ready)
            waiting_kv = transport is not None and (transport.busy or sched.loading)
            wait = 0.0 if runnable else XFER_POLL_S if waiting_kv else IDLE_POLL_S
            messages = _messages(inbox, wait)
            if not all(_handle(m, index, engine, transport, outbox) for m in messages):
                if transport is not None:
                    transport.finish_sends(STOP_DRAIN_S)
                break
            if transport is not None:
                usage = sched.kv_usage
                transport.poll()
                if sched.kv_usage != usage or sched.kv.has_events:
                    outbox.send(kv_message(index, sched))
            if not (sched.running or sched.waiting or sched.ready):
                continue  # nothing to run: the next message or transfer
            res = engine.step()
            outbox.send(step_message(index, res, sched))
            meta = res.scheduler_output.kv_connector_metadata if res.scheduler_output else None
            if meta is not None and transport is not None:
                transport.start_loads(meta)
            for req in res.finished:
                outbox.send(("done", index, req))
        outbox.send(
            (
                "exit",
                index,
                dict(
                    tokens_computed=executor.num_computed_tokens,
                    prefix_hits=sched.prefix_cache_stats.hits,
                    prefix_queries=sched.prefix_cache_stats.queries,
                    num_kv_blocks=sched.kv.num_blocks,
                    # Blocks still allocated at the stop (every request has ended):
                    # a leak, or KV kept for a transfer that never came.
                    kv_blocks_held=sched.kv.num_blocks - sched.kv.num_free_blocks,
                ),
            )
        )
    except KeyboardInterrupt:
        return
    except Exception:  # the parent reports it, by the worker's name
        outbox.send(("error", index, traceback.format_exc()))


def _messages(inbox, wait: float) -> list:
    """Every message waiting (for the first, up to ``wait`` seconds)."""
    out = []
    try:
        out.append(inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        return out


def _handle(msg, index: int, engine, transport: KVTransport | None, outbox) -> bool:
    """One message from the parent; False for ``stop``. ``("add", [requests])``;
    with KV transfers ``("send", leg id, dst, tag, blocks)``, ``("release", leg
    id)`` (its KV is not wanted), ``("fail_load", tag)`` (the prefill worker cannot
    send it), ``("peer_dead", worker)``."""
    kind = msg[0]
    if kind == "stop":
        return False
    if kind == "add":
        for req in msg[1]:
            if not engine.add_request(req):
                outbox.send(("done", index, req))
    elif kind == "send":
        transport.send(*msg[1:])
    elif kind == "release":
        transport.release(msg[1])
    elif kind == "fail_load":
        transport.fail(msg[1])
    elif kind == "peer_dead":
        transport.peer_dead(msg[1])
    return True
