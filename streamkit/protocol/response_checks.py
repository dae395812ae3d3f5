"""Checking every response a client channel receives against Gazette's rules.

With STREAMKIT_CHECK_RESPONSES=1 in the environment, every channel
`streamkit.auth.open_channel` opens carries these interceptors, which run each
response through `streamkit.protocol.conformance.problems_of`. The test suite
runs that way (its processes inherit the variable), so a server change that
would break a Gazette client fails a test instead. Off, nothing is added to any
call path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc.aio import _base_call

from streamkit.protocol.conformance import NonConformant, problems_of

__all__ = ["CHECK_RESPONSES_ENV", "RESPONSE_CHECKERS", "checks_enabled", "response_checkers"]

log = logging.getLogger(__name__)

CHECK_RESPONSES_ENV = "STREAMKIT_CHECK_RESPONSES"


def checks_enabled() -> bool:
    """Whether STREAMKIT_CHECK_RESPONSES asks for every response to be checked."""
    return os.environ.get(CHECK_RESPONSES_ENV, "").strip().lower() in ("1", "true", "yes")


def _checked(message: Any, method: Any) -> Any:
    if isinstance(message, Message) and (problems := problems_of(message)):
        err = NonConformant(message, problems)
        log.error("response of %s: %s", _method_name(method), err)
        raise err
    return message


def _method_name(method: Any) -> str:
    return method.decode() if isinstance(method, bytes) else str(method)


class _UnaryResponse(_base_call.UnaryUnaryCall, _base_call.StreamUnaryCall):
    """A call whose single response is checked when awaited; all else is the call's."""

    def __init__(self, call: Any, method: Any) -> None:
        self._call, self._method = call, method

    def __await__(self) -> Any:
        response = yield from self._call.__await__()
        return _checked(response, self._method)

    def cancel(self) -> bool:
        return self._call.cancel()

    def cancelled(self) -> bool:
        return self._call.cancelled()

    def done(self) -> bool:
        return self._call.done()

    def add_done_callback(self, callback: Any) -> None:
        self._call.add_done_callback(callback)

    def time_remaining(self) -> float | None:
        return self._call.time_remaining()

    async def initial_metadata(self) -> Any:
        return await self._call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return await self._call.trailing_metadata()

    async def code(self) -> grpc.StatusCode:
        return await self._call.code()

    async def details(self) -> str:
        return await self._call.details()

    async def wait_for_connection(self) -> None:
        await self._call.wait_for_connection()

    @property
    def _done_writing_flag(self) -> bool:  # read by grpc.aio's intercepted stream-unary call
        return bool(self._call._done_writing_flag)

    async def write(self, request: Any) -> None:
        await self._call.write(request)

    async def done_writing(self) -> None:
        await self._call.done_writing()


async def _checked_stream(call: Any, method: Any) -> AsyncIterator[Any]:
    async for response in call:
        yield _checked(response, method)


# grpc.aio files an interceptor under one kind of call only, so there is one per kind.


class _CheckUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return _UnaryResponse(await continuation(details, request), details.method)


class _CheckStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return _UnaryResponse(await continuation(details, request_iterator), details.method)


class _CheckUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return _checked_stream(await continuation(details, request), details.method)


class _CheckStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return _checked_stream(await continuation(details, request_iterator), details.method)


RESPONSE_CHECKERS = (_CheckUnaryUnary, _CheckStreamUnary, _CheckUnaryStream, _CheckStreamStream)


def response_checkers() -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that check every response received (``check``), one per kind of
    call, when checks_enabled(); else none. A non-conformant response is logged and raised
    to the caller as NonConformant."""
    return [kind() for kind in RESPONSE_CHECKERS] if checks_enabled() else []
