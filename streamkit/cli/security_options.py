"""The TLS and authorization options of every command that serves or dials.

One decorator adds them and hands the command a single `security` argument (a
`streamkit.auth.Security`), so each setting has one name, one environment
variable and one meaning everywhere. Bad settings (an unreadable certificate,
a key that is not base64, a certificate without its key) stop the command
before it does anything, with one line saying which setting is wrong.
"""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from streamkit.auth.keys import ALLOW_MISSING_KEY, AUTH_KEYS_ENV, AuthKeysError, parse_keys
from streamkit.auth.settings import DEFAULT_MAX_BODY, DEFAULT_MAX_MESSAGE, Security
from streamkit.auth.tls import ClientTls, ServerTls, TlsError
from streamkit.cli.errors import DATA_ERROR, CliError, reporting_errors

__all__ = ["SECURITY_ENV", "security_env", "security_options"]

F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_FILE = click.Path(dir_okay=False, path_type=Path)
_NAMES = ("auth_keys", "tls_cert", "tls_key", "tls_ca", "tls_client_cert", "tls_client_key",
          "tls_require_client_cert", "allowed_hosts", "insecure", "max_message_size",
          "max_body_size")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class ByteSize(click.ParamType):
    """A size in bytes: 1048576, 512KiB, 64MiB, 1G (units are powers of 1024)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> int:
        if isinstance(value, int):
            return value
        found = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
        unit = found.group(2).lower() if found else ""
        if found is None or unit not in _UNITS or int(found.group(1)) == 0:
            self.fail(f"{value!r} is not a size: give bytes, or a number with KiB, MiB or GiB",
                      param, ctx)
        return int(found.group(1)) * _UNITS[unit]


def _auth_keys() -> Decorator:
    return click.option(
        "--auth-keys", envvar=AUTH_KEYS_ENV, show_envvar=True, metavar="KEYS",
        help="Pre-shared keys, base64, separated by spaces or commas (Gazette's format): the "
             "first signs tokens, any verifies; AA== also lets requests without a token in. "
             "Prefer the environment variable: arguments show in `ps`.",
    )


def _file(flag: str, env: str, help: str) -> Decorator:
    return click.option(flag, type=_FILE, envvar=env, show_envvar=True, metavar="FILE",
                        help=help)


def _trust(serves: bool, dials: bool) -> Decorator:
    uses = []
    if dials:
        uses.append("to trust for https:// servers [default: the system's CAs]")
    if serves:
        uses.append("that client certificates must be signed by")
    return _file("--tls-ca", "STREAMKIT_TLS_CA", f"CA certificates (PEM) {'; and '.join(uses)}.")


def _serving() -> list[Decorator]:
    return [
        _file("--tls-cert", "STREAMKIT_TLS_CERT",
              "Serve TLS with this certificate (PEM, with its chain)."),
        _file("--tls-key", "STREAMKIT_TLS_KEY", "The private key of --tls-cert (PEM)."),
        click.option("--tls-require-client-cert", is_flag=True,
                     envvar="STREAMKIT_TLS_REQUIRE_CLIENT_CERT", show_envvar=True,
                     help="Refuse clients without a certificate signed by --tls-ca "
                          "(mutual TLS)."),
        click.option("--allowed-hosts", envvar="STREAMKIT_ALLOWED_HOSTS", show_envvar=True,
                     metavar="HOSTS",
                     help="More names (host or host:port, comma-separated) the HTTP server "
                          "answers to, beyond its own addresses; * for any (behind a proxy "
                          "that checks Host)."),
        click.option("--insecure", is_flag=True, envvar="STREAMKIT_INSECURE", show_envvar=True,
                     help="Allow listening beyond loopback without authorization."),
        click.option("--max-message-size", type=ByteSize(), default=DEFAULT_MAX_MESSAGE,
                     envvar="STREAMKIT_MAX_MESSAGE_SIZE", show_envvar=True,
                     show_default="64MiB", help="Refuse larger gRPC messages "
                     "(RESOURCE_EXHAUSTED); appends stream in chunks, each under it."),
        click.option("--max-body-size", type=ByteSize(), default=DEFAULT_MAX_BODY,
                     envvar="STREAMKIT_MAX_BODY_SIZE", show_envvar=True, show_default="64MiB",
                     help="Refuse larger HTTP request bodies (413): a gateway PUT, a query."),
    ]


def _dialing() -> list[Decorator]:
    return [
        _file("--tls-client-cert", "STREAMKIT_TLS_CLIENT_CERT",
              "Present this certificate to https:// servers that require one."),
        _file("--tls-client-key", "STREAMKIT_TLS_CLIENT_KEY",
              "The private key of --tls-client-cert (PEM)."),
    ]


SECURITY_ENV = (AUTH_KEYS_ENV, "STREAMKIT_TLS_CERT", "STREAMKIT_TLS_KEY", "STREAMKIT_TLS_CA",
                "STREAMKIT_TLS_REQUIRE_CLIENT_CERT", "STREAMKIT_ALLOWED_HOSTS",
                "STREAMKIT_INSECURE", "STREAMKIT_TLS_CLIENT_CERT", "STREAMKIT_TLS_CLIENT_KEY",
                "STREAMKIT_MAX_MESSAGE_SIZE", "STREAMKIT_MAX_BODY_SIZE")


def security_env(security: Security, environ: dict[str, str]) -> dict[str, str]:
    """`environ` with `security` as the environment variables of the options, for child
    processes (`run`'s workers and bundled broker): keys stay out of their command lines,
    where `ps` would show them. Variables of settings not made are removed."""
    env = {name: value for name, value in environ.items() if name not in SECURITY_ENV}
    if security.keys is not None:
        words = [base64.b64encode(key).decode() for key in security.keys.verifying]
        env[AUTH_KEYS_ENV] = " ".join(words + [ALLOW_MISSING_KEY] * security.keys.allow_missing)
    server, client = security.server_tls, security.client_tls
    if server is not None:
        env["STREAMKIT_TLS_CERT"], env["STREAMKIT_TLS_KEY"] = str(server.cert), str(server.key)
        if server.require_client_cert:
            env["STREAMKIT_TLS_REQUIRE_CLIENT_CERT"] = "1"
    ca = (server.ca if server is not None else None) or (client.ca if client else None)
    if ca is not None:
        env["STREAMKIT_TLS_CA"] = str(ca)
    if client is not None and client.cert is not None and client.key is not None:
        env["STREAMKIT_TLS_CLIENT_CERT"] = str(client.cert)
        env["STREAMKIT_TLS_CLIENT_KEY"] = str(client.key)
    if security.allowed_hosts:
        env["STREAMKIT_ALLOWED_HOSTS"] = ",".join(security.allowed_hosts)
    if security.insecure:
        env["STREAMKIT_INSECURE"] = "1"
    if security.max_message != DEFAULT_MAX_MESSAGE:
        env["STREAMKIT_MAX_MESSAGE_SIZE"] = str(security.max_message)
    if security.max_body != DEFAULT_MAX_BODY:
        env["STREAMKIT_MAX_BODY_SIZE"] = str(security.max_body)
    return env


def _hosts(text: str | None) -> tuple[str, ...]:
    return tuple(word for word in re.split(r"[\s,]+", text or "") if word)


def _keys_source() -> str:
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("auth_keys") == ParameterSource.ENVIRONMENT:
        return AUTH_KEYS_ENV
    return "--auth-keys"


def build_security(values: dict[str, Any]) -> Security:
    """A Security from the options' values (those a command lacks are absent); raises
    CliError naming the setting that is wrong."""
    try:
        keys_text = values.get("auth_keys")
        keys = parse_keys(keys_text, _keys_source()) if keys_text and keys_text.strip() else None
        cert, key = values.get("tls_cert"), values.get("tls_key")
        if (cert is None) != (key is None):
            raise TlsError("--tls-cert and --tls-key go together: give both or neither")
        ca = values.get("tls_ca")
        server_tls = None
        if cert is not None and key is not None:
            server_tls = ServerTls(cert, key, ca=ca,
                                   require_client_cert=bool(values.get("tls_require_client_cert")))
        elif values.get("tls_require_client_cert"):
            raise TlsError("--tls-require-client-cert needs TLS: give --tls-cert and --tls-key")
        client_cert, client_key = values.get("tls_client_cert"), values.get("tls_client_key")
        if (client_cert is None) != (client_key is None):
            raise TlsError("--tls-client-cert and --tls-client-key go together: give both")
        client_tls = None
        if ca is not None or client_cert is not None:
            client_tls = ClientTls(ca=ca, cert=client_cert, key=client_key)
        security = Security(keys=keys, server_tls=server_tls, client_tls=client_tls,
                            allowed_hosts=_hosts(values.get("allowed_hosts")),
                            insecure=bool(values.get("insecure")),
                            max_message=values.get("max_message_size") or DEFAULT_MAX_MESSAGE,
                            max_body=values.get("max_body_size") or DEFAULT_MAX_BODY)
        security.validate()
    except (AuthKeysError, TlsError) as err:
        raise CliError(str(err), DATA_ERROR) from None
    return security


def security_options(*, serves: bool = False, dials: bool = True) -> Callable[[F], F]:
    """Add the security options to a command and pass it `security`.

    `serves`: the command listens (certificate and key, client certificates required
    or not, allowed Host names, --insecure). `dials`: it connects to servers (its own
    client certificate). Both take --auth-keys and, when serving or dialling, --tls-ca.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in _NAMES if name in kwargs}
            with reporting_errors():
                security = build_security(values)
            return fn(*args, security=security, **kwargs)

        options = [_auth_keys()]
        if serves:
            options += _serving()[:2]
        if serves or dials:
            options.append(_trust(serves, dials))
        if serves:
            options += _serving()[2:]
        if dials:
            options += _dialing()
        wrapped: Any = command
        for option in reversed(options):  # click lists options in decoration order, reversed
            wrapped = option(wrapped)
        return wrapped

    return decorate
