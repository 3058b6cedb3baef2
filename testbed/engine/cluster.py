"""Several real engine instances, each in its own process, behind the router:
the parent side of a multi-process real run (``mode=real`` with
``cluster.num_replicas`` > 1).

The parent starts the workers (:mod:`testbed.engine.worker`, torch
multiprocessing, spawned), waits until every one has built its engine, then
replays the trace on the wall clock: each arrival goes to the replica the router
picks (policies/routers.py, on the parent's counts of what each has
outstanding), each step's row comes back into one step log, each request comes
back when it ends. A worker that dies is reported by name and its outstanding
requests are sent again, from scratch, to the others (or, with none left,
reported failed); a Ctrl-C or SIGTERM stops every worker and the run still
returns what it measured.
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

from policies.routers import LeastKVUsage, PoolView
from testbed.core import Request, RequestStatus, WallClock
from testbed.core.kv_connector import hand_over, prefill_leg
from testbed.core.kv_faults import KVFaults
from testbed.engine.args import EngineArgs
from testbed.engine.device import pick_device
from testbed.engine.worker import worker_main
from testbed.errors import InputError
from testbed.host import usable_cores
from testbed.metrics import RunResult, StepLog

START_TIMEOUT_S = 600.0  # a worker that has not built its engine by then has failed


class ReplicaState:
    """A worker as the router sees it, and what the parent knows of it."""

    def __init__(self, index: int, process, inbox, outbox) -> None:
        self.index, self.process, self.inbox, self.outbox = index, process, inbox, outbox
        self.outstanding: dict[str, Request] = {}  # sent there, not back yet
        self.num_outstanding_tokens = 0
        self.alive = True
        self.exit_stats: dict | None = None
        self.kv_usage = 0.0  # at its last step

    @property
    def name(self) -> str:
        return f"engine-{self.index}"

    @property
    def num_outstanding(self) -> int:
        return len(self.outstanding)

    def send(self, request: Request) -> None:
        self.outstanding[request.request_id] = request
        self.num_outstanding_tokens += request.num_prompt_tokens
        self.inbox.put(("add", [request]))

    def take(self, request_id: str) -> Request | None:
        req = self.outstanding.pop(request_id, None)
        if req is not None:
            self.num_outstanding_tokens -= req.num_prompt_tokens
        return req


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
) -> RunResult:
    """Replay ``requests`` on ``num_replicas`` engine processes; the run's records
    (``requests`` as they came back, in their order) and merged step log. With
    ``num_prefill``, the first that many are prefill instances and the rest decode
    instances (disaggregated: :class:`PDRouting`; ``faults`` injected into their KV
    transfers, a receive not done in ``kv_timeout_s`` failed; ``kv_backend``: the
    torch.distributed backend, ``auto``: gloo on a CPU, nccl on GPUs)."""
    ctx = mp.get_context("spawn")
    pd_routing = PDRouting(num_prefill, decider, pairing or LeastKVUsage()) if num_prefill else None
    dist_init = None
    if pd_routing is not None:
        backend = kv_group_backend(args, num_replicas, kv_backend)
        dist_init = (f"tcp://127.0.0.1:{free_port()}", num_replicas, backend)
    replicas: list[ReplicaState] = []
    for i in range(num_replicas):
        inbox = ctx.Queue()
        reader, writer = ctx.Pipe(duplex=False)
        own = worker_args(args, num_replicas, i)
        if pd_routing is not None:
            role = "kv_producer" if i < num_prefill else "kv_consumer"
            kv_cfg = {"kv_role": role, "kv_rank": i, "kv_timeout_s": kv_timeout_s}
            if faults is not None:
                kv_cfg["kv_faults"] = asdict(faults)
            own = replace(own, kv_transfer_config=kv_cfg)
        proc = ctx.Process(
            target=worker_main,
            args=(i, own, inbox, writer, model, dist_init),
            name=f"engine-{i}",
            daemon=True,
        )
        proc.start()
        writer.close()  # the worker's end: a dead worker's pipe reads as closed
        replicas.append(ReplicaState(i, proc, inbox, reader))
    outbox = Outboxes(replicas)
    final: dict[str, Request] = {}
    log = StepLog()
    partial, reason, error = False, "finished", None
    messages: list[str] = []
    start = time.perf_counter()
    clock = WallClock()
    try:
        _wait_ready(replicas, outbox)
        clock.reset()
        for rep in replicas:
            rep.inbox.put(("start", clock.origin))
        pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        while pending or any(rep.outstanding for rep in replicas):
            now = clock()
            if max_wall_s is not None and now > max_wall_s:
                partial, reason = True, f"stopped at max_wall_s={max_wall_s}"
                break
            live = [rep for rep in replicas if rep.alive]
            if not live:
                reason = "every engine process died"
                break
            while pending and pending[0].arrival_time <= now:
                _dispatch(pending.popleft(), live, router, now, pd_routing)
            wait = pending[0].arrival_time - clock() if pending else 0.05
            _drain(
                outbox, replicas, final, log, max(0.0, min(wait, 0.05)), on_progress, clock,
                pd_routing,
            )  # fmt: skip
            for rep in replicas:
                if rep.alive and not rep.process.is_alive():
                    others = [r for r in replicas if r.alive and r is not rep]
                    n = _lost(rep, others, router, clock(), pd_routing, replicas)
                    what = "sent again to the others" if others else "failed"
                    messages.append(
                        f"{rep.name} died (exit code {rep.process.exitcode}): "
                        f"its {n} outstanding requests {what}"
                    )
                    print(f"WARNING: {messages[-1]}", flush=True)
        for rep in replicas:
            if rep.alive and rep.process.is_alive():
                rep.inbox.put(("stop",))
        _collect_exits(replicas, outbox, final, log)
    except KeyboardInterrupt as e:  # the caller re-raises it once the run is written
        partial, reason, error = True, "interrupted", e
    except Exception as e:  # keep what was measured; the caller re-raises
        partial, reason, error = True, f"error: {e!r}", e
    finally:
        for rep in replicas:
            if rep.process.is_alive():
                rep.process.terminate()
            rep.process.join(timeout=5)
    ordered = [final.get(r.request_id, r) for r in requests]
    stats = [rep.exit_stats or {} for rep in replicas]
    return RunResult(
        requests=ordered,
        steps=log,
        duration_s=clock(),
        wall_s=time.perf_counter() - start,
        partial=partial or any(r.finish_time is None for r in ordered),
        stop_reason=reason if not messages else f"{reason}; " + "; ".join(messages),
        error=error,
        extra={"replica_stats": stats, "replica_events": messages},
    )


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


def _choose(req: Request, pool: list[ReplicaState], router, now: float) -> ReplicaState:
    return pool[router.route(req, [PoolView(r, i) for i, r in enumerate(pool)], now)]


def _dispatch(req: Request, live: list[ReplicaState], router, now: float, pd=None) -> None:
    if pd is None:
        _choose(req, live, router, now).send(req)
    else:
        pd.dispatch(req, live, router, now)


class PDRouting:
    """Disaggregated prefill/decode in the parent: an arrival the decider
    disaggregates goes as a one-token prefill leg to the prefill instance the router
    picks; when the leg comes back (its KV held there) the request goes to the
    decode instance the pairing router picks (least KV usage by default), which
    pulls the KV (the parent passes
    its ``pull`` on to the prefill instance as a ``send``). Others go whole to a
    decode instance. The decider sees the prompt's length (the parent does not
    know what a decode instance has cached)."""

    def __init__(self, num_prefill: int, decider, pairing) -> None:
        self.num_prefill, self.decider, self.pairing = num_prefill, decider, pairing
        self.legs: dict[str, Request] = {}  # leg id -> its request

    def _decode(self, req: Request, live: list[ReplicaState], now: float) -> ReplicaState | None:
        pool = [r for r in live if r.index >= self.num_prefill]
        return _choose(req, pool, self.pairing, now) if pool else None

    def dispatch(self, req: Request, live: list[ReplicaState], router, now: float) -> None:
        prefill = [r for r in live if r.index < self.num_prefill]
        split = self.decider is None or self.decider.disaggregate(req, req.num_prompt_tokens)
        if not prefill or not split or not any(r.index >= self.num_prefill for r in live):
            # Whole, to a decode instance (the pairing asked once per request: here,
            # or for a disaggregated one when its leg is back).
            (self._decode(req, live, now) or live[0]).send(req)
            return
        leg = prefill_leg(req)
        self.legs[leg.request_id] = req
        _choose(leg, prefill, router, now).send(leg)

    def finished(self, req: Request, replicas: list[ReplicaState], now: float) -> Request | None:
        """A request back from a worker: the user's request it finishes, or None
        (a leg whose request has gone on to a decode instance)."""
        original = self.legs.pop(req.request_id, None)
        if original is None:
            return req
        if not hand_over(req, original):  # refused or aborted: so is the request
            return original
        decode = self._decode(original, [r for r in replicas if r.alive], now)
        if decode is None:  # every decode instance is gone: computed again whole
            original.kv_transfer_params = None
            decode = next(r for r in replicas if r.alive)
        decode.send(original)
        return None

    def lost(self, req: Request, others: list[ReplicaState], replicas, router, now: float):
        """Send again a request lost with its worker: a leg's request from the
        start (a new leg, or whole); a decode request whole to a decode instance
        (the prefill worker holding its KV is told to free it)."""
        original = self.legs.pop(req.request_id, None)
        if original is not None:
            self.dispatch(original, others, router, now)
            return
        params, req.kv_transfer_params = req.kv_transfer_params, None
        if params and params.get("remote_instance") is not None:
            _tell(replicas[params["remote_instance"]], ("release", params["remote_request_id"]))
        (self._decode(req, others, now) or others[0]).send(req)

    def worker_died(self, rep: ReplicaState, replicas: list[ReplicaState]) -> None:
        """A prefill worker died: the decode workers give up on loads from it."""
        if rep.index < self.num_prefill:
            for other in replicas[self.num_prefill :]:
                _tell(other, ("peer_dead", rep.index))


def _tell(rep: ReplicaState, msg) -> None:
    """Send ``msg`` to a worker, if it is still there."""
    if rep.alive and rep.process.is_alive():
        rep.inbox.put(msg)


def _drain(outbox, replicas, final, log, timeout, on_progress, clock, pd=None) -> None:
    """Take every message there is (waiting up to ``timeout`` for the first)."""
    block = timeout > 0
    while True:
        try:
            msg = outbox.get(timeout=timeout) if block else outbox.get_nowait()
        except queue.Empty:
            return
        block = False
        _handle(msg, replicas, final, log, on_progress, clock, pd)


def _handle(msg, replicas, final, log, on_progress, clock, pd=None) -> None:
    kind, index = msg[0], msg[1]
    rep = replicas[index]
    if kind == "step":
        log.add(index, *msg[2])
        rep.kv_usage = msg[2][5]
    elif kind == "pull":  # a decode worker waits for a prefill worker's KV
        _, dst, src, leg_id, tag, n = msg
        if replicas[src].alive and replicas[src].process.is_alive():
            replicas[src].inbox.put(("send", leg_id, dst, tag, n))
        else:
            _tell(replicas[dst], ("fail_load", tag))
    elif kind == "nosend":  # a prefill worker cannot send a load's KV
        _, _, dst, tag = msg
        _tell(replicas[dst], ("fail_load", tag))
    elif kind == "kv_failed":  # a decode worker gave up on a load: free its blocks
        _, _, src, leg_id = msg
        _tell(replicas[src], ("release", leg_id))
    elif kind == "done":
        req = msg[2]
        if rep.take(req.request_id) is not None:
            if pd is not None:
                req = pd.finished(req, replicas, clock())
            if req is not None:
                final[req.request_id] = req
                if on_progress is not None:
                    on_progress(clock(), len(final))
    elif kind == "exit":
        rep.exit_stats = msg[2]
    elif kind == "error":
        rep.alive = False
        raise RuntimeError(f"{rep.name} failed:\n{msg[2]}")


def _lost(rep: ReplicaState, others: list[ReplicaState], router, now: float, pd, replicas) -> int:
    """A worker died: its outstanding requests start again elsewhere, from scratch
    (the parent's copies were never changed), or fail with the reason; how many."""
    rep.alive = False
    if pd is not None:
        pd.worker_died(rep, replicas)
    lost = list(rep.outstanding.values())
    rep.outstanding.clear()
    for req in lost:
        if others and pd is not None:
            pd.lost(req, others, replicas, router, now)
        elif others:
            _choose(req, others, router, now).send(req)
        else:
            req.status = RequestStatus.FINISHED_ABORTED
            req.finish_reason = req.reject_reason = f"{rep.name} died"
            req.finish_time = now
    return len(lost)


def _collect_exits(replicas, outbox, final, log) -> None:
    """After the stop: the last rows and every live worker's counters."""
    deadline = time.perf_counter() + 30
    waiting = {r.index for r in replicas if r.alive and r.process.is_alive()}
    while waiting and time.perf_counter() < deadline:
        try:
            msg = outbox.get(timeout=0.5)
        except queue.Empty:
            waiting = {i for i in waiting if replicas[i].process.is_alive()}
            continue
        if msg[0] == "exit":
            waiting.discard(msg[1])
        _handle(msg, replicas, final, log, None, None)
