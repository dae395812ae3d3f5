"""Authorization for grpc.aio: a server interceptor that checks every call's token, and
the client side that attaches one.

Server: `ServerAuth(keys, JOURNAL_CAPABILITIES)` verifies the `authorization`
metadata of each call against the capability its method needs (Gazette's table:
`broker/protocol/auth.go` `VerifiedJournalServer` and `consumer/protocol/auth.go`
`authServer`), refusing with UNAUTHENTICATED (no usable token) or
PERMISSION_DENIED (a token lacking the capability). A method missing from the
table is refused, so a new RPC cannot go unguarded by accident. Accepted claims
are bound for the servicer (see `scope`): it calls `require_journal(name,
labels)` or filters with `journal_allowed(...)`, and a PermissionDenied it raises
becomes PERMISSION_DENIED naming the journal.

Client: over TLS, `call_credentials(tokens)` is the gRPC way; gRPC refuses call
credentials on plaintext channels, where `client_interceptors(tokens)` adds the
same metadata. `open_channel` picks by the address's scheme.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from streamkit.auth.keys import Keys
from streamkit.auth.scope import bind_claims
from streamkit.auth.tls import ClientTls, parse_address
from streamkit.auth.tokens import (
    AuthError,
    Capability,
    Claims,
    PermissionDenied,
    TokenSource,
    Unauthenticated,
    verify_bearer,
)
from streamkit.protocol.response_checks import response_checkers

__all__ = [
    "AUTHORIZATION",
    "JOURNAL_CAPABILITIES",
    "SHARD_CAPABILITIES",
    "ServerAuth",
    "call_credentials",
    "client_interceptors",
    "open_channel",
    "status_code",
]

AUTHORIZATION = "authorization"  # the metadata key (gRPC keys are lower case)

JOURNAL_CAPABILITIES: Mapping[str, Capability] = {
    "/protocol.Journal/List": Capability.LIST,
    "/protocol.Journal/Apply": Capability.APPLY,
    "/protocol.Journal/Read": Capability.READ,
    "/protocol.Journal/Append": Capability.APPEND,
    "/protocol.Journal/Replicate": Capability.REPLICATE,
    "/protocol.Journal/ListFragments": Capability.READ,  # it hands out fragment locations
    "/protocol.Journal/FragmentStoreHealth": Capability.READ,
}

SHARD_CAPABILITIES: Mapping[str, Capability] = {
    "/consumer.Shard/Stat": Capability.READ,
    "/consumer.Shard/List": Capability.LIST,
    "/consumer.Shard/Apply": Capability.APPLY,
    "/consumer.Shard/GetHints": Capability.READ,
    "/consumer.Shard/Unassign": Capability.APPLY,
}


def status_code(err: AuthError) -> grpc.StatusCode:
    if isinstance(err, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    return grpc.StatusCode.PERMISSION_DENIED


# --- server --------------------------------------------------------------------------------

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _header(metadata: Iterable[Any] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _refusing(err: AuthError) -> Behavior:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(status_code(err), str(err))

    return refuse


def _binding(behavior: Behavior, claims: Claims) -> Behavior:
    """`behavior` with `claims` bound, and AuthErrors it raises turned into statuses."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            bind_claims(claims)
            try:
                async for response in behavior(request, context):
                    yield response
            except AuthError as err:
                await context.abort(status_code(err), str(err))

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        bind_claims(claims)
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except AuthError as err:
            await context.abort(status_code(err), str(err))

    return call


def _rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior]):
    """A handler of the same kind and serializers whose behavior is `wrap`ped."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attr, make in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return make(
                wrap(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class ServerAuth(grpc.aio.ServerInterceptor):
    """Verifies each call's bearer token for the capability its method needs."""

    def __init__(
        self,
        keys: Keys,
        capabilities: Mapping[str, Capability],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        self.capabilities = dict(capabilities)
        self._clock = clock

    def check(self, method: str, header: str | None) -> Claims:
        """The claims of a call to `method` with this `authorization` value, or AuthError."""
        required = self.capabilities.get(method)
        if required is None:
            raise PermissionDenied(f"{method} is not in this server's authorization table")
        try:
            return verify_bearer(self.keys, header, required, now=self._clock())
        except PermissionDenied as err:
            raise PermissionDenied(f"{err} (for {method})") from None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        try:
            claims = self.check(method, _header(handler_call_details.invocation_metadata))
        except AuthError as err:
            refusal = _refusing(err)
            return _rewrap(handler, lambda _behavior: refusal)
        return _rewrap(handler, lambda behavior: _binding(behavior, claims))


# --- client --------------------------------------------------------------------------------


def call_credentials(tokens: TokenSource) -> grpc.CallCredentials:
    """Per-call credentials carrying the token; for TLS channels only."""

    def plugin(_context: Any, callback: Callable[..., None]) -> None:
        try:
            callback(((AUTHORIZATION, tokens.authorization()),), None)
        except Exception as err:  # reported to the caller as the call's failure
            callback((), err)

    return grpc.metadata_call_credentials(plugin, name="streamkit-token")


class _Attach:
    def __init__(self, tokens: TokenSource) -> None:
        self.tokens = tokens

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = list(details.metadata or ())
        if not any(key.lower() == AUTHORIZATION for key, _ in pairs):
            pairs.append((AUTHORIZATION, self.tokens.authorization()))  # a caller's token wins
        return details._replace(metadata=grpc.aio.Metadata(*pairs))


class _UnaryUnary(_Attach, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_Attach, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_Attach, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_Attach, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def client_interceptors(tokens: TokenSource) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the token to every call (a grpc.aio channel takes one per kind)."""
    return [_UnaryUnary(tokens), _UnaryStream(tokens), _StreamUnary(tokens), _StreamStream(tokens)]


def open_channel(
    address: str,
    *,
    tls: ClientTls | None = None,
    tokens: TokenSource | None = None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to `address`: TLS for `https://`, plaintext otherwise; with `tokens`,
    every call carries a token."""
    where = parse_address(address)
    chain = list(interceptors) + response_checkers()  # empty unless STREAMKIT_CHECK_RESPONSES
    if where.tls:
        credentials = (tls or ClientTls()).grpc_credentials()
        if tokens is not None:
            credentials = grpc.composite_channel_credentials(credentials, call_credentials(tokens))
        return grpc.aio.secure_channel(where.target, credentials, options, interceptors=chain)
    if tokens is not None:
        chain += client_interceptors(tokens)
    return grpc.aio.insecure_channel(where.target, options, interceptors=chain)
