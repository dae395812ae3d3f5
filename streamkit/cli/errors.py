"""Turning failures into one-line messages: the error policy of `streamkit` commands.

A command-line user should see what went wrong and what to do, never a stack
trace: every expected failure (an unreachable broker, a missing journal, a
bad spec file, a typo in a selector) becomes a line on stderr starting with
"streamkit: error:" and a non-zero exit code. Exit code 2 marks a problem with
the user's input (as click uses it for usage errors), 1 anything else.
Unexpected exceptions are reported the same way; STREAMKIT_DEBUG=1 adds the
traceback for bug reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ParamSpec

import click

from streamkit.errors import StreamkitError
from streamkit.tasks import left_behind

__all__ = [
    "DATA_ERROR",
    "FAILURE",
    "INTERRUPTED",
    "CliError",
    "async_command",
    "warn",
]

FAILURE = 1
DATA_ERROR = 2  # the user's input (arguments, files, specs) is wrong
INTERRUPTED = 130  # the exit code after Ctrl-C (128 + SIGINT), as shells report it
_PREFIX = "streamkit: error: "

P = ParamSpec("P")


class CliError(StreamkitError):
    """A failure whose message is already fit for the user."""

    def __init__(self, message: str, exit_code: int = FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def warn(message: str) -> None:
    """A non-fatal notice on stderr (stdout is kept for data)."""
    click.echo(f"streamkit: warning: {message}", err=True)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _broker_address() -> str:
    ctx = click.get_current_context(silent=True)
    return str(ctx.params.get("broker", "")) if ctx is not None else ""


def _client_cert_given() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.params.get("tls_client_cert") is not None


def _tls_hint(address: str, details: str) -> str | None:
    """The message for a broker dial that failed for TLS, saying what to change; None when
    the broker was rather out of reach. (gRPC says just "Socket closed" whether TLS is
    spoken on one side only or the broker wants, or refused, a client certificate.)"""
    from streamkit.auth.tls import tls_trouble, without_ok

    tls = address.lower().startswith("https://")
    advice = tls_trouble(details, tls=tls, client_cert=_client_cert_given())
    if advice is None:
        return None
    if not tls:
        return f"cannot reach broker at {address}: {without_ok(details)} ({advice})"
    return f"TLS with the broker at {address} failed: {advice} ({without_ok(details)})"


def _rpc_error(code: str, details: str) -> tuple[list[str], int]:
    details = _one_line(details)
    if code == "UNAVAILABLE":
        address = _broker_address()
        return [_tls_hint(address, details) or f"cannot reach broker at {address}: {details}"], \
            FAILURE
    if code == "INVALID_ARGUMENT":
        return [f"the broker rejected the request: {details}"], DATA_ERROR
    if code == "UNAUTHENTICATED":
        return [f"the broker refused the request ({code}): {details} "
                "(are --auth-keys or AUTH_KEYS set to the broker's keys?)"], FAILURE
    if code == "PERMISSION_DENIED":
        return [f"the broker refused the request ({code}): {details}"], FAILURE
    return [f"broker call failed ({code}): {details}"], FAILURE


def explain(exc: BaseException) -> tuple[list[str], int]:
    """The message lines and exit code for an expected failure; raises if unexpected."""
    if isinstance(exc, CliError):
        return str(exc).splitlines() or [type(exc).__name__], exc.exit_code
    # Imported here, not at the top: every command imports this module, and only a
    # failing one needs gRPC's and pydantic's error types (`run` starts its broker
    # before importing them).
    import grpc

    from streamkit.auth.tls import AddressError
    from streamkit.broker.stores import FragmentStoreError
    from streamkit.client.errors import BrokerError, JournalNotFound, TransportError
    from streamkit.keyspace.keyspace import KeySpaceURLError
    from streamkit.protocol.labels import SelectorError
    from streamkit.protocol.problems import SpecError

    if isinstance(exc, SpecError):
        return [_one_line(str(problem)) for problem in exc.problems], DATA_ERROR
    if isinstance(exc, SelectorError):
        return [f"bad label selector: {_one_line(str(exc))}"], DATA_ERROR
    if isinstance(exc, KeySpaceURLError | AddressError):  # a malformed URL or address
        return [_one_line(str(exc))], DATA_ERROR
    if isinstance(exc, JournalNotFound):
        return [f"journal not found ({exc.detail or exc.name})"], FAILURE
    if isinstance(exc, BrokerError):
        return [f"{exc.detail}: the broker answered {exc.name}"], FAILURE
    if isinstance(exc, TransportError):
        return _rpc_error(exc.code, exc.details)
    if isinstance(exc, grpc.aio.AioRpcError):
        return _rpc_error(exc.code().name, exc.details() or "")
    if isinstance(exc, FragmentStoreError):
        return [_one_line(str(exc))], FAILURE
    if isinstance(exc, StreamkitError):  # streamkit refused or failed, and said why
        return [_one_line(str(exc)) or type(exc).__name__], FAILURE
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return [f"{where}{exc.strerror}"], FAILURE
    raise exc


def _environment_values() -> dict[str, str]:
    """The values this command took from environment variables (not from its
    arguments), by the variable that set each."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return {}
    taken = {}
    for param in ctx.command.params:
        if param.name is None or param.envvar is None or (
                ctx.get_parameter_source(param.name)
                is not click.core.ParameterSource.ENVIRONMENT):
            continue
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        var = next((name for name in names if os.environ.get(name)), None)
        if var is not None:
            taken[var] = os.environ[var]
    return taken


def _naming_the_environment(lines: list[str]) -> list[str]:
    """A line quoting a value that came from the environment says which variable set it:
    the user typed no such thing."""
    taken = _environment_values()
    return [line + "".join(f" (set by {var})" for var, value in taken.items()
                           if value.strip() and value.strip() in line)
            for line in lines]


def _exit(lines: list[str], code: int) -> click.exceptions.Exit:
    for line in _naming_the_environment(lines):
        click.echo(_PREFIX + line, err=True)
    return click.exceptions.Exit(code)


def _silence_stdout() -> None:
    """After a closed pipe (`… | head`), stop Python's exit-time flush from complaining."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


@contextlib.contextmanager
def reporting_errors(interrupt_exit: int = INTERRUPTED) -> Iterator[None]:
    """Report any exception escaping the block as "streamkit: error: …" and exit."""
    try:
        yield
    except (click.exceptions.Exit, click.ClickException, click.Abort):
        raise
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise click.exceptions.Exit(interrupt_exit) from None
    except BrokenPipeError:
        _silence_stdout()
        raise click.exceptions.Exit(0) from None
    except Exception as exc:
        try:
            lines, code = explain(exc)
        except Exception:
            if os.environ.get("STREAMKIT_DEBUG"):
                traceback.print_exc()
            summary = _one_line(f"{type(exc).__name__}: {exc}")
            lines = [f"unexpected {summary} (run with STREAMKIT_DEBUG=1 for a traceback)"]
            code = FAILURE
        raise _exit(lines, code) from None


class _LineFormatter(logging.Formatter):
    """"streamkit: warning: …", matching the look of the CLI's own messages."""

    def format(self, record: logging.LogRecord) -> str:
        return _one_line(f"streamkit: {record.levelname.lower()}: {record.getMessage()}")


def _configure_logging() -> None:
    """Library warnings (retries, skipped gaps) go to stderr, one line each."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter())
    root.addHandler(handler)
    # Failed appends reach the command as exceptions, which it reports itself.
    logging.getLogger("streamkit.client.append_service").setLevel(logging.ERROR)
    root.setLevel(logging.DEBUG if os.environ.get("STREAMKIT_DEBUG") else logging.WARNING)


async def _stoppable(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro`, treating SIGTERM like Ctrl-C: cancel it, so cleanups run.

    `timeout 60 streamkit journals read --block --offsets-out …` then still
    records its offsets, and an append in flight is rolled back, not torn.
    """
    task = asyncio.current_task()
    if task is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    await coro


def async_command(
    *, interrupt_exit: int = INTERRUPTED
) -> Callable[[Callable[P, Coroutine[Any, Any, None]]], Callable[P, None]]:
    """Make an async click callback synchronous, under the error policy above.

    `interrupt_exit` is the exit code after Ctrl-C or SIGTERM: following a
    journal is ended that way on purpose, so `read` passes 0.
    """

    def decorate(fn: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            _configure_logging()
            earlier = len(left_behind())  # a process running commands in turn (tests)
            try:
                with reporting_errors(interrupt_exit):
                    asyncio.run(_stoppable(fn(*args, **kwargs)))
            except BaseException as ending:
                _unless_left_behind(ending, earlier)
                raise
            _unless_left_behind(None, earlier)

        return run

    return decorate


def _unless_left_behind(ending: BaseException | None, earlier: int) -> None:
    """Exit at once, with the command's exit code, if it left work behind on threads (a
    shard's store blocked in its database, after the stop's timeout; `earlier`: how much
    was left before it began): the interpreter's exit joins those threads, and would wait
    for them for ever."""
    stuck = left_behind()[earlier:]
    if not stuck:
        return
    code = 0
    if isinstance(ending, click.ClickException):
        ending.show()
        code = ending.exit_code
    elif isinstance(ending, click.exceptions.Exit):
        code = ending.exit_code
    elif isinstance(ending, SystemExit):
        code = ending.code if isinstance(ending.code, int) else FAILURE
    elif ending is not None:
        code = FAILURE
    sys.stderr.write(f"streamkit: exiting without waiting for what is left behind: "
                     f"{', '.join(dict.fromkeys(stuck))}\n")
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
