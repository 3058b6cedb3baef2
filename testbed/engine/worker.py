"""One engine instance in its own process: the child side of a multi-process
real run (:mod:`testbed.engine.cluster`).

The parent sends requests (whole :class:`~testbed.core.Request` objects, pickled)
and a stop over a queue; the worker steps its engine whenever it has work, on a
wall clock that counts from the parent's origin (``time.perf_counter`` is
system-wide), and sends back, over its own pipe (a worker killed mid-message
spoils only its own), each step's row of the step log, each request when it
ends, and at exit its counters.

In a disaggregated cluster the workers also form a ``torch.distributed`` group
(gloo on CPU, NCCL on GPUs) that moves KV: a decode worker whose connector asks
for a request's prompt KV posts a receive from the prefill worker holding it and
asks it, through the parent, to send (``pull`` / ``send``); the prefill worker
gathers the blocks and sends them; as each side's transfer completes its
scheduler hears of it (``update_connector_output``). A Ctrl-C that reaches the
worker too (one process group) ends it quietly: the parent decides what the run
writes.
"""

from __future__ import annotations

import queue
import threading
import traceback

from testbed.core import WallClock
from testbed.engine.args import EngineArgs
from testbed.metrics.steplog import step_row

IDLE_POLL_S = 0.02  # how long an idle worker waits for a message at a time
XFER_POLL_S = 0.0005  # ... while a KV transfer is under way
TAG_STRIDE = 1 << 20  # transfer tags: the receiving worker's index * this + a count


class Pending:
    """A point-to-point send or receive under way: gloo completes one only in its
    ``wait``, so a thread waits and the worker's loop polls :meth:`done`."""

    def __init__(self, work) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

        def wait() -> None:
            try:
                work.wait()
            except BaseException as e:  # reported when polled
                self._error = e
            self._done.set()

        threading.Thread(target=wait, daemon=True).start()

    def done(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise RuntimeError(f"KV transfer failed: {self._error!r}") from self._error
        return self._done.is_set()


class KVTransport:
    """The data side of the worker's KV connector: point-to-point sends and
    receives of gathered blocks, polled from the worker's loop."""

    def __init__(self, index: int, engine, executor, outbox) -> None:
        import torch.distributed as dist

        self.dist, self.index = dist, index
        self.engine, self.executor, self.outbox = engine, executor, outbox
        self.recvs: list = []  # (work, load, buffer, blocks, start)
        self.sends: list = []  # (work, leg id, buffer)
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
            work = Pending(self.dist.irecv(buf, src=load.remote_instance, tag=tag))
            self.recvs.append((work, load, buf, n, self.engine.clock()))
            self.outbox.send(
                ("pull", self.index, load.remote_instance, load.remote_request_id, tag, n)
            )

    def send(self, leg_id: str, dst: int, tag: int, n: int) -> None:
        """Send the first ``n`` blocks of a finished leg's KV to ``dst``."""
        blocks = self.engine.scheduler.kv.get_block_ids(leg_id)[:n]
        buf = self.executor.gather_kv(blocks).contiguous()
        self.sends.append((Pending(self.dist.isend(buf, dst=dst, tag=tag)), leg_id, buf))

    def poll(self) -> None:
        """Finish the transfers that have completed, on both schedulers' side."""
        sched, now = self.engine.scheduler, self.engine.clock
        if self.recvs:
            left = []
            for work, load, buf, n, start in self.recvs:
                if not work.done():
                    left.append((work, load, buf, n, start))
                    continue
                self.executor.scatter_kv(load.block_ids[:n], buf)
                req = sched.requests[load.request_id]
                req.kv_transfer_start, req.kv_transfer_end = start, now()
                req.kv_transfer_bytes = buf.numel() * buf.element_size()
                sched.update_connector_output((), {load.request_id}, now())
            self.recvs = left
        if self.sends:
            done = {leg for work, leg, _ in self.sends if work.done()}
            if done:
                sched.update_connector_output(done, (), now())
                self.sends = [s for s in self.sends if s[1] not in done]


def worker_main(index: int, args: EngineArgs, inbox, outbox, model=None, dist_init=None) -> None:
    """Build the engine (``model``: the resolved (config, folder, name), else
    ``args.model``; ``dist_init``: ``(init_method, world_size, backend)`` of the KV
    group), say ``ready``, wait for ``("start", origin)``, then serve ``("add",
    [requests])`` and ``("send", leg id, dst, tag, blocks)`` until ``("stop",)``."""
    try:
        from testbed.engine.factory import build_engine

        engine, executor, _ = build_engine(args, model=model)
        transport = None
        if dist_init is not None:
            import torch.distributed as dist

            method, world, backend = dist_init
            dist.init_process_group(backend, init_method=method, rank=index, world_size=world)
            transport = KVTransport(index, engine, executor, outbox)
        outbox.send(("ready", index))
        msg = inbox.get()
        if msg[0] != "start":
            return
        engine.clock = WallClock(origin=msg[1])
        sched = engine.scheduler
        while True:
            runnable = bool(sched.running or sched.waiting or sched.ready)
            waiting_kv = transport is not None and (transport.busy or sched.loading)
            try:
                if runnable:
                    msg = inbox.get_nowait()
                else:
                    msg = inbox.get(timeout=XFER_POLL_S if waiting_kv else IDLE_POLL_S)
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "stop":
                    break
                if msg[0] == "send":
                    transport.send(*msg[1:])
                else:
                    for req in msg[1]:
                        if not engine.add_request(req):
                            outbox.send(("done", index, req))
            if transport is not None:
                transport.poll()
            if not (sched.running or sched.waiting or sched.ready):
                continue  # nothing to run: the next message or transfer
            res = engine.step()
            outbox.send(("step", index, step_row(res)))
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
