"""Which failures the client retries: transport losses, never a request's own mistakes."""

from __future__ import annotations

import socket

import grpc
import pytest

from streamkit.client import Appender, BrokerClient, Reader
from streamkit.client.errors import (
    Backoff,
    BrokerUnavailable,
    TransportError,
    is_transient,
    translating_rpc_errors,
)
from streamkit.client.listing import apply_journals, list_fragments, list_journals
from streamkit.errors import StreamkitError
from streamkit.protocol import pb


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, None, None, details=details)


@pytest.mark.parametrize(("code", "details", "transient"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed", True),
    (grpc.StatusCode.CANCELLED, "Socket closed", True),
    (grpc.StatusCode.CANCELLED, "CANCELLED", True),  # a broker stopping: its calls cancelled
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
    (grpc.StatusCode.INTERNAL, "Internal error from Core", True),  # a lost connection too
    (grpc.StatusCode.INTERNAL, "some server bug", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "journal: bad name", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "journal a/b: disk full", False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "append to a/b sent 48 bytes in 2.0s, below the "
     "minimum rate of 64 KiB/s; rolled back", True),  # the broker's pacing: safe to retry
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False),  # the caller's own
])
def test_is_transient(code: grpc.StatusCode, details: str, transient: bool) -> None:
    assert is_transient(_rpc_error(code, details)) is transient


@pytest.mark.parametrize(("code", "details", "transient"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect", True),
    (grpc.StatusCode.INVALID_ARGUMENT, "journal: bad name", False),
])
def test_rpc_failures_keep_their_cause_and_transience(
    code: grpc.StatusCode, details: str, transient: bool
) -> None:
    with pytest.raises(TransportError) as caught, translating_rpc_errors("list journals"):
        raise _rpc_error(code, details)
    error = caught.value
    assert isinstance(error, StreamkitError)
    assert isinstance(error, BrokerUnavailable) is transient
    assert is_transient(error) is transient
    assert isinstance(error.__cause__, grpc.aio.AioRpcError)
    assert (error.code, error.details) == (code.name, details)
    assert str(error) == f"list journals: {code.name}: {details}"


async def test_an_unreachable_broker_raises_broker_unavailable() -> None:
    """Every public call wraps gRPC's error: callers catch streamkit's types only."""
    with socket.socket() as sock:  # a port nobody listens on (bound, never listening)
        sock.bind(("127.0.0.1", 0))
        client = BrokerClient(f"127.0.0.1:{sock.getsockname()[1]}")
        try:
            with pytest.raises(BrokerUnavailable, match="list journals: UNAVAILABLE"):
                await list_journals(client)
            with pytest.raises(BrokerUnavailable, match="apply 0 journal change"):
                await apply_journals(client, [])
            with pytest.raises(BrokerUnavailable, match="list fragments of a/b"):
                await list_fragments(client, "a/b")
            reader = Reader(client, pb.ReadRequest(journal="a/b", offset=7))
            with pytest.raises(BrokerUnavailable, match="read a/b at offset 7"):
                await reader.read()
            appender = Appender(client, "a/b")
            with pytest.raises(BrokerUnavailable, match="append to a/b"):
                await appender.write(b"x\n")
                await appender.commit()
        finally:
            await client.close()


def test_retries_are_said_ever_more_rarely() -> None:
    """A stream retrying through an outage logs its first retries, then at doubling counts:
    about once a minute at the 2 s ceiling, not every 2 s per stream."""
    backoff = Backoff()
    said = []
    for _ in range(40):
        said.append(backoff.worth_saying())
        backoff.next_delay()
    assert [n for n, say in enumerate(said) if say] == [0, 1, 2, 4, 8, 16, 32]
    backoff.reset()
    assert backoff.worth_saying()
