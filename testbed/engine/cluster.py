"""Several real engine instances, each in its own process, behind the router:
the parent side of a multi-process real run (``mode=real`` with
``cluster.num_replicas`` > 1).

The parent starts the workers (:mod:`testbed.engine.worker`, torch
multiprocessing, spawned), waits until every one has built its engine, then
replays the trace on the wall clock. Every decision is the cluster core's
(:class:`~testbed.core.cluster.ClusterCore`, the simulator's too): where an
arrival goes, whether it is disaggregated, its decode replica, the hand-over of
its prefill leg, what a lost worker's requests become. This module is its
transport: it hands the core each arrival, each request a worker sends back and
each lost worker, and carries out the actions over the workers' queues. The
core reads a worker's KV usage and prefix cache from what its last step
reported (:class:`ReplicaState`). Each step's row comes back into one step log.
A worker that dies is reported by name; a Ctrl-C or SIGTERM stops every worker
and the run still returns what it measured. A closed loop's requests
(:class:`~testbed.workload.ClosedLoop`) are sent as requests come back.
"""

from __future__ import annotations

import queue
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from policies.routers import LeastKVUsage
from testbed.core import Request, WallClock
from testbed.core.cluster import ClusterCore, Deliver, Finish, PeerLost, Release, caches_read
from testbed.core.kv_cache import PrefixCacheMirror
from testbed.core.kv_faults import KVFaults
from testbed.engine.args import EngineArgs
from testbed.engine.device import pick_device
from testbed.engine.worker import worker_main
from testbed.errors import InputError
from testbed.host import usable_cores
from testbed.metrics import RunResult, StepLog
from testbed.workload import ClosedLoop

START_TIMEOUT_S = 600.0  # a worker that has not built its engine by then has failed


class ReplicaState:
    """A worker as the parent knows it: its process and queues, and what its last
    step reported (the cluster core's probe of it: KV usage, and with
    ``mirror`` its prefix cache)."""

    def __init__(self, index: int, process, inbox, outbox, mirror=None) -> None:
        self.index, self.process, self.inbox, self.outbox = index, process, inbox, outbox
        self.alive = True
        self.exit_stats: dict | None = None
        self.kv_usage = 0.0  # after its last step
        self.mirror: PrefixCacheMirror | None = mirror

    @property
    def name(self) -> str:
        return f"engine-{self.index}"

    def prefix_hit_tokens(self, request: Request) -> int:
        if self.mirror is None:
            raise AssertionError("a router that reads the cache needs the workers' KV events")
        return self.mirror.prefix_hit_tokens(request)

    def on_step(self, kv_usage: float, events) -> None:
        """What a step (or KV) message says of the worker's KV cache."""
        self.kv_usage = kv_usage
        if self.mirror is not None and events:
            self.mirror.apply(events)


def worker_args(args: EngineArgs, num_replicas: int, index: int) -> EngineArgs:
    """Worker ``index``'s engine: on a CPU, the cores shared out (one torch thread
    per core, not every worker on every core) unless ``threads`` says otherwise; on
    GPUs, one each in turn (``cuda:<index mod GPUs>``)."""
    device = pick_device(args.device)
    if device.type == "cuda" and device.index is None:
        return replace(args, device=f"cuda:{index % torch.cuda.device_count()}")
    if args.threads is None and device.type == "cpu":
        return replace(args, threads=max(1, usable_cores() // num_replicas))
    return args


def kv_group_backend(args: EngineArgs, num_replicas: int, backend: str = "auto") -> str:
    """The torch.distributed backend of a disaggregated cluster's KV group: ``auto``
    is gloo on a CPU, nccl on GPUs (which needs a GPU per engine process)."""
    device = pick_device(args.device)
    if backend == "auto":
        backend = "gloo" if device.type == "cpu" else "nccl"
    if backend == "nccl" and (device.type != "cuda" or torch.cuda.device_count() < num_replicas):
        have = torch.cuda.device_count() if device.type == "cuda" else 0
        raise InputError(
            f"cluster.kv_backend=nccl: needs a GPU per engine process ({num_replicas}), "
            f"this machine has {have}"
        )
    if backend == "gloo" and device.type != "cpu":
        raise InputError(
            "cluster.kv_backend=gloo: the KV cache is on a GPU here; gloo moves CPU tensors"
        )
    return backend


def replay_cluster(
    args: EngineArgs,
    requests: Sequence[Request],
    num_replicas: int,
    router,
    on_progress: Callable[[float, int], None] | None = None,
    max_wall_s: float | None = None,
    model=None,
    num_prefill: int = 0,
    decider=None,
    pairing=None,
    faults: KVFaults | None = None,
    kv_timeout_s: float = float("inf"),
    kv_backend: str = "auto",
    max_concurrency: int | None = None,
) -> RunResult:
    """Replay ``requests`` on ``num_replicas`` engine processes; the run's records
    (``requests`` as they came back, in their order) and merged step log. With
    ``num_prefill``, the first that many are prefill instances and the rest decode
    instances (disaggregated: ``decider`` and ``pairing`` as the cluster core takes
    them; ``faults`` injected into their KV transfers, a receive not done in
    ``kv_timeout_s`` failed; ``kv_backend``: the torch.distributed backend,
    ``auto``: gloo on a CPU, nccl on GPUs). ``max_concurrency``: send ``requests``
    in that order in a closed loop of that many clients, each request as soon as
    its client's last one is back (None: at their arrival times)."""
    ctx = mp.get_context("spawn")
    pairing = (pairing or LeastKVUsage()) if num_prefill else None
    reads_cache = caches_read(num_replicas, router, num_prefill, decider, pairing)
    dist_init = None
    if num_prefill:
        backend = kv_group_backend(args, num_replicas, kv_backend)
        dist_init = (f"tcp://127.0.0.1:{free_port()}", num_replicas, backend)
    replicas: list[ReplicaState] = []
    for i in range(num_replicas):
        inbox = ctx.Queue()
        reader, writer = ctx.Pipe(duplex=False)
        own = worker_args(args, num_replicas, i)
        if num_prefill:
            role = "kv_producer" if i < num_prefill else "kv_consumer"
            kv_cfg = {"kv_role": role, "kv_rank": i, "kv_timeout_s": kv_timeout_s}
            if faults is not None:
                kv_cfg["kv_faults"] = asdict(faults)
            own = replace(own, kv_transfer_config=kv_cfg)
        proc = ctx.Process(
            target=worker_main,
            args=(i, own, inbox, writer, model, dist_init, reads_cache[i]),
            name=f"engine-{i}",
            daemon=True,
        )
        proc.start()
        writer.close()  # the worker's end: a dead worker's pipe reads as closed
        mirror = PrefixCacheMirror(args.block_size, args.enable_prefix_caching)
        replicas.append(ReplicaState(i, proc, inbox, reader, mirror if reads_cache[i] else None))
    core = ClusterCore(replicas, router, num_prefill, decider, pairing)
    clock = WallClock()
    loop = None if max_concurrency is None else ClosedLoop(enumerate(requests), max_concurrency)
    parent = Parent(core, replicas, clock, on_progress, loop)
    outbox = Outboxes(replicas)
    partial, reason, error = False, "finished", None
    start = time.perf_counter()
    try:
        _wait_ready(replicas, outbox)
        clock.reset()
        for rep in replicas:
            rep.inbox.put(("start", clock.origin))
        pending = deque(sorted(requests, key=lambda r: r.arrival_time) if loop is None else ())
        while pending or any(core.num_outstanding()) or (loop is not None and not loop.done):
            now = clock()
            if max_wall_s is not None and now > max_wall_s:
                partial, reason = True, f"stopped at max_wall_s={max_wall_s}"
                break
            if not any(rep.alive for rep in replicas):
                reason = "every engine process died"
                break
            while pending and pending[0].arrival_time <= now:
                parent.apply(core.arrive(pending.popleft(), now))
            if loop is not None:  # a closed loop's, as clients free
                for _, req in loop.send(now):
                    parent.apply(core.arrive(req, now))
            wait = pending[0].arrival_time - clock() if pending else 0.05
            parent.drain(outbox, max(0.0, min(wait, 0.05)))
            for rep in replicas:
                if rep.alive and not rep.process.is_alive():
                    parent.lose(rep)
        for rep in replicas:
            if rep.alive and rep.process.is_alive():
                rep.inbox.put(("stop",))
        _collect_exits(replicas, outbox, parent)
    except KeyboardInterrupt as e:  # the caller re-raises it once the run is written
        partial, reason, error = True, "interrupted", e
    except Exception as e:  # keep what was measured; the caller re-raises
        partial, reason, error = True, f"error: {e!r}", e
    finally:
        for rep in replicas:
            if rep.process.is_alive():
                rep.process.terminate()
            rep.process.join(timeout=5)
    if loop is not None:
        for _ in loop.unsent():  # a run stopped part-way: never sent, never arrived
            pass
    ordered = [parent.final.get(r.request_id, r) for r in requests]
    stats = [rep.exit_stats or {} for rep in replicas]
    messages = parent.messages
    return RunResult(
        requests=ordered,
        steps=parent.log,
        duration_s=clock(),
        wall_s=time.perf_counter() - start,
        partial=partial or any(r.finish_time is None for r in ordered),
        stop_reason=reason if not messages else f"{reason}; " + "; ".join(messages),
        error=error,
        extra={"replica_stats": stats, "replica_events": messages},
    )


class Parent:
    """The cluster core's transport over worker processes: it carries out the
    core's actions on the workers' queues and turns the workers' messages into
    the core's events; ``final`` holds each request that ended for its user, the
    step log every worker's rows. In a closed loop (``loop``) each request that
    ended frees its client."""

    def __init__(
        self,
        core: ClusterCore,
        replicas: list[ReplicaState],
        clock,
        on_progress=None,
        loop: ClosedLoop | None = None,
    ):
        self.core, self.replicas, self.clock = core, replicas, clock
        self.on_progress = on_progress
        self.loop = loop
        self.final: dict[str, Request] = {}
        self.log = StepLog()
        self.messages: list[str] = []  # what happened to the workers, said once each

    def apply(self, actions) -> None:
        for action in actions:
            kind = type(action)
            if kind is Deliver:
                self.replicas[action.replica].inbox.put(("add", [action.request]))
            elif kind is Finish:
                req = action.request
                self.final[req.request_id] = req
                if self.loop is not None:
                    self.loop.ended(req, self.clock())
                if self.on_progress is not None:
                    self.on_progress(self.clock(), len(self.final))
            elif kind is Release:
                _tell(self.replicas[action.replica], ("release", action.leg_id))
            elif kind is PeerLost:
                _tell(self.replicas[action.replica], ("peer_dead", action.lost))
            else:
                raise AssertionError(f"unknown action {action!r}")

    def drain(self, outbox, timeout: float) -> None:
        """Take every message there is (waiting up to ``timeout`` for the first)."""
        block = timeout > 0
        while True:
            try:
                msg = outbox.get(timeout=timeout) if block else outbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self.handle(msg)

    def handle(self, msg) -> None:
        """One message from a worker (:mod:`testbed.engine.worker`)."""
        kind, index = msg[0], msg[1]
        rep = self.replicas[index]
        if kind == "step":
            self.log.add(index, *msg[2])
            rep.on_step(msg[3], msg[4])
        elif kind == "kv":  # its KV cache changed between steps
            rep.on_step(msg[2], msg[3])
        elif kind == "pull":  # a decode worker waits for a prefill worker's KV
            _, dst, src, leg_id, tag, n = msg
            if self.replicas[src].alive and self.replicas[src].process.is_alive():
                self.replicas[src].inbox.put(("send", leg_id, dst, tag, n))
            else:
                _tell(self.replicas[dst], ("fail_load", tag))
        elif kind == "nosend":  # a prefill worker cannot send a load's KV
            _, _, dst, tag = msg
            _tell(self.replicas[dst], ("fail_load", tag))
        elif kind == "kv_failed":  # a decode worker gave up on a load
            _, _, src, leg_id = msg
            self.apply(self.core.transfer_failed(src, leg_id))
        elif kind == "done":
            self.apply(self.core.finish(index, [msg[2]], self.clock()))
        elif kind == "exit":
            rep.exit_stats = msg[2]
        elif kind == "error":
            rep.alive = False
            raise RuntimeError(f"{rep.name} failed:\n{msg[2]}")

    def lose(self, rep: ReplicaState) -> None:
        """A worker died: the core says what its outstanding requests become."""
        rep.alive = False
        n = self.core.slots[rep.index].num_outstanding
        self.apply(self.core.lose(rep.index, self.clock(), f"{rep.name} died"))
        others = any(r.alive for r in self.replicas)
        what = "sent again to the others" if others else "failed"
        self.messages.append(
            f"{rep.name} died (exit code {rep.process.exitcode}): "
            f"its {n} outstanding requests {what}"
        )
        print(f"WARNING: {self.messages[-1]}", flush=True)


class Outboxes:
    """Every worker's pipe, read as one queue of messages (``get``); a pipe whose
    worker died reads as closed and is dropped."""

    def __init__(self, replicas: list[ReplicaState]) -> None:
        self.open = {rep.outbox: rep for rep in replicas}
        self.ready: deque = deque()

    def get(self, timeout: float | None = None):
        while not self.ready:
            conns = wait(list(self.open), timeout)
            if not conns:
                raise queue.Empty
            for conn in conns:
                try:
                    self.ready.append(conn.recv())
                except (EOFError, OSError):
                    del self.open[conn]
            if not self.open and not self.ready:
                raise queue.Empty
        return self.ready.popleft()

    def get_nowait(self):
        return self.get(timeout=0)


def _wait_ready(replicas: list[ReplicaState], outbox) -> None:
    ready: set[int] = set()
    deadline = time.perf_counter() + START_TIMEOUT_S
    while len(ready) < len(replicas):
        try:
            msg = outbox.get(timeout=1.0)
        except queue.Empty:
            dead = [r.name for r in replicas if not r.process.is_alive()]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} died while building its engine") from None
            if time.perf_counter() > deadline:
                raise RuntimeError("engine processes did not start in time") from None
            continue
        if msg[0] == "ready":
            ready.add(msg[1])
        elif msg[0] == "error":
            raise RuntimeError(f"engine-{msg[1]} failed to start:\n{msg[2]}")


def free_port() -> int:
    """A TCP port free on this machine now (for the KV group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tell(rep: ReplicaState, msg) -> None:
    """Send ``msg`` to a worker, if it is still there."""
    if rep.alive and rep.process.is_alive():
        rep.inbox.put(msg)


def _collect_exits(replicas, outbox, parent: Parent) -> None:
    """After the stop: the last rows and every live worker's counters."""
    deadline = time.perf_counter() + 30
    waiting = {r.index for r in replicas if r.alive and r.process.is_alive()}
    parent.on_progress = None
    while waiting and time.perf_counter() < deadline:
        try:
            msg = outbox.get(timeout=0.5)
        except queue.Empty:
            waiting = {i for i in waiting if replicas[i].process.is_alive()}
            continue
        if msg[0] == "exit":
            waiting.discard(msg[1])
        parent.handle(msg)
