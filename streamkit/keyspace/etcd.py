"""The etcd KeySpace: cluster state in an etcd (3.5) cluster, for members on many machines.

The interface maps one to one onto etcd's v3 API, so revisions, versions and
lease ids are etcd's own (a new etcd starts at revision 1, not 0):

* `get`, `range` and `revision` are one linearizable Range each; `range`
  returns etcd's header revision, so "range, then watch from its revision"
  misses nothing;
* `txn` is one etcd Txn (compares on mod/create revision, version or value;
  puts and range deletes), so etcd's limits apply: at most 128 compares and
  128 ops per branch (`--max-txn-ops`), 1.5 MiB per request;
* `watch` is one Watch stream per call. etcd never splits a revision across
  responses (fragmenting is not requested), so each response is one batch;
* leases are etcd leases, which count whole seconds: `grant` rounds its TTL
  up to the next second (at least 1), and etcd raises it further to its own
  minimum, 1.5 election timeouts rounded up (2 s with default settings). The
  leader checks expiry twice a second, so keys may outlive a lapsed lease by
  up to about half a second.

Every key is stored under the URL's prefix (`etcd://host:port/myapp/` puts
`members/a` at `myapp/members/a`), so several apps or tests can share one
etcd; end a non-empty prefix with "/" so that no prefix is the start of
another's keys.

Riding out an etcd restart or leader change: a call that finds no endpoint
reachable retries with backoff (rotating through the endpoints) for
`retry_timeout` seconds, then raises KeySpaceError naming the endpoints. A
request that may already have reached etcd when its connection broke is
retried only if that is harmless (reads, keepalive, revoke, grant: an extra
lease expires by itself); a `txn` in that position raises KeySpaceError
saying its outcome is unknown, as etcd's own Go client does, because a blind
retry could apply it twice or report a create it made as lost. A watch
reconnects by itself, resuming after the last revision it delivered (or that
etcd reported progress to), and raises CompactedError if that history is
gone by then.

An etcd whose data was wiped (or restored from a backup, or another cluster at
the same address) is no etcd to ride out: it starts again from revision 1,
often under the same cluster id, and a watch resuming after its last revision
would wait there in silence. Every response's header is checked: a cluster id
other than the first one seen, or a linearizable answer (a read, a txn, a
lease grant or revoke) at a revision below one seen before it was asked,
makes this call and every later one raise ClusterChangedError, which tells
the process to restart. A reconnected watch whose etcd member reports an
older revision asks for a linearizable one first (a member of a healthy
cluster may just lag behind the others). Revisions alone cannot tell a wiped
etcd that got past the revisions this client saw before it asked again; a
cluster id that changed still tells.

It talks to etcd through `aetcd`'s generated etcd v3 API (`aetcd.rpc`) on
gRPC channels of its own rather than through `aetcd.Client`, which dials a
single endpoint, does not retry, and whose watcher does not resume after a
disconnect. aetcd is imported only when an instance is created, so the
SQLite backend never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import grpc

from streamkit.keyspace.keyspace import (
    ClusterChangedError,
    CompactedError,
    Compare,
    Delete,
    DeletePrefix,
    Event,
    KeySpace,
    KeySpaceError,
    KeySpaceURLError,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    TxnResult,
)

T = TypeVar("T")

URL_FORM = "etcd://host:port[,host:port...]/prefix"
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")

# Our pause between retries doubles from the first to the last value.
_BACKOFF = (0.05, 1.0)

# How gRPC words a call that failed before it was sent: no endpoint was reachable.
_NOT_SENT = ("failed to connect to all addresses", "DNS resolution failed", "empty address list")

# Failures after which a request that was sent may or may not have been applied.
_UNCERTAIN = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)

_CHANNEL_OPTIONS = [
    # Reconnect soon after etcd comes back (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a dead peer under an idle watch. etcd refuses pings more often than
    # every 5 s, and pings without an open stream (--grpc-keepalive-min-time).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # etcd answers a range with everything it matches.
    ("grpc.max_receive_message_length", -1),
]


def parse_url(url: str) -> tuple[list[str], str]:
    """The endpoints and key prefix of an `etcd://host:port[,host:port...]/prefix` URL."""
    hosts, _, prefix = url.removeprefix("etcd://").partition("/")
    endpoints = hosts.split(",")
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        valid = _HOST.fullmatch(host) and port.isdigit() and 0 < int(port) < 65536
        if not (valid and url.startswith("etcd://")):
            raise KeySpaceURLError(f"invalid etcd URL {url!r}: expected {URL_FORM}")
    return endpoints, prefix


def _prefix_end(start: bytes) -> bytes:
    """etcd's range_end selecting every key that starts with `start` (b"\\0": no bound)."""
    stem = start.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else b"\0"


def _aetcd_rpc() -> ModuleType:
    try:
        from aetcd import rpc
    except ImportError as e:  # pragma: no cover - aetcd is a dependency
        raise KeySpaceError("the etcd keyspace needs the aetcd package (pip install aetcd)") from e
    return rpc


@dataclass(frozen=True, slots=True)
class _Stubs:
    """The etcd services on one endpoint's channel."""

    kv: Any
    watch: Any
    lease: Any


class _Backoff:
    """Bounded retrying: `pause` sleeps a growing delay, or raises once the budget is spent.

    The budget runs from `start`, or from the first `pause` if not started.
    """

    def __init__(self, budget: float, endpoints: str) -> None:
        self._budget = budget
        self._endpoints = endpoints
        self.reset()

    def reset(self) -> None:
        self._deadline: float | None = None
        self._delay = _BACKOFF[0]

    def start(self) -> _Backoff:
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._budget
        return self

    def remaining(self) -> float:
        if self._deadline is None:
            return self._budget
        return max(self._deadline - asyncio.get_running_loop().time(), 0.01)

    async def pause(self, reason: str) -> None:
        self.start()
        assert self._deadline is not None
        if asyncio.get_running_loop().time() + self._delay > self._deadline:
            raise KeySpaceError(
                f"etcd at {self._endpoints} unavailable for {self._budget:g}s: {reason}"
            )
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, _BACKOFF[1])


class EtcdKeySpace(KeySpace):
    """A KeySpace in etcd, under a key prefix (see the module docstring).

    Creating one connects nothing: channels open on first use, in the event
    loop that uses them, and an unreachable etcd surfaces as KeySpaceError
    from that first call, after `retry_timeout` seconds of retrying.
    """

    def __init__(
        self, endpoints: Sequence[str], prefix: str = "", *, retry_timeout: float = 10.0
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._rpc = _aetcd_rpc()
        self._endpoints = list(endpoints)
        self._prefix = prefix
        self._namespace = prefix.encode()
        self._retry_timeout = retry_timeout
        self._channels: list[grpc.aio.Channel] = []
        self._stubs_by_endpoint: list[_Stubs] = []
        self._current = 0
        self._closed = False
        self._cluster_id = 0  # etcd's id of the cluster that first answered (0: none yet)
        self._high = 0  # the highest revision etcd reported: a cluster's never goes back
        self._replaced: str | None = None  # why etcd is no longer that cluster, once seen

    @classmethod
    def from_url(cls, url: str, **options: float) -> EtcdKeySpace:
        endpoints, prefix = parse_url(url)
        return cls(endpoints, prefix, **options)

    def reopen(self) -> EtcdKeySpace:
        return EtcdKeySpace(self._endpoints, self._prefix, retry_timeout=self._retry_timeout)

    @property
    def url(self) -> str:
        return f"etcd://{','.join(self._endpoints)}/{self._prefix}"

    def __repr__(self) -> str:
        return f"EtcdKeySpace({self.url!r})"

    # -- plumbing ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KeySpaceError(f"keyspace {self.url} is closed")
        if self._replaced is not None:
            raise ClusterChangedError(self._replaced)

    def _check_cluster(self, header: Any, floor: int = 0) -> None:
        """Fail for good if `header` comes from another cluster, or is below `floor`: etcd
        was wiped or replaced, and the revisions that watches resume from and compares name
        mean nothing there. (A wiped etcd restarted with the same configuration keeps its
        cluster id, hence both tests.) `floor` is what `_high` was when a linearizable
        request was sent, not now: answers to concurrent requests arrive in any order."""
        if not header.cluster_id:  # an empty header (etcd's grpc-proxy sends some): no news
            return
        self._cluster_id = self._cluster_id or header.cluster_id
        if header.cluster_id != self._cluster_id:
            why = f"cluster id {header.cluster_id:x}, not {self._cluster_id:x}"
        elif header.revision < floor:
            why = f"its revision went back from {floor} to {header.revision}"
        else:
            self._high = max(self._high, header.revision)
            return
        self._replaced = (
            f"etcd at {','.join(self._endpoints)} is a different cluster ({why}; its data "
            "was wiped or replaced): restart this process"
        )
        raise ClusterChangedError(self._replaced)

    def _raise_if_closed(self) -> None:
        """Turn the CancelledError that `close` causes in running calls into KeySpaceError."""
        task = asyncio.current_task()
        if self._closed and task is not None and not task.cancelling():
            raise KeySpaceError(f"keyspace {self.url} is closed")

    def _stubs(self) -> _Stubs:
        """The current endpoint's services, opening the channels on first use."""
        self._check_open()
        if not self._channels:
            self._channels = [
                grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
                for endpoint in self._endpoints
            ]
            rpc = self._rpc
            self._stubs_by_endpoint = [
                _Stubs(rpc.KVStub(ch), rpc.WatchStub(ch), rpc.LeaseStub(ch))
                for ch in self._channels
            ]
        return self._stubs_by_endpoint[self._current]

    def _backoff(self) -> _Backoff:
        return _Backoff(self._retry_timeout, ",".join(self._endpoints))

    def _next_endpoint(self) -> None:
        self._current = (self._current + 1) % len(self._endpoints)

    async def _call(
        self,
        what: str,
        attempt: Callable[[_Stubs, float], Awaitable[T]],
        *,
        idempotent: bool = True,
        linearizable: bool = True,
    ) -> T:
        """Run `attempt(stubs, timeout)`, retrying while etcd is unreachable (module docs),
        and check the header of its response (`_check_cluster`)."""
        backoff = self._backoff().start()
        while True:
            floor = self._high if linearizable else 0
            try:
                response = await attempt(self._stubs(), backoff.remaining())
                if (header := getattr(response, "header", None)) is not None:
                    self._check_cluster(header, floor)
                return response
            except asyncio.CancelledError:
                self._raise_if_closed()
                raise
            except grpc.aio.AioRpcError as e:
                error = e
            code, details = error.code(), error.details() or ""
            maybe_applied = (
                not idempotent and code in _UNCERTAIN and not details.startswith(_NOT_SENT)
            )
            if code == grpc.StatusCode.UNAVAILABLE and not maybe_applied:
                self._next_endpoint()
                await backoff.pause(details)
                continue
            raise self._error(what, error, maybe_applied)

    def _error(self, what: str, error: grpc.aio.AioRpcError, maybe_applied: bool) -> KeySpaceError:
        code, details = error.code(), error.details()
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (details or ""):
            return LeaseNotFoundError(f"{details} (expired or revoked?)")
        where = f"etcd at {','.join(self._endpoints)}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"{where} did not answer {what} within {self._retry_timeout:g}s"
        else:
            message = f"{where} failed {what}: {code.name} {details}"
        if maybe_applied:
            message += "; it may or may not have been applied"
        return KeySpaceError(message)

    def _key(self, key: str) -> bytes:
        return self._namespace + key.encode()

    def _span(self, prefix: str) -> tuple[bytes, bytes]:
        """etcd's (key, range_end) for every key under `prefix`."""
        start = self._key(prefix)
        return (start, _prefix_end(start)) if start else (b"\0", b"\0")

    def _kv(self, kv: Any) -> KeyValue:
        key = kv.key[len(self._namespace) :].decode()
        return KeyValue(key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)

    def _event(self, event: Any) -> Event:
        if event.type == self._rpc.Event.DELETE:
            key = event.kv.key[len(self._namespace) :].decode()
            revision = event.kv.mod_revision
            return Event("delete", KeyValue(key, b"", 0, revision, 0, 0), revision)
        return Event("put", self._kv(event.kv), event.kv.mod_revision)

    async def _range(self, what: str, **request: Any) -> Any:
        message = self._rpc.RangeRequest(**request)
        return await self._call(what, lambda s, timeout: s.kv.Range(message, timeout=timeout))

    # -- KeySpace -----------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        response = await self._range("get", key=self._key(key))
        return self._kv(response.kvs[0]) if response.kvs else None

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        start, end = self._span(prefix)
        response = await self._range("range", key=start, range_end=end)
        return [self._kv(kv) for kv in response.kvs], response.header.revision

    async def revision(self) -> int:
        response = await self._range("revision", key=self._span("")[0], count_only=True)
        return int(response.header.revision)

    def _compare(self, compare: Compare) -> Any:
        rpc = self._rpc
        fields: dict[str, Any] = {"key": self._key(compare.key), "result": rpc.Compare.EQUAL}
        if compare.value is not None:
            fields.update(target=rpc.Compare.VALUE, value=compare.value)
        elif compare.mod_revision is not None:
            fields.update(target=rpc.Compare.MOD, mod_revision=compare.mod_revision)
        elif compare.create_revision is not None:
            fields.update(target=rpc.Compare.CREATE, create_revision=compare.create_revision)
        else:
            fields.update(target=rpc.Compare.VERSION, version=compare.version)
        return rpc.Compare(**fields)

    def _op(self, op: Op) -> Any:
        rpc = self._rpc
        match op:
            case Put(key, value, lease):
                put = rpc.PutRequest(key=self._key(key), value=value, lease=lease)
                return rpc.RequestOp(request_put=put)
            case Delete(key):
                delete = rpc.DeleteRangeRequest(key=self._key(key))
            case DeletePrefix(prefix):
                start, end = self._span(prefix)
                delete = rpc.DeleteRangeRequest(key=start, range_end=end)
            case _:
                raise TypeError(f"not a KeySpace op: {op!r}")
        return rpc.RequestOp(request_delete_range=delete)

    async def _txn(
        self, compares: Sequence[Compare], on_success: Sequence[Op], on_failure: Sequence[Op]
    ) -> TxnResult:
        """Note: a caller cancelled while the request is out does not stop it from committing."""
        request = self._rpc.TxnRequest(
            compare=[self._compare(c) for c in compares],
            success=[self._op(op) for op in on_success],
            failure=[self._op(op) for op in on_failure],
        )
        response = await self._call(
            "txn", lambda s, timeout: s.kv.Txn(request, timeout=timeout), idempotent=False
        )
        return TxnResult(response.succeeded, response.header.revision)

    async def watch(self, prefix: str, from_revision: int) -> AsyncIterator[list[Event]]:
        self._check_open()
        start, end = self._span(prefix)
        position = from_revision  # everything up to here is delivered
        backoff = self._backoff()
        while True:
            create = self._rpc.WatchCreateRequest(
                key=start, range_end=end, start_revision=position + 1, progress_notify=True
            )
            call = self._stubs().watch.Watch()
            floor = self._high
            try:
                await call.write(self._rpc.WatchRequest(create_request=create))
                while (response := await call.read()) is not grpc.aio.EOF:
                    # A member behind the others answers with its own (lower) revision.
                    self._check_cluster(response.header)
                    if response.compact_revision:
                        raise CompactedError(position, response.compact_revision)
                    if response.canceled:
                        raise KeySpaceError(
                            f"etcd canceled the watch of {prefix!r}: {response.cancel_reason}"
                        )
                    if response.created:
                        backoff.reset()
                        if response.header.revision < floor:  # a member behind, or wiped?
                            await self.revision()  # linearizable: raises if wiped
                    elif response.events:
                        events = [self._event(e) for e in response.events]
                        position = events[-1].revision
                        yield events
                    else:  # a progress notification: nothing more up to its revision
                        position = max(position, response.header.revision)
                reason = "etcd ended the watch stream"  # not expected: reconnect all the same
            except asyncio.CancelledError:
                self._raise_if_closed()
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._error("watch", e, maybe_applied=False) from e
                reason = e.details() or "UNAVAILABLE"
            finally:
                call.cancel()
            self._next_endpoint()
            await backoff.pause(reason)

    async def grant(self, ttl_seconds: float) -> int:
        """Create a lease of `ttl_seconds` rounded up to whole seconds (etcd's unit)."""
        if ttl_seconds <= 0:
            raise ValueError("lease TTL must be positive")
        request = self._rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl_seconds)))
        response = await self._call(
            "grant", lambda s, timeout: s.lease.LeaseGrant(request, timeout=timeout)
        )
        if response.error:
            raise KeySpaceError(f"etcd refused a lease: {response.error}")
        return int(response.ID)

    async def keepalive(self, lease_id: int) -> bool:
        request = self._rpc.LeaseKeepAliveRequest(ID=lease_id)

        async def once(stubs: _Stubs, timeout: float) -> Any:
            call = stubs.lease.LeaseKeepAlive(timeout=timeout)
            try:
                await call.write(request)
                return await call.read()
            finally:
                call.cancel()

        # Answered by the leader from its applied state, which a follower's may be ahead of.
        response = await self._call("keepalive", once, linearizable=False)
        return response is not grpc.aio.EOF and response.TTL > 0

    async def revoke(self, lease_id: int) -> None:
        request = self._rpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(LeaseNotFoundError):  # already gone
            await self._call(
                "revoke", lambda s, timeout: s.lease.LeaseRevoke(request, timeout=timeout)
            )

    async def close(self) -> None:
        """Close the channels; running calls and waiting watches then raise KeySpaceError."""
        if self._closed:
            return
        self._closed = True
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()
