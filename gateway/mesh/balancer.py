"""The replicas of one stage, and which one takes the next stage call.

grpc-python has no pluggable load-balancing policy and no load reports, so the gateway does it
itself: a stage address is a gRPC target naming replicas (a static `ipv4:a:p,b:p` list, or
`dns:///name:port` re-resolved every DNS_REFRESH_S, off the event loop), each replica gets
its own channel (`shared.server.open_channel`), and each stage call goes to the least-loaded
ready replica. A replica's load is this gateway's own calls open on it plus, from its last
load report (StageControlService.GetStageLoad, polled every POLL_INTERVAL_S with grpc.health),
the requests it holds for other gateways. A replica whose health is NOT_SERVING (draining, or
its engine died), that reports it drains, or that cannot be reached gets nothing new until a
poll finds it serving again. Equal loads take turns.

A replica that serves again (restarted, or new) first gets what was set on its stage at run
time: the `on_back` callbacks (the gateway's runtime LoRA loads, gateway/mesh/runtime_loras.py) are
awaited before the poll marks it SERVING, so a restarted replica takes no request that needs
them before it has them.

The stage call itself (retry of a start the stage refused, accounting of in-flight calls) is
in `mesh.calls.call_stage`; this module gives it `take`/`release`, `connect` and the replicas'
state.
Stubs keep working unchanged: `ReplicaChannel` is a grpc.aio.Channel over a ReplicaSet whose
unary calls go to one replica picked per call, and whose streams are `RoutedStreamStream`,
which `call_stage` routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Self, TypedDict, TypeVar, Unpack

import grpc
from grpc.aio import Metadata
from grpc_health.v1 import health_pb2

from stagemesh.gateway.recipes import StageTarget, TargetKind
from stagemesh.shared.proto.v1 import control_service_pb2, control_service_pb2_grpc
from stagemesh.shared.server import open_channel

log = logging.getLogger(__name__)

#: How often each replica's health and load are read.
POLL_INTERVAL_S = 1.0
#: A health or load poll that takes longer says the replica is unreachable.
POLL_TIMEOUT_S = 2.0
#: How often a `dns:///` target is resolved again (pods come and go).
DNS_REFRESH_S = 5.0
#: The longest a stage call waits for a replica's connection before it tries another.
CONNECT_TIMEOUT_S = 2.0
#: grpc.health.v1 Check, called by name: the stub package's HealthStub declares no methods.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
Resolver = Callable[[str, int], Sequence[str]]
#: Called with the stage address when what answers there may have changed (see StageCatalog).
OnChange = Callable[[str], None]
#: Awaited with the stage address and a replica about to serve again (see `ReplicaSet.on_back`).
OnBack = Callable[[str, "Replica"], Awaitable[None]]


class ReplicaState(enum.Enum):
    """What the last look at a replica found."""

    UNKNOWN = "UNKNOWN"  # not polled yet: routable (the call finds out)
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"  # draining, or its engine stopped
    UNREACHABLE = "UNREACHABLE"


@dataclass(eq=False)
class Replica:
    """One replica of a stage, and what the gateway knows of its load."""

    address: str  # host:port
    channel: grpc.aio.Channel
    index: int = 0  # its position in the target (a static list's order: its metrics port)
    state: ReplicaState = ReplicaState.UNKNOWN
    in_flight: int = 0  # this gateway's stage calls open on it
    others: int = 0  # requests it held for other gateways at its last load report
    turn: int = 0  # when it was last picked (equal loads take turns)
    retired: bool = False  # gone from DNS: nothing new; closed once idle

    @property
    def load(self) -> int:
        return self.in_flight + self.others

    @property
    def routable(self) -> bool:
        """May take a new call: not known to be down, draining or gone."""
        if self.retired or self.state in (ReplicaState.NOT_SERVING, ReplicaState.UNREACHABLE):
            return False
        return self.channel.get_state(try_to_connect=False) not in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def resolve_dns(name: str, port: int) -> list[str]:
    """Every address `name` resolves to, as `host:port` (blocking: run it in a thread)."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host in hosts]


class ReplicaSet:
    """The replicas of one stage address. `start()` opens channels and starts polling;
    `close()` stops and closes them."""

    def __init__(self, stage: str, address: str, target: StageTarget,
                 resolver: Resolver = resolve_dns,
                 poll_interval: float = POLL_INTERVAL_S) -> None:
        self.stage = stage
        self.address = address
        self.target = target
        self._resolver = resolver
        self._poll_interval = poll_interval
        self.replicas: list[Replica] = []
        self._turns = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._watchers: dict[Replica, asyncio.Task[None]] = {}
        self._on_change: list[OnChange] = []
        self._on_back: list[OnBack] = []

    # -- life ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.target.kind is TargetKind.DNS:
            await self._resolve()
            self._tasks.append(asyncio.create_task(self._keep_resolving()))
        else:
            self._set_replicas(self.target.replicas)
        self._tasks.append(asyncio.create_task(self._keep_polling()))

    async def close(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks, self._watchers = [], {}
        replicas, self.replicas = self.replicas, []
        await asyncio.gather(*(replica.channel.close() for replica in replicas))

    def on_change(self, callback: OnChange) -> None:
        """Call `callback(address)` when a replica's connection leaves READY or the replica
        list changes: what answers may be another process, with other options."""
        self._on_change.append(callback)

    def on_back(self, callback: OnBack) -> None:
        """Await `callback(address, replica)` before a replica that was not serving (down,
        draining, unreachable, or not polled yet) is marked SERVING: what was set on the stage
        at run time goes back onto a restarted one. Until every callback has returned the
        replica keeps its state; one that raises leaves it there, and the next poll tries again.
        """
        self._on_back.append(callback)

    async def _welcome(self, replica: Replica) -> bool:
        """Whether every `on_back` callback took the replica (a failure is logged)."""
        for callback in self._on_back:
            try:
                await callback(self.address, replica)
            except (Exception, asyncio.CancelledError) as error:
                # a callback's failure must not stop the polling; nor a call of it cancelled
                # because the replica's channel was closed under it
                if isinstance(error, asyncio.CancelledError) and cancelling():
                    raise
                log.warning("%s replica %s serves, but is kept out until it is set up again: "
                            "%s", self.stage, replica.address, error)
                return False
        return True

    def _changed(self) -> None:
        for callback in self._on_change:
            callback(self.address)

    # -- picking -------------------------------------------------------------------------------

    def pick(self, exclude: Sequence[Replica] = ()) -> Replica | None:
        """The least-loaded routable replica not in `exclude` (equal loads take turns); if
        none is routable, the least-loaded one not excluded and not retired (the call then
        finds out, and reports what the stage says); None if there is none."""
        candidates = [r for r in self.replicas if not r.retired and r not in exclude]
        routable = [r for r in candidates if r.routable] or candidates
        if not routable:
            return None
        chosen = min(routable, key=lambda r: (r.load, r.turn))
        chosen.turn = next(self._turns)
        return chosen

    def take(self, exclude: Sequence[Replica] = ()) -> Replica | None:
        """`pick` for a stage call, counted in flight at once (`release` it when the call
        ends): calls that pick at the same moment and then wait (for a connection) must see
        each other's load, or a burst piles onto the replica that looked idlest."""
        chosen = self.pick(exclude)
        if chosen is not None:
            chosen.in_flight += 1
        return chosen

    def release(self, replica: Replica) -> None:
        """A call `take` counted has ended."""
        replica.in_flight -= 1

    def any_replica(self) -> Replica:
        """A replica for a call that is not a request's work (Describe): the pick, else the
        first one; raises when the target resolved to nothing."""
        replica = self.pick() or next(iter(self.replicas), None)
        if replica is None:
            raise NoReplica(self)
        return replica

    def mark_down(self, replica: Replica) -> None:
        """A call found the replica gone: route around it until a poll finds it serving."""
        if replica.state is not ReplicaState.UNREACHABLE:
            log.warning("%s replica %s is unreachable; routing around it", self.stage,
                        replica.address)
        replica.state = ReplicaState.UNREACHABLE

    def mark_refusing(self, replica: Replica) -> None:
        """The replica refused a start because it drains: nothing new until it serves."""
        replica.state = ReplicaState.NOT_SERVING

    async def connect(self, replica: Replica, timeout: float) -> bool:
        """Whether the replica's channel is READY within `timeout` (False at once when it
        fails to connect): a start is only sent on a live connection, so that a refused
        connection can be retried elsewhere without any doubt that the stage got it."""
        channel = replica.channel
        state = channel.get_state(try_to_connect=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while state is not grpc.ChannelConnectivity.READY:
            left = deadline - loop.time()
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                         grpc.ChannelConnectivity.SHUTDOWN) or left <= 0:
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True

    # -- membership ----------------------------------------------------------------------------

    def _set_replicas(self, addresses: Sequence[str]) -> None:
        """Make the replica list `addresses`: new ones get a channel, gone ones retire."""
        known = {replica.address: replica for replica in self.replicas if not replica.retired}
        for index, address in enumerate(addresses):
            replica = known.pop(address, None)
            if replica is None:
                replica = Replica(address, open_channel(address), index)
                self.replicas.append(replica)
                self._watchers[replica] = asyncio.create_task(self._watch(replica))
                log.info("%s replica %s added", self.stage, address)
            replica.index = index
        for gone in known.values():
            gone.retired = True
            log.info("%s replica %s left the target; it gets nothing new", self.stage,
                     gone.address)
        if known:
            self._changed()

    async def _resolve(self) -> None:
        target = self.target
        try:
            addresses = await asyncio.to_thread(self._resolver, target.dns_name, target.dns_port)
        except OSError as error:
            log.warning("%s: resolving %s failed (%s); keeping %d replicas", self.stage,
                        target.dns_name, error, len(self.replicas))
            return
        self._set_replicas(addresses)

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(DNS_REFRESH_S)
            await self._resolve()
            await self._close_idle_retired()

    async def _close_idle_retired(self) -> None:
        idle = [r for r in self.replicas if r.retired and r.in_flight == 0]
        for replica in idle:
            self.replicas.remove(replica)
            watcher = self._watchers.pop(replica, None)
            if watcher is not None:
                watcher.cancel()
            await replica.channel.close()

    async def _watch(self, replica: Replica) -> None:
        """Tell `on_change` whenever the replica's connection leaves READY."""
        channel = replica.channel
        state = channel.get_state(try_to_connect=False)
        while True:
            await channel.wait_for_state_change(state)
            new_state = channel.get_state(try_to_connect=False)
            if state is grpc.ChannelConnectivity.READY:
                log.info("connection to %s replica %s left READY (%s)", self.stage,
                         replica.address, new_state.name)
                self._changed()
            state = new_state

    # -- polling -------------------------------------------------------------------------------

    async def _keep_polling(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._poll_interval)

    async def poll(self) -> None:
        """Read every replica's health and load once."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas if not r.retired))

    async def _poll(self, replica: Replica) -> None:
        ours = replica.in_flight
        health, load = await asyncio.gather(health_status(replica.channel, POLL_TIMEOUT_S),
                                            _load(replica.channel))
        before = replica.state
        if health is None:
            replica.state = ReplicaState.UNREACHABLE
            self._reconnect_if_failed(replica)
        elif health != health_pb2.HealthCheckResponse.SERVING or (load and load.draining):
            replica.state = ReplicaState.NOT_SERVING
        elif before is ReplicaState.SERVING or await self._welcome(replica):
            replica.state = ReplicaState.SERVING
        if load is not None:
            # The report counts our calls open when the stage wrote it, at most the most we
            # had open during the poll: one that ended meanwhile is nobody else's load.
            replica.others = max(0, load.in_flight - max(ours, replica.in_flight))
        if replica.state is not before and before is not ReplicaState.UNKNOWN:
            log.info("%s replica %s: %s -> %s", self.stage, replica.address, before.value,
                     replica.state.value)

    def _reconnect_if_failed(self, replica: Replica) -> None:
        """A channel in TRANSIENT_FAILURE waits out gRPC's reconnect backoff (it grows to
        minutes); a replica restarted by its supervisor should be found at the next poll, so
        an idle failed channel is replaced by a fresh one."""
        if (replica.in_flight == 0 and replica.channel.get_state(try_to_connect=False)
                is grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            old, replica.channel = replica.channel, open_channel(replica.address)
            watcher = self._watchers.pop(replica, None)
            if watcher is not None:
                watcher.cancel()
            self._watchers[replica] = asyncio.create_task(self._watch(replica))
            self._tasks.append(asyncio.create_task(old.close()))


def cancelling() -> bool:
    """True when the running task is being cancelled, rather than one of its gRPC calls: a
    call on a channel that is closed under it (a replaced replica channel) raises
    CancelledError too, though nobody cancelled the caller."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def health_status(channel: grpc.aio.Channel, timeout: float) -> int | None:
    """The replica's grpc.health status (overall, service ""); None if unreachable, or if its
    channel was closed under the call."""
    check = channel.unary_unary(
        HEALTH_CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    try:
        reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError:
        return None
    except asyncio.CancelledError:
        if cancelling():
            raise
        return None  # the channel was replaced and closed under the call: look again later
    return int(reply.status)


async def _load(channel: grpc.aio.Channel) -> control_service_pb2.GetStageLoadResponse | None:
    """The replica's load report; None if it cannot give one (unreachable, or a stage
    without StageControlService)."""
    stub = control_service_pb2_grpc.StageControlServiceStub(channel)
    try:
        return await stub.GetStageLoad(control_service_pb2.GetStageLoadRequest(),
                                       timeout=POLL_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None
    except asyncio.CancelledError:
        if cancelling():
            raise
        return None  # the channel was closed under the call, as in `health_status`


class NoReplica(Exception):
    """The stage's target names no replica (a DNS name that resolved to nothing)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        super().__init__(f"the {replicas.stage} stage at {replicas.address} has no replica")
        self.replicas = replicas


# -- the channel the stubs are built on ---------------------------------------------------------


class CallOptions(TypedDict, total=False):
    """The keyword options of a grpc.aio call, passed through to the picked replica."""

    timeout: float | None
    metadata: Metadata | Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _Routed(Generic[RequestT, ResponseT]):
    """One RPC method over a ReplicaSet."""

    def __init__(self, replicas: ReplicaSet, method: str,
                 request_serializer: Callable[[RequestT], bytes] | None,
                 response_deserializer: Callable[[bytes], ResponseT] | None) -> None:
        self.replicas = replicas
        self._method = method
        self._serializer = request_serializer
        self._deserializer = response_deserializer


class RoutedStreamStream(_Routed[RequestT, ResponseT],
                         grpc.aio.StreamStreamMultiCallable[RequestT, ResponseT]):
    """A stage stream RPC over a ReplicaSet. `call_stage` routes it (least-loaded replica,
    retry of a refused start); called directly, it goes to one picked replica."""

    def on(self, replica: Replica) -> grpc.aio.StreamStreamMultiCallable[RequestT, ResponseT]:
        """The RPC on one replica's channel."""
        return replica.channel.stream_stream(self._method, self._serializer,
                                             self._deserializer)

    def __call__(
        self,
        request_iterator: AsyncIterator[RequestT] | Iterator[RequestT] | None = None,
        timeout: float | None = None,
        metadata: Metadata | Sequence[tuple[str, str | bytes]] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> grpc.aio.StreamStreamCall[RequestT, ResponseT]:
        return self.on(self.replicas.any_replica())(
            request_iterator, timeout, metadata, credentials, wait_for_ready, compression)


class RoutedUnaryUnary(_Routed[RequestT, ResponseT],
                       grpc.aio.UnaryUnaryMultiCallable[RequestT, ResponseT]):
    """A unary RPC (Describe) over a ReplicaSet: each call goes to one picked replica (every
    replica of a stage runs with the same options, so any one answers for all)."""

    def __call__(self, request: RequestT, **options: Unpack[CallOptions]
                 ) -> grpc.aio.UnaryUnaryCall[RequestT, ResponseT]:
        channel = self.replicas.any_replica().channel
        rpc = channel.unary_unary(self._method, self._serializer, self._deserializer)
        return rpc(request, **options)


class ReplicaChannel(grpc.aio.Channel):
    """A grpc.aio.Channel over the replicas of one stage, for the generated stubs: unary
    calls go to a picked replica, streams are routed by `call_stage`. Its state is the best
    of its replicas' states. Closing it does nothing: the Mesh closes the ReplicaSet."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def unary_unary(self, method: str,
                    request_serializer: Callable[[RequestT], bytes] | None = None,
                    response_deserializer: Callable[[bytes], ResponseT] | None = None,
                    _registered_method: bool | None = False,
                    ) -> RoutedUnaryUnary[RequestT, ResponseT]:
        return RoutedUnaryUnary(self.replicas, method, request_serializer,
                                response_deserializer)

    def stream_stream(self, method: str,
                      request_serializer: Callable[[RequestT], bytes] | None = None,
                      response_deserializer: Callable[[bytes], ResponseT] | None = None,
                      _registered_method: bool | None = False,
                      ) -> RoutedStreamStream[RequestT, ResponseT]:
        return RoutedStreamStream(self.replicas, method, request_serializer,
                                  response_deserializer)

    def unary_stream(self, method: str,
                     request_serializer: Callable[[RequestT], bytes] | None = None,
                     response_deserializer: Callable[[bytes], ResponseT] | None = None,
                     _registered_method: bool | None = False,
                     ) -> grpc.aio.UnaryStreamMultiCallable[RequestT, ResponseT]:
        return self.replicas.any_replica().channel.unary_stream(
            method, request_serializer, response_deserializer)

    def stream_unary(self, method: str,
                     request_serializer: Callable[[RequestT], bytes] | None = None,
                     response_deserializer: Callable[[bytes], ResponseT] | None = None,
                     _registered_method: bool | None = False,
                     ) -> grpc.aio.StreamUnaryMultiCallable[RequestT, ResponseT]:
        return self.replicas.any_replica().channel.stream_unary(
            method, request_serializer, response_deserializer)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        states = [r.channel.get_state(try_to_connect) for r in self.replicas.replicas
                  if not r.retired]
        for best in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.CONNECTING,
                     grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            if best in states:
                return best
        return grpc.ChannelConnectivity.SHUTDOWN

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        while self.get_state() is last_observed_state:
            await asyncio.sleep(0.1)

    async def channel_ready(self) -> None:
        while self.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY:
            await asyncio.sleep(0.05)

    async def close(self, grace: float | None = None) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc_val: BaseException | None, exc_tb: TracebackType | None) -> None:
        return None

