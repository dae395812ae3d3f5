"""Which failures the client retries: transport losses, never a request's own mistakes."""

from __future__ import annotations

import grpc
import pytest

from streamkit.client.errors import is_transient


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, None, None, details=details)


@pytest.mark.parametrize(("code", "details", "transient"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed", True),
    (grpc.StatusCode.CANCELLED, "Socket closed", True),
    (grpc.StatusCode.INTERNAL, "Internal error from Core", True),  # a lost connection too
    (grpc.StatusCode.INTERNAL, "some server bug", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "journal: bad name", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "journal a/b: disk full", False),
])
def test_is_transient(code: grpc.StatusCode, details: str, transient: bool) -> None:
    assert is_transient(_rpc_error(code, details)) is transient
