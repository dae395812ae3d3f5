"""`streamkit publish`: JSON lines from stdin or a file, published as committed messages.

Unlike `journals append --framing lines`, which copies lines verbatim, each
line here is parsed as a JSON object and published through a Publisher: it
gets a message UUID (producer, clock, OUTSIDE_TXN), so read-committed readers
and consumer shards de-duplicate it, and the journal is picked by a mapping
over the message's key (`--key FIELD`), the same way a Python or Go
producer would.

A bad line (not a JSON object, or missing the key field) stops the command
with a one-line error naming the line and exit code 2, after the lines
before it have been published and committed. Nothing from the bad line on
is appended, so re-running on the rest of the input (`tail -n +LINE`)
publishes every line exactly once.

A failed append (a broker's full disk, say) stops it with exit code 1 and an
exact account: appends to different journals fail independently, so what
committed is no prefix of the input. `--unpublished FILE` gets the lines
that were not committed, then the input not read yet: publishing that file
completes the job, each line once.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import click
import orjson

from streamkit.auth.settings import Security
from streamkit.cli.errors import (
    DATA_ERROR,
    INTERRUPTED,
    CliError,
    async_command,
    explain,
    warn,
)
from streamkit.cli.journals import broker_option, opened_input
from streamkit.cli.line_input import LineInput
from streamkit.cli.output import plural
from streamkit.cli.security_options import security_options
from streamkit.cli.unsettled import AppendFailed as _AppendFailed
from streamkit.cli.unsettled import Unsettled as _Unsettled
from streamkit.cli.unsettled import keep_unknown, stop_on_signals
from streamkit.cli.unsettled import opened_output as _opened_output
from streamkit.client import AppendService, BrokerClient, PolledList
from streamkit.message.framing import UnknownFraming, content_type_of, framing_for
from streamkit.message.mapping import (
    EmptyPartitions,
    MappingFunc,
    field_key,
    modulo_mapping,
    partitions_from,
    random_mapping,
    rendezvous_mapping,
)
from streamkit.message.publisher import Publisher
from streamkit.protocol.labels import parse_selector

__all__ = ["publish"]

MAPPINGS = ("modulo", "rendezvous", "random")
_PROGRESS_EVERY = 1.0  # seconds


class _Recording:
    """Wraps a MappingFunc to remember where the last message went (for tallies and waits)."""

    __slots__ = ("journal", "mapping")

    def __init__(self, mapping: MappingFunc) -> None:
        self.mapping = mapping
        self.journal = ""

    def __call__(self, message: Any) -> tuple[str, str]:
        journal, content_type = self.mapping(message)
        self.journal = journal
        return journal, content_type


def _mapping(kind: str | None, key: str | None, polled: PolledList) -> MappingFunc:
    """The MappingFunc for --mapping/--key: keyed modulo by default, random without a key."""
    kind = kind or ("modulo" if key else "random")
    partitions = partitions_from(polled)
    if kind == "random":
        return random_mapping(partitions)
    if key is None:
        raise CliError(f"--mapping {kind} needs --key FIELD to hash", DATA_ERROR)
    build = modulo_mapping if kind == "modulo" else rendezvous_mapping
    return build(field_key(key), partitions)


def _parse(line: bytes) -> dict[str, Any]:
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError as err:
        raise ValueError(f"invalid JSON at column {err.colno}: {err.msg}") from None
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    return message


def _check_journals(polled: PolledList, selector: str) -> None:
    """Refuse up front when nothing matches or a journal has no message framing."""
    if not polled.current:
        raise CliError(str(EmptyPartitions(selector)))
    for journal in polled.current:
        content_type = content_type_of(journal.spec.labels)
        try:
            framing_for(content_type)
        except UnknownFraming:
            raise CliError(
                f"journal {journal.spec.name} has no message framing for its content-type "
                f"label ({content_type!r}); label it e.g. content-type=application/x-ndjson",
                DATA_ERROR,
            ) from None


async def _progress(tally: Counter[str], started: float) -> None:
    while True:
        await asyncio.sleep(_PROGRESS_EVERY)
        count = tally.total()
        rate = count / (time.monotonic() - started)
        click.echo(f"published {plural(count, 'message')} ({rate:,.0f}/s)", err=True)


async def publish_lines(publisher: Publisher, mapping: MappingFunc, source: IO[bytes],
                        tally: Counter[str], unpublished: IO[bytes] | None = None,
                        stop: asyncio.Event | None = None) -> None:
    """Publish each JSON line committed; stop at the first bad line (see the module doc).

    An append that fails stops the command too, with an exact account: how many of the
    messages read were committed, and (written to `unpublished`, then the input not read)
    the lines that were not, in input order, to publish again exactly once. So does
    `stop` (Ctrl-C): no line is published after it, and what was is settled first."""
    recording = _Recording(mapping)
    unsettled = _Unsettled()
    batches = LineInput(source)
    stop = stop or asyncio.Event()
    number, rest = 0, []
    try:
        while (lines := await batches.batch(stop)) is not None:
            for index, line in enumerate(lines):
                if stop.is_set():
                    rest = lines[index:]
                    break
                number += 1
                if not line.strip():
                    continue
                try:
                    future = await publisher.publish_committed(recording, _parse(line))
                except ValueError as err:
                    # An append that failed before this line is the one reported, and this
                    # line is among those to publish again; otherwise this line is.
                    rest, number = lines[index:], number - 1
                    await unsettled.settle()
                    kept = ""
                    if unpublished is not None:  # it and the input after it: not published
                        await _keep_rest(rest, batches, unpublished)
                        kept = f"; it and the input after it are in {unpublished.name}"
                    raise CliError(
                        f"input line {number + 1}: {err} (stopped there; the "
                        f"{plural(tally.total(), 'message')} before it "
                        f"{'was' if tally.total() == 1 else 'were'} published{kept})",
                        DATA_ERROR,
                    ) from None
                unsettled.add(future, number, line)
                tally[recording.journal] += 1
                if future.done() and future.exception() is not None:
                    rest = lines[index + 1:]  # a journal's appends failed: later ones would too
                    raise _AppendFailed from future.exception()
            if stop.is_set():
                break
        await unsettled.settle()
    except _AppendFailed as failure:
        await _report_failure(failure.__cause__, unsettled, tally, number, rest, batches,
                              unpublished)
    if stop.is_set():
        await _report_failure(None, unsettled, tally, number, rest, batches, unpublished,
                              interrupted=batches.file)


async def _report_failure(cause: BaseException | None, unsettled: _Unsettled,
                          tally: Counter[str], read: int, rest: list[bytes],
                          batches: LineInput, unpublished: IO[bytes] | None, *,
                          interrupted: bool | None = None) -> None:
    """Raise the account of a failed append (`cause`), or of an interruption: whether the
    input not read yet can be kept (a file's rest can; a pipe's is left unread)."""
    failed, unknown = await unsettled.failed(), await unsettled.unknown()
    committed = tally.total() - len(failed) - len(unknown)
    maybe = keep_unknown(unknown, unpublished, b"\n")
    account = (f"{committed:,} of the {tally.total():,} messages read were committed, "
               f"{len(failed):,} were not{maybe}")
    if unpublished is None:
        hint = ("; publishing the same input again would publish the committed ones twice "
                "(--unpublished FILE writes the lines not committed, and the rest of the "
                "input, to publish once)")
    else:
        for line in [*(line for _, line in failed), *rest]:
            unpublished.write(line + b"\n")
        # (interrupted is False: a pipe, read no further)
        hint = await batches.keep_unread(unpublished, interrupted is False, read)
        if interrupted is not False:
            hint += ": publish it to finish"
    if interrupted is not None:
        raise CliError(f"interrupted: {account}{hint}", INTERRUPTED)
    try:
        what = "; ".join(explain(cause)[0]) if cause is not None else "an append failed"
    except Exception:  # not one of the errors explained: its type and message
        what = f"{type(cause).__name__}: {cause}"
    raise CliError(f"{what}; {account}{hint}")


async def _keep_rest(rest: list[bytes], batches: LineInput, unpublished: IO[bytes]) -> None:
    """Write `rest` (lines read, not published) and then the input not read yet."""
    for line in rest:
        unpublished.write(line + b"\n")
    await batches.copy_rest(unpublished)


def _keep_all(source: IO[bytes], unpublished: IO[bytes]) -> None:
    """Nothing was published: the whole input is what is left to publish."""
    shutil.copyfileobj(source, unpublished)
    warn(f"nothing was published; the input is in {unpublished.name}")


@click.command("publish")
@click.option("-l", "--selector", required=True, metavar="SELECTOR",
              help='Label selector of the journals to publish to, e.g. "topic=clicks".')
@click.option("--key", "key", metavar="FIELD",
              help="Top-level field whose value maps a message to its journal.")
@click.option("-m", "--mapping", type=click.Choice(MAPPINGS), default=None,
              help="modulo (default with --key): FNV-1a hash modulo the journal count; "
                   "rendezvous: highest-random-weight hashing, moving few keys when journals "
                   "are added; random (default without --key).")
@click.option("-i", "--input", "input_path", default="-", show_default=True, metavar="FILE",
              help='JSON lines to publish ("-" for stdin).')
@click.option("--unpublished", "unpublished_path", default=None, metavar="FILE",
              type=click.Path(dir_okay=False, path_type=Path),
              help="If an append fails, write the lines that were not committed, and the input "
                   "not read yet, to FILE: publishing it then finishes the job exactly once.")
@broker_option
@security_options()
@async_command()
async def publish(selector: str, key: str | None, mapping: str | None, input_path: str,
                  unpublished_path: Path | None, broker: str, security: Security) -> None:
    """Publish JSON lines as committed messages to the journals matching SELECTOR.

    Each line must be a JSON object; its "uuid" field is set to the
    message's UUID. Progress goes to stderr every second; the command exits
    once everything published has committed. A bad line stops it (exit 2)
    after the lines before it are published.
    """
    if key is not None and not key.strip():
        raise click.UsageError("--key names a top-level field of the messages (got '')")
    parsed = parse_selector(selector)
    tally: Counter[str] = Counter()
    with opened_input(input_path) as source, \
            _opened_output(unpublished_path, source) as unpublished:
        reading = False
        try:
            async with BrokerClient(broker, security) as client, \
                    PolledList(client, parsed) as polled:
                _check_journals(polled, selector)
                mapping_func = _mapping(mapping, key, polled)
                started = time.monotonic()
                progress = asyncio.create_task(_progress(tally, started))
                try:
                    async with AppendService(client) as service, stop_on_signals() as stop:
                        reading = True
                        await publish_lines(Publisher(service), mapping_func, source, tally,
                                            unpublished, stop)
                except EmptyPartitions as err:  # every journal was deleted while publishing
                    raise CliError(str(err)) from None
                finally:
                    progress.cancel()
        except Exception:
            if unpublished is not None and not reading:  # (a broker out of reach, say)
                _keep_all(source, unpublished)
            raise
    count = tally.total()
    elapsed = time.monotonic() - started
    click.echo(f"published {plural(count, 'message')} to {plural(len(tally), 'journal')} "
               f"in {elapsed:.1f}s", err=True)

