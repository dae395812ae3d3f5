"""Client-side errors: broker statuses as exceptions, offset jumps, and which failures to retry.

Brokers report most request problems as a `pb.Status` inside an otherwise
successful RPC; the client turns every non-OK status into a `BrokerError`
subclass so callers can catch the ones they expect. A call that fails without
the broker's answer (refused, reset, timed out) raises a `TransportError` --
`BrokerUnavailable` when a retry may overcome it -- with gRPC's own error kept
as its cause, so that gRPC's types never reach an application's `except`
clauses. Inside the client, retry loops see gRPC's errors first;
`is_transient` says whether retrying either kind is sound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from typing import ClassVar

import grpc

from streamkit.errors import StreamkitError
from streamkit.protocol import pb

__all__ = [
    "Backoff",
    "BrokerError",
    "BrokerUnavailable",
    "EtcdTransactionFailed",
    "FragmentError",
    "JournalNotFound",
    "NotAllowed",
    "OffsetJump",
    "OffsetNotYetAvailable",
    "ProtocolError",
    "RegisterMismatch",
    "TransportError",
    "WrongAppendOffset",
    "broker_error",
    "check_status",
    "describe",
    "is_transient",
    "rpc_failure",
    "translating_rpc_errors",
]


class BrokerError(StreamkitError):
    """A broker answered with a non-OK status; `name` is its pb.Status name."""

    STATUS: ClassVar[int] = -1

    def __init__(self, status: int | None = None, detail: str = "") -> None:
        self.status = self.STATUS if status is None else status
        try:
            self.name = pb.Status.Name(self.status)
        except ValueError:
            self.name = f"STATUS_{self.status}"
        self.detail = detail
        super().__init__(f"{self.name}: {detail}" if detail else self.name)


class JournalNotFound(BrokerError):
    STATUS = pb.JOURNAL_NOT_FOUND


class OffsetNotYetAvailable(BrokerError):
    """A non-blocking read reached the write head."""

    STATUS = pb.OFFSET_NOT_YET_AVAILABLE


class RegisterMismatch(BrokerError):
    STATUS = pb.REGISTER_MISMATCH


class WrongAppendOffset(BrokerError):
    STATUS = pb.WRONG_APPEND_OFFSET


class NotAllowed(BrokerError):
    STATUS = pb.NOT_ALLOWED


class EtcdTransactionFailed(BrokerError):
    """An Apply change's expected mod revision was stale."""

    STATUS = pb.ETCD_TRANSACTION_FAILED


_BY_STATUS: dict[int, type[BrokerError]] = {
    cls.STATUS: cls
    for cls in (
        JournalNotFound,
        OffsetNotYetAvailable,
        RegisterMismatch,
        WrongAppendOffset,
        NotAllowed,
        EtcdTransactionFailed,
    )
}

# Statuses that mean "ask again, perhaps elsewhere": the journal's topology is
# changing, not the request being wrong. Gazette's clients retry these too.
_ROUTING_STATUSES = frozenset(
    {
        pb.NO_JOURNAL_PRIMARY_BROKER,
        pb.NOT_JOURNAL_PRIMARY_BROKER,
        pb.INSUFFICIENT_JOURNAL_BROKERS,
        pb.NOT_JOURNAL_BROKER,
        pb.WRONG_ROUTE,
    }
)


def broker_error(status: int, detail: str = "") -> BrokerError:
    """The most specific BrokerError for `status`."""
    return _BY_STATUS.get(status, BrokerError)(status, detail)


def check_status(status: int, detail: str) -> None:
    """Raise the BrokerError of a non-OK status; `detail` says which request."""
    if status != pb.OK:
        raise broker_error(status, detail)


class OffsetJump(StreamkitError):
    """The next readable byte is past the requested offset (a span was deleted).

    The reader has already moved to `to_offset`; reading again continues there.
    """

    def __init__(self, from_offset: int, to_offset: int, journal: str = "") -> None:
        self.from_offset = from_offset
        self.to_offset = to_offset
        self.journal = journal
        super().__init__(f"{journal or 'journal'}: offset jumped from {from_offset} to {to_offset}")


class FragmentError(StreamkitError):
    """A fragment's content does not match the span its name claims."""


class ProtocolError(StreamkitError):
    """A broker response breaks the protocol (say, content at an unexpected offset)."""


# Details gRPC attaches when an UNKNOWN status really means that the connection broke.
_CONNECTION_HINTS = (
    "socket closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "goaway",
    "stream removed",
    "rst_stream",
    "failed to connect",
    "connection closed",
    "endpoint closing",
    "transport closed",
)


class TransportError(StreamkitError):
    """A broker call failed without the broker's answer; `code` names gRPC's status code
    and the gRPC error is the `__cause__`."""

    def __init__(self, what: str, code: str, details: str) -> None:
        self.what, self.code, self.details = what, code, details
        super().__init__(f"{what}: {code}: {details}" if details else f"{what}: {code}")


class BrokerUnavailable(TransportError, ConnectionError):
    """The broker could not be reached, or the connection broke: a retry may succeed."""


def rpc_failure(err: grpc.RpcError, what: str) -> TransportError:
    """The TransportError standing for gRPC's `err` in the call that did `what`."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else None
    cls = BrokerUnavailable if _grpc_transient(err) else TransportError
    name = code.name if code is not None else "UNKNOWN"
    return cls(what, name, " ".join((details or "").split()))


@contextlib.contextmanager
def translating_rpc_errors(what: str) -> Iterator[None]:
    """Raise gRPC errors escaping the block as TransportErrors (cause kept)."""
    try:
        yield
    except grpc.RpcError as err:
        raise rpc_failure(err, what) from err


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is a transport or routing failure that a retry may overcome."""
    if isinstance(exc, BrokerError):
        return exc.status in _ROUTING_STATUSES
    if isinstance(exc, TransportError):
        return isinstance(exc, BrokerUnavailable)
    return isinstance(exc, grpc.RpcError) and _grpc_transient(exc)


def _grpc_transient(exc: grpc.RpcError) -> bool:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (exc.details() or "").lower() if callable(getattr(exc, "details", None)) else ""
    if code == grpc.StatusCode.CANCELLED:
        # A call this process cancels raises asyncio.CancelledError in grpc.aio, never
        # an RpcError: CANCELLED comes from the other side. A broker stopping cancels the
        # calls still open at the end of its grace (and calls that raced its stop), as
        # Gazette's do when their context ends: the broker that comes back takes the retry.
        return True
    if code == grpc.StatusCode.UNKNOWN:
        return any(hint in details for hint in _CONNECTION_HINTS)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and details.endswith("rolled back"):
        # The broker's pacing rule aborted an append that came in too slowly (this
        # process starved of CPU, say): nothing was written, and the next try may be
        # quick enough. A deadline of the caller's own is not retried.
        return True
    # gRPC core may report a connection lost mid-stream this way (grpc/grpc#36066).
    return code == grpc.StatusCode.INTERNAL and "internal error from core" in details


def describe(exc: BaseException) -> str:
    """A one-line account of `exc` for logs (gRPC errors' reprs span lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TransportError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class Backoff:
    """Retry delays: the first retry is immediate, then 50 ms doubling to 2 s, jittered."""

    def __init__(self, first: float = 0.05, ceiling: float = 2.0) -> None:
        self.first = first
        self.ceiling = ceiling
        self.attempt = 0

    def reset(self) -> None:
        self.attempt = 0

    def worth_saying(self) -> bool:
        """Whether the retry about to wait is worth a log line: the first ones, then ever
        more rarely (retries 1, 2, 3, 5, 9, 17 …), so that an outage is said about once a
        minute per stream rather than every 2 s."""
        n = self.attempt
        return n & (n - 1) == 0

    def next_delay(self) -> float:
        attempt, self.attempt = self.attempt, self.attempt + 1
        if attempt == 0:
            return 0.0
        delay = min(self.ceiling, self.first * (2 ** (attempt - 1)))
        return delay * random.uniform(0.8, 1.0)

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())
