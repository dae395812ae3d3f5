"""Client-side errors: broker statuses as exceptions, offset jumps, and which failures to retry.

Brokers report most request problems as a `pb.Status` inside an otherwise
successful RPC; the client turns every non-OK status into a `BrokerError`
subclass so callers can catch the ones they expect. Transport failures stay
`grpc.aio.AioRpcError`s; `is_transient` says whether retrying them is sound.
"""

from __future__ import annotations

import asyncio
import random
from typing import ClassVar

import grpc

from streamkit.protocol import pb

__all__ = [
    "Backoff",
    "BrokerError",
    "EtcdTransactionFailed",
    "FragmentError",
    "JournalNotFound",
    "NotAllowed",
    "OffsetJump",
    "OffsetNotYetAvailable",
    "ProtocolError",
    "RegisterMismatch",
    "WrongAppendOffset",
    "broker_error",
    "check_status",
    "describe",
    "is_transient",
]


class BrokerError(Exception):
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


class OffsetJump(Exception):
    """The next readable byte is past the requested offset (a span was deleted).

    The reader has already moved to `to_offset`; reading again continues there.
    """

    def __init__(self, from_offset: int, to_offset: int, journal: str = "") -> None:
        self.from_offset = from_offset
        self.to_offset = to_offset
        self.journal = journal
        super().__init__(f"{journal or 'journal'}: offset jumped from {from_offset} to {to_offset}")


class FragmentError(Exception):
    """A fragment's content does not match the span its name claims."""


class ProtocolError(Exception):
    """A broker response breaks the protocol (say, content at an unexpected offset)."""


# Details gRPC attaches when a CANCELLED or UNKNOWN status really means that the
# connection broke, rather than that somebody cancelled the call on purpose.
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


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is a transport or routing failure that a retry may overcome."""
    if isinstance(exc, BrokerError):
        return exc.status in _ROUTING_STATUSES
    if not isinstance(exc, grpc.RpcError):
        return False
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (exc.details() or "").lower() if callable(getattr(exc, "details", None)) else ""
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return any(hint in details for hint in _CONNECTION_HINTS)
    # gRPC core may report a connection lost mid-stream this way (grpc/grpc#36066).
    return code == grpc.StatusCode.INTERNAL and "internal error from core" in details


def describe(exc: BaseException) -> str:
    """A one-line account of `exc` for logs (gRPC errors' reprs span lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class Backoff:
    """Retry delays: the first retry is immediate, then 50 ms doubling to 2 s, jittered."""

    def __init__(self, first: float = 0.05, ceiling: float = 2.0) -> None:
        self.first = first
        self.ceiling = ceiling
        self.attempt = 0

    def reset(self) -> None:
        self.attempt = 0

    def next_delay(self) -> float:
        attempt, self.attempt = self.attempt, self.attempt + 1
        if attempt == 0:
            return 0.0
        delay = min(self.ceiling, self.first * (2 ** (attempt - 1)))
        return delay * random.uniform(0.8, 1.0)

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())
