"""The Journal gRPC service: List, Apply, Read, Append, ListFragments (and Replicate).

Request problems are answered the way Gazette answers them: a response Status
(JOURNAL_NOT_FOUND, REGISTER_MISMATCH, ...) when the protocol has one, else a
gRPC INVALID_ARGUMENT naming the field. The server keeps serving either way, and
when the KeySpace fails an Apply too: RESOURCE_EXHAUSTED if it has no room (a full
disk), else UNAVAILABLE, naming the cause (`streamkit.broker.faults.keyspace_fault`).

With authorization on, the server's interceptor has checked each call's
capability and bound its claims (`streamkit.auth.scope`); the servicer then
limits the call to the journals the claims' selector covers, as Gazette's
broker does: List leaves the others out, Read, Append and ListFragments
answer JOURNAL_NOT_FOUND for them (an uncovered journal is indistinguishable
from an absent one), and Apply refuses, naming the journal, a change to a
journal it does not cover, before or after the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

from streamkit.auth.scope import current_claims, journal_allowed, require_journal
from streamkit.broker import metrics
from streamkit.broker.appends import RolledBack, append, refusal
from streamkit.broker.faults import JournalFault, keyspace_fault
from streamkit.broker.journals import ApplyConflict, JournalRegistry
from streamkit.broker.pace import DEFAULT_MIN_APPEND_RATE, AppendPace
from streamkit.broker.reads import ReadStream
from streamkit.broker.replica import Replica
from streamkit.errors import StreamkitError
from streamkit.keyspace import KeySpaceError
from streamkit.protocol import pb, pb_grpc
from streamkit.protocol.apply import check_apply_changes
from streamkit.protocol.journal_names import journal_name_problem
from streamkit.protocol.labels import matches, validate_label_set, validate_selector

log = logging.getLogger(__name__)
T = TypeVar("T")

LIST_CHUNK = 25  # journals per ListResponse message, as Gazette sends them
MAX_FRAGMENTS_PAGE = 10_000
DEFAULT_FRAGMENTS_PAGE = 1_000
APPEND_CHUNK_TIMEOUT = 30.0  # default: a stalled appender holding the journal is rolled back
# What gRPC raises when a response cannot be sent because the peer left the call (a
# reader killed mid-stream). It is gRPC's own class; where a version lacks it, nothing
# is caught and such a failure is logged as before.
_WRITE_FAILED: type[BaseException] | tuple[()] = getattr(
    grpc._cython.cygrpc, "ExecuteBatchError", ())


class BadRequest(StreamkitError, ValueError):
    """A malformed request; answered with INVALID_ARGUMENT."""


def check_journal_name(name: str, field: str = "journal") -> None:
    """Raise BadRequest naming the field when `name` is not a valid journal name."""
    problem = journal_name_problem(name)
    if problem:
        raise BadRequest(f"{field}: {problem}")


@dataclass
class Identity:
    """Who this broker is, for response headers and routes."""

    zone: str
    suffix: str
    endpoint: str

    def header(self, revision: int) -> pb.Header:
        member = pb.ProcessSpec.ID(zone=self.zone, suffix=self.suffix)
        return pb.Header(
            process_id=member,
            route=self.route(),
            # Etcd revisions start at 1; an empty KeySpace (revision 0) reads as its first.
            etcd=pb.Header.Etcd(cluster_id=1, member_id=1, revision=max(revision, 1),
                                raft_term=1),
        )

    def route(self) -> pb.Route:
        member = pb.ProcessSpec.ID(zone=self.zone, suffix=self.suffix)
        return pb.Route(members=[member], primary=0, endpoints=[self.endpoint])


def _is_readable(spec: pb.JournalSpec) -> bool:
    return spec.flags != pb.JournalSpec.O_WRONLY


def _named(selector: pb.LabelSelector) -> list[str] | None:
    """The journals a selector names outright (`name=a`, `name in (a, b)`), sorted; None if
    it does not. A List then looks only at those, not at every journal of the broker (a
    member's deploy lists its app's journals by name)."""
    names = [label for label in selector.include.labels if label.name == "name"]
    if not names or any(label.prefix or not label.value for label in names):
        return None
    return sorted({label.value for label in names})


class JournalService(pb_grpc.JournalServicer):
    """Serves the Journal API from a JournalRegistry."""

    def __init__(
        self,
        registry: JournalRegistry,
        identity: Identity,
        append_timeout: float = APPEND_CHUNK_TIMEOUT,
        min_append_rate: float = DEFAULT_MIN_APPEND_RATE,
    ) -> None:
        self.registry = registry
        self.identity = identity
        self.append_timeout = append_timeout  # longest wait for an appender's next chunk
        self.min_append_rate = min_append_rate  # bytes/s an appender must keep up (0: any)
        self._appends: dict[asyncio.Task, _Received] = {}  # Appends in flight
        self._stopping = False

    def stop_appends(self) -> None:
        """The broker is stopping: roll back the appends still waiting for the journal or
        for their content, which then end UNAVAILABLE (a retry goes to the broker that
        comes back; gRPC's own cancel at the end of its grace would say CANCELLED, which
        clients take as final). Appends whose content is all in commit and answer."""
        self._stopping = True
        for task, received in self._appends.items():
            if not received.all:
                task.cancel("the broker is stopping")

    def pace(self) -> AppendPace:
        return AppendPace(self.min_append_rate, self.append_timeout)

    def header(self) -> pb.Header:
        return self.identity.header(self.registry.revision)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, err: Exception) -> None:
        metrics.RPC_ERRORS.labels(method, "INVALID_ARGUMENT").inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def _fault(self, context: grpc.aio.ServicerContext, method: str,
                     fault: JournalFault) -> NoReturn:
        """End the RPC with the fault's status; the journal's problem is logged once, where
        it arose, not for each request it fails."""
        metrics.RPC_ERRORS.labels(method, fault.grpc_code.name).inc()
        await context.abort(fault.grpc_code, str(fault))
        raise AssertionError("unreachable: abort raises")

    async def _check(
        self, context: grpc.aio.ServicerContext, method: str, validate: Callable[[T], None],
        request: T,
    ) -> None:
        """Validate a request; a problem (any ValueError: BadRequest, SpecError,
        SelectorError) aborts the RPC with INVALID_ARGUMENT and its message."""
        try:
            validate(request)
        except ValueError as err:
            await self._abort(context, method, err)

    # --- List -------------------------------------------------------------

    async def List(self, request: pb.ListRequest, context) -> AsyncIterator[pb.ListResponse]:
        await self._check(context, "List", validate_selector, request.selector)
        while True:
            changed = self.registry.changed()
            for response in self._list_snapshot(request.selector, request.watch):
                yield response
            if not request.watch:
                return
            yield pb.ListResponse(status=pb.OK, header=self.header())  # ends the snapshot
            await changed.wait()

    def _list_snapshot(self, selector: pb.LabelSelector, watch: bool) -> list[pb.ListResponse]:
        """A listing in chunks. A plain List always answers at least one message; under
        watch an empty snapshot is just its empty terminator, so the two can't be confused."""
        selected = []
        claims = current_claims()
        entries = self.registry.entries
        named = _named(selector)
        for name in sorted(entries) if named is None else [n for n in named if n in entries]:
            entry = entries[name]
            labels = entry.selectable()
            if matches(selector, labels) and (claims is None or claims.covers(labels)):
                selected.append(
                    pb.ListResponse.Journal(
                        spec=entry.spec,
                        mod_revision=entry.mod_revision,
                        create_revision=entry.create_revision,
                        route=self.identity.route(),
                    )
                )
        chunks = [selected[i : i + LIST_CHUNK] for i in range(0, len(selected), LIST_CHUNK)]
        return [
            pb.ListResponse(status=pb.OK, header=self.header(), journals=chunk)
            for chunk in chunks or ([] if watch else [[]])
        ]

    # --- Apply ------------------------------------------------------------

    async def Apply(self, request: pb.ApplyRequest, context) -> pb.ApplyResponse:
        await self._check(context, "Apply", _validate_changes, request.changes)
        self._require_changes(request.changes)
        await self._check(context, "Apply", self.registry.check_servable, list(request.changes))
        try:
            await self.registry.apply(list(request.changes))
        except ApplyConflict:
            return pb.ApplyResponse(status=pb.ETCD_TRANSACTION_FAILED, header=self.header())
        except KeySpaceError as error:  # a full disk, say: the RPC fails, the broker serves on
            fault = keyspace_fault(f"Apply of {len(request.changes)} journal spec change(s)",
                                   error)
            log.warning("%s", fault)  # one line: the cause is in it, a traceback adds nothing
            metrics.RPC_ERRORS.labels("Apply", fault.grpc_code.name).inc()
            await context.abort(fault.grpc_code, str(fault))
        return pb.ApplyResponse(status=pb.OK, header=self.header())

    def _require_changes(self, changes: Sequence[pb.ApplyRequest.Change]) -> None:
        """Raise PermissionDenied (the interceptor answers PERMISSION_DENIED) unless the
        claims cover each journal as it is and as it would be: checking the new labels
        alone would let a token relabel another's journal into its own selector."""
        if current_claims() is None:
            return
        for change in changes:
            name = change.upsert.name if change.HasField("upsert") else change.delete
            if change.HasField("upsert"):
                require_journal(name, change.upsert.labels)
            entry = self.registry.entries.get(name)
            if entry is not None:
                require_journal(name, entry.spec.labels)
            elif not change.HasField("upsert"):
                require_journal(name)

    # --- Read -------------------------------------------------------------

    async def Read(self, request: pb.ReadRequest, context) -> None:
        # Responses are written, not yielded: a reader gone mid-stream then ends the call
        # quietly (a yielded response gRPC cannot send is logged as an error, traceback
        # and all).
        await self._check(context, "Read", _validate_read, request)
        try:
            replica = _visible(await self.registry.replica(request.journal), request.journal)
        except JournalFault as fault:
            await self._fault(context, "Read", fault)
        if replica is None:
            await _send(context, pb.ReadResponse(status=pb.JOURNAL_NOT_FOUND, header=self.header()))
            return
        if not _is_readable(replica.spec):
            await _send(context, pb.ReadResponse(status=pb.NOT_ALLOWED, header=self.header()))
            return
        metrics.READS_OPEN.inc()
        try:
            responses = ReadStream(replica, request, self.header()).responses()
            async with contextlib.aclosing(responses):
                async for response in responses:
                    if not await _send(context, response):
                        return
        except JournalFault as fault:  # the read can't go on: it ends, saying why
            await self._fault(context, "Read", fault)
        finally:
            metrics.READS_OPEN.dec()

    # --- Append -----------------------------------------------------------

    async def Append(self, request_iterator, context) -> pb.AppendResponse:
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            await self._abort(context, "Append", BadRequest("Append stream ended before a request"))
        await self._check(context, "Append", _validate_append, first)
        try:
            replica = _visible(await self.registry.replica(first.journal), first.journal)
            status = refusal(replica)
            if status is not None:
                metrics.APPEND_FAILURES.labels(pb.Status.Name(status)).inc()
                return pb.AppendResponse(status=status, header=self.header())
            assert replica is not None
            received = _Received()
            content = _content(first, request_iterator, self.pace(), received)
            task = asyncio.current_task()
            assert task is not None
            self._appends[task] = received
            try:
                return await append(replica, first, content, self.header())
            except asyncio.CancelledError:
                if not self._stopping or received.all:
                    raise
                task.uncancel()
                metrics.APPEND_FAILURES.labels("BrokerStopping").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"append to {first.journal} rolled back: the broker is "
                                    "stopping (retry it)")
            finally:
                del self._appends[task]
        except JournalFault as fault:
            await self._fault(context, "Append", fault)
        except BadRequest as err:
            await self._abort(context, "Append", err)
        except TimeoutError as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        except RolledBack as err:
            await context.abort(grpc.StatusCode.CANCELLED, str(err))

    # --- ListFragments ------------------------------------------------------

    async def ListFragments(self, request: pb.FragmentsRequest, context) -> pb.FragmentsResponse:
        await self._check(context, "ListFragments", _validate_fragments, request)
        try:
            replica = _visible(await self.registry.replica(request.journal), request.journal)
        except JournalFault as fault:
            await self._fault(context, "ListFragments", fault)
        if replica is None:
            return pb.FragmentsResponse(status=pb.JOURNAL_NOT_FOUND, header=self.header())
        limit = request.page_limit or DEFAULT_FRAGMENTS_PAGE
        ttl = request.signatureTTL.ToTimedelta() if request.HasField("signatureTTL") else None
        page, next_token = [], 0
        stores = {store.url: store for store in replica.stores}
        for fragment in replica.index.fragments():
            if fragment.begin < request.next_page_token or not _in_window(fragment, request):
                continue
            if len(page) == limit:
                next_token = fragment.begin
                break
            url = ""
            store = stores.get(fragment.backing_store)
            if ttl is not None and store is not None:
                url = await store.signed_url(fragment, ttl)
            page.append(pb.FragmentsResponse._Fragment(spec=fragment, signed_url=url))
        return pb.FragmentsResponse(
            status=pb.OK, header=self.header(), fragments=page, next_page_token=next_token
        )

    async def Replicate(self, request_iterator, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "the bundled broker is single-node; run Gazette's brokers for replication",
        )


async def _send(context, response: pb.ReadResponse) -> bool:
    """Write a Read's `response`; False if the reader is gone (gRPC could not send it)."""
    try:
        await context.write(response)
    except _WRITE_FAILED:
        return False
    return True


def _visible(replica: Replica | None, journal: str) -> Replica | None:
    """`replica`, or None if the request's claims do not cover it (it is then absent)."""
    if replica is None or journal_allowed(journal, replica.spec.labels):
        return replica
    return None


async def _next_chunk(requests, pace: AppendPace, journal: str) -> pb.AppendRequest:
    """The next AppendRequest, within the appender's pace (see streamkit.broker.pace).

    asyncio.timeout (not wait_for, which starts a task per call) and only around
    the receive, never around a yield to the consumer.
    """
    try:
        async with asyncio.timeout(pace.next_timeout()):
            return await anext(requests)
    except TimeoutError:
        raise pace.timed_out(journal) from None


@dataclass
class _Received:
    """Whether an Append's content came in whole (its commit chunk): from then on the append
    commits and answers, however the broker is stopping."""

    all: bool = False


async def _content(
    first: pb.AppendRequest, requests, pace: AppendPace, received: _Received
) -> AsyncIterator[bytes]:
    """Content chunks of an Append stream; raises RolledBack if it ends without commit."""
    while True:
        try:
            request = await _next_chunk(requests, pace, first.journal)
        except StopAsyncIteration:
            raise RolledBack("Append stream ended without its commit (empty) chunk") from None
        if (request.journal or request.offset or request.HasField("check_registers")
                or request.HasField("union_registers")
                or request.HasField("subtract_registers")):
            raise BadRequest("Append: only the first AppendRequest may carry parameters")
        if not request.content:
            received.all = True
            break
        pace.got(len(request.content))
        yield request.content
    try:
        await _next_chunk(requests, pace, first.journal)
    except StopAsyncIteration:
        return
    raise BadRequest("Append: content followed the commit (empty) chunk")


def _in_window(fragment: pb.Fragment, request: pb.FragmentsRequest) -> bool:
    """Mod-time filter; local spools count as modified now."""
    mod_time = fragment.mod_time or int(time.time())
    if request.begin_mod_time and mod_time < request.begin_mod_time:
        return False
    return not (request.end_mod_time and mod_time >= request.end_mod_time)


def _validate_changes(changes: Sequence[pb.ApplyRequest.Change]) -> None:
    check_apply_changes(changes, "journal", _upserted, check_journal_name, BadRequest)


def _upserted(spec: pb.JournalSpec) -> str:
    from streamkit.protocol.spec import validate_proto  # (pydantic: see Broker.start)

    validate_proto(spec)
    return spec.name


def _validate_read(request: pb.ReadRequest) -> None:
    check_journal_name(request.journal)
    if request.offset < -1:
        raise BadRequest(f"Read {request.journal}: offset must be >= -1 (got {request.offset})")
    if request.end_offset < 0 or (request.end_offset and request.end_offset < request.offset):
        raise BadRequest(
            f"Read {request.journal}: end_offset {request.end_offset} precedes offset "
            f"{request.offset}"
        )


def _validate_append(request: pb.AppendRequest) -> None:
    """The first AppendRequest, checked as Gazette checks it."""
    check_journal_name(request.journal)
    if request.offset < 0:
        raise BadRequest(f"Append {request.journal}: offset must be >= 0 (got {request.offset})")
    if request.content:
        raise BadRequest(f"Append {request.journal}: the first AppendRequest carries no "
                         "content (send it in the requests that follow)")
    if request.HasField("check_registers"):
        validate_selector(request.check_registers)
    for field in ("union_registers", "subtract_registers"):
        if request.HasField(field):
            try:
                validate_label_set(getattr(request, field))
            except ValueError as err:
                raise BadRequest(f"Append {request.journal}: {field}: {err}") from None


def _validate_fragments(request: pb.FragmentsRequest) -> None:
    check_journal_name(request.journal)
    if not 0 <= request.page_limit <= MAX_FRAGMENTS_PAGE:
        raise BadRequest(f"ListFragments: page_limit must be 0..{MAX_FRAGMENTS_PAGE}")
    if request.end_mod_time and request.end_mod_time < request.begin_mod_time:
        raise BadRequest("ListFragments: end_mod_time precedes begin_mod_time")
